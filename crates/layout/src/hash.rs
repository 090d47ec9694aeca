//! Block identity: chained, seedless SHA-256 block hashes over token ids that every region
//! computes alike without sharing state, with a per-tenant salt mixed into the first block.
//!
//! Encoding (version 1, pinned by a known-answer test):
//! - `h0 = SHA256(u64le(len(salt)) || salt || u64le(n) || u32le(t0) .. u32le(t_{n-1}))`
//! - `hi = SHA256(h_{i-1} || u64le(n) || u32le tokens of block i)`
//!
//! where `n = block_size` (only full blocks are hashed; a trailing partial block has no key).

use sha2::{Digest, Sha256};

/// A 32-byte block key.
pub type BlockHash = [u8; 32];

/// Keys of the full blocks of `token_ids`, chained from the tenant's salt.
///
/// Same tokens and tenant → same keys in every process; a different salt changes every key
/// (the salt feeds block 0 and each key feeds the next); the keys of a prefix are a prefix of
/// the keys.
///
/// # Panics
/// If `block_size` is 0.
pub fn block_hashes(tenant_salt: &[u8], token_ids: &[u32], block_size: u32) -> Vec<BlockHash> {
    assert!(block_size > 0, "block_hashes: block_size must be positive");
    let mut out: Vec<BlockHash> = Vec::with_capacity(token_ids.len() / block_size as usize);
    for block in token_ids.chunks_exact(block_size as usize) {
        let mut h = Sha256::new();
        match out.last() {
            None => {
                h.update((tenant_salt.len() as u64).to_le_bytes());
                h.update(tenant_salt);
            }
            Some(parent) => h.update(parent),
        }
        h.update((block.len() as u64).to_le_bytes());
        for t in block {
            h.update(t.to_le_bytes());
        }
        out.push(h.finalize().into());
    }
    out
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(n: u32) -> Vec<u32> {
        (0..n).map(|i| i.wrapping_mul(2_654_435_761) % 128_256).collect()
    }

    #[test]
    fn deterministic_per_tenant() {
        let t = tokens(100);
        let a = block_hashes(b"tenant-a", &t, 16);
        assert_eq!(a.len(), 6, "only full blocks");
        assert_eq!(a, block_hashes(b"tenant-a", &t, 16));
        let b = block_hashes(b"tenant-b", &t, 16);
        assert!(a.iter().all(|h| !b.contains(h)), "another tenant shares a key");
        let none = block_hashes(b"", &t, 16);
        assert!(a.iter().all(|h| !none.contains(h)));
    }

    #[test]
    fn prefix_property() {
        let t = tokens(256);
        let full = block_hashes(b"s", &t, 16);
        for cut in [0, 15, 16, 17, 100, 255] {
            let p = block_hashes(b"s", &t[..cut], 16);
            assert_eq!(p[..], full[..p.len()], "cut {cut}");
            assert_eq!(p.len(), cut / 16);
        }
    }

    #[test]
    fn a_changed_token_changes_its_block_and_all_later() {
        let t = tokens(64);
        let mut u = t.clone();
        u[20] ^= 1;
        let (a, b) = (block_hashes(b"s", &t, 16), block_hashes(b"s", &u, 16));
        assert_eq!(a[0], b[0]);
        assert!(a[1..].iter().zip(&b[1..]).all(|(x, y)| x != y));
    }

    #[test]
    fn salt_boundary_is_unambiguous() {
        // Without the length prefix, salt "ab"+tokens and salt "a"+... could collide.
        assert_ne!(block_hashes(b"", &[1, 2], 2), block_hashes(&1u32.to_le_bytes(), &[2, 0], 2));
    }

    #[test]
    fn known_answer() {
        let h = block_hashes(b"tenant-0", &[1, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_eq!(h.len(), 2);
        // Computed independently with Python's hashlib over the documented encoding.
        assert_eq!(hex(&h[0]), KAT0);
        assert_eq!(hex(&h[1]), KAT1);
    }

    const KAT0: &str = "cd1db9e0dd190991e3ffc61ba1019e493251fadad7aaa29bbec9aafbc7fb4d47";
    const KAT1: &str = "2b1cd5429edac9b4c011dc1415ea323eb4e360daccaf2f63389525a50de37a20";
}
