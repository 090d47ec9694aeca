//! Synthetic prompts for the reference engine: deterministic pseudo-random token ids, one
//! function for the demo, the bench and the tests (each used to carry its own generator).

/// `n` token ids below `vocab` (xorshift64; `seed` picks the conversation, any value works,
/// 0 included).
pub fn prompt(n: usize, vocab: u32, seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % u64::from(vocab.max(1))) as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::prompt;

    #[test]
    fn prompts_are_deterministic_in_range_and_differ_by_seed() {
        let a = prompt(1000, 512, 0);
        assert_eq!(a, prompt(1000, 512, 0));
        assert!(a.iter().all(|&t| t < 512));
        assert_ne!(a, prompt(1000, 512, 1));
        // Not degenerate: most of the vocabulary shows up.
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert!(distinct.len() > 400, "{}", distinct.len());
    }
}
