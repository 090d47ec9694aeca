//! Prompt block keys and what the engine publishes: a LOCAL COPY of the canonical chained
//! SHA-256 block hash (the layout crate owns the canonical `kvferry_layout::hash::block_hashes`;
//! this copy follows the same documented encoding and is pinned by the same known-answer
//! vector, so swapping it for the canonical function changes nothing), and
//! [`PublishedBlock`] (hash → physical block id).
//!
//! Encoding (v1): `h0 = SHA256(u64le(len salt) || salt || u64le(n) || u32le tokens of block 0)`,
//! `hi = SHA256(h_{i-1} || u64le(n) || u32le tokens of block i)`; only full blocks have keys.

use sha2::{Digest, Sha256};

/// A 32-byte block key.
pub type BlockHash = [u8; 32];

/// Keys of the full `block_size`-token blocks of `tokens`, chained from `tenant_salt`.
/// Local copy of the layout crate's canonical function (same encoding).
///
/// # Panics
/// If `block_size` is 0.
pub fn block_hashes_local_copy(tenant_salt: &[u8], tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    assert!(block_size > 0, "block_size must be positive");
    let mut out: Vec<BlockHash> = Vec::with_capacity(tokens.len() / block_size);
    for block in tokens.chunks_exact(block_size) {
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
        let h = block_hashes_local_copy(b"tenant-0", &[1, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_eq!(hex(&h[0]), "cd1db9e0dd190991e3ffc61ba1019e493251fadad7aaa29bbec9aafbc7fb4d47");
        assert_eq!(hex(&h[1]), "2b1cd5429edac9b4c011dc1415ea323eb4e360daccaf2f63389525a50de37a20");
    }

    #[test]
    fn prefix_property_and_salt() {
        let t: Vec<u32> = (0..100).collect();
        let full = block_hashes_local_copy(b"s", &t, 16);
        assert_eq!(full.len(), 6);
        assert_eq!(block_hashes_local_copy(b"s", &t[..40], 16)[..], full[..2]);
        assert_ne!(block_hashes_local_copy(b"x", &t, 16)[0], full[0]);
    }
}
