//! Chunk checksums and the transfer digest.
//!
//! xxh3-128, chosen by measurement over crc32c and BLAKE3 (see `bench/results/wire-checksum.md`):
//! it is the fastest of the three on this machine class, and 128 bits make an undetected random
//! corruption practically impossible. It is not a MAC: authenticity and tamper-resistance come
//! from TLS 1.3 on the QUIC connection. The checksum is seeded with the transfer and chunk id,
//! so a payload that lands under the wrong chunk id does not verify.

use xxhash_rust::xxh3::{xxh3_128, xxh3_128_with_seed};

/// Checksum of one chunk's payload.
pub fn chunk_checksum(transfer_id: u128, chunk_id: u32, payload: &[u8]) -> u128 {
    let seed = (transfer_id as u64) ^ ((transfer_id >> 64) as u64) ^ (u64::from(chunk_id) << 32 | 0x9E37);
    xxh3_128_with_seed(payload, seed)
}

/// A payload's length and checksum under one transfer and chunk id, computed apart from the
/// protocol's state machines: a driver hashes a chunk off its network thread
/// ([`Summed::of`]) and hands the result to [`crate::Owner::chunk_ready_summed`] or
/// [`crate::Requester::on_chunk_summed`]. Its fields are private, so a `Summed` only ever
/// comes from hashing real bytes, and it names the transfer and chunk it was computed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Summed {
    transfer_id: u128,
    chunk_id: u32,
    len: u64,
    checksum: u128,
}

impl Summed {
    /// Hashes `payload` as chunk `chunk_id` of transfer `transfer_id`.
    pub fn of(transfer_id: u128, chunk_id: u32, payload: &[u8]) -> Self {
        Self {
            transfer_id,
            chunk_id,
            len: payload.len() as u64,
            checksum: chunk_checksum(transfer_id, chunk_id, payload),
        }
    }

    /// The checksum, if it was computed for this transfer and chunk.
    pub fn checksum_for(&self, transfer_id: u128, chunk_id: u32) -> Option<u128> {
        (self.transfer_id == transfer_id && self.chunk_id == chunk_id).then_some(self.checksum)
    }

    /// The payload's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the payload was empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Digest over every chunk's checksum in chunk-id order; both sides compute it independently.
pub fn transfer_digest(transfer_id: u128, checksums: &[u128]) -> u128 {
    let mut buf = Vec::with_capacity(16 + checksums.len() * 16);
    buf.extend_from_slice(&transfer_id.to_le_bytes());
    for c in checksums {
        buf.extend_from_slice(&c.to_le_bytes());
    }
    xxh3_128(&buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bound_to_chunk_and_transfer() {
        let p = vec![7u8; 4096];
        let a = chunk_checksum(1, 0, &p);
        assert_ne!(a, chunk_checksum(1, 1, &p));
        assert_ne!(a, chunk_checksum(2, 0, &p));
        let mut q = p.clone();
        q[4095] ^= 1;
        assert_ne!(a, chunk_checksum(1, 0, &q));
        assert_ne!(transfer_digest(1, &[1, 2]), transfer_digest(1, &[2, 1]));
        let s = Summed::of(1, 0, &p);
        assert_eq!(s.checksum_for(1, 0), Some(a));
        assert_eq!(s.checksum_for(1, 1), None, "bound to its chunk");
        assert_eq!(s.checksum_for(2, 0), None, "bound to its transfer");
        assert_eq!((s.len(), s.is_empty()), (4096, false));
    }
}
