//! Prompt block keys and what the engine publishes. The keys are the layout crate's canonical
//! chained, seedless SHA-256 block hashes (`kvferry_layout::block_hashes`, tenant string as the
//! salt) — the same function every region and the daemon compute, so no copy lives here — and
//! [`PublishedBlock`] (hash → physical block id).

pub use kvferry_layout::BlockHash;

/// Keys of the full `block_size`-token blocks of `tokens`, chained from `tenant_salt`.
pub fn block_keys(tenant_salt: &[u8], tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    kvferry_layout::block_hashes(tenant_salt, tokens, block_size as u32)
}

/// One block the engine holds and can serve: its content key and where it lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PublishedBlock {
    /// Chained content key.
    pub hash: BlockHash,
    /// Physical block id in this engine's pool.
    pub block_id: u32,
}

/// Lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_canonical_known_answer() {
        // Same vector as kvferry-layout's `hash::tests::known_answer`.
        let h = block_keys(b"tenant-0", &[1, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_eq!(hex(&h[0]), "cd1db9e0dd190991e3ffc61ba1019e493251fadad7aaa29bbec9aafbc7fb4d47");
        assert_eq!(hex(&h[1]), "2b1cd5429edac9b4c011dc1415ea323eb4e360daccaf2f63389525a50de37a20");
    }

    #[test]
    fn prefix_property_and_salt() {
        let t: Vec<u32> = (0..100).collect();
        let full = block_keys(b"s", &t, 16);
        assert_eq!(full.len(), 6);
        assert_eq!(block_keys(b"s", &t[..40], 16)[..], full[..2]);
        assert_ne!(block_keys(b"x", &t, 16)[0], full[0]);
    }
}
