//! Frames of the peer protocol and their binary codec (sans-IO).
//!
//! Every frame is `magic u16 | version u8 | type u8 | body_len u32 | body`, little-endian. A
//! chunk frame's body is its header; the chunk payload (`len` bytes) follows the frame on the
//! same stream and is not part of the body. Decoding is incremental (`Ok(None)` = need more
//! bytes), bounded (every length is checked against a limit before anything is allocated) and
//! total: any byte string yields a frame, `None`, or a typed [`DecodeError`] — never a panic.
//! This module owns the byte format only; what a frame means is the state machines' business.

use thiserror::Error;

/// "KF".
pub const MAGIC: u16 = 0x464B;
/// Protocol version.
pub const VERSION: u8 = 1;
/// Fixed prefix length: magic, version, type, body length.
pub const PREFIX_LEN: usize = 8;
/// Most block hashes one request may name (2^18 blocks = 4M tokens at block size 16).
pub const MAX_BLOCKS: usize = 1 << 18;
/// Longest tenant or detail string.
pub const MAX_STRING: usize = 1024;
/// Largest chunk payload a peer may announce.
pub const MAX_CHUNK_BYTES: u64 = 256 << 20;
/// Largest frame body.
pub const MAX_BODY: usize = 16 + 2 + MAX_STRING + 32 + 4 + MAX_BLOCKS * 32 + 4 + MAX_BLOCKS * 4 + 8;

/// A 32-byte content key of one KV block (chained SHA-256 over its tokens).
pub type BlockHash = [u8; 32];

/// Requester → owner: fetch these blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchRequest {
    /// Random id chosen by the requester; reused when it resumes.
    pub transfer_id: u128,
    /// Tenant the blocks belong to (their hashes are salted with it).
    pub tenant: String,
    /// Digest of the requester's layout fingerprint; the owner's must be equal.
    pub fingerprint: [u8; 32],
    /// The blocks, in prefix order.
    pub block_hashes: Vec<BlockHash>,
    /// Chunk ids the requester already holds verified (resume).
    pub have_chunks: Vec<u32>,
    /// Chunk payload size the requester asks for.
    pub chunk_target_bytes: u32,
}

/// Owner → requester: what will be sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Manifest {
    pub transfer_id: u128,
    /// The owner holds the first `blocks_held` requested blocks (a prefix).
    pub blocks_held: u32,
    /// Layers per block.
    pub layers: u32,
    /// Bytes of one block in one layer (all planes).
    pub bytes_per_block_layer: u64,
    /// The chunk size the owner will use; both sides derive the same chunk plan from it.
    pub chunk_target_bytes: u32,
    /// Total payload bytes of the transfer.
    pub total_bytes: u64,
    /// Number of chunks in the plan.
    pub chunk_count: u32,
}

/// Why an owner refuses a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RefusalCode {
    /// The owner holds none of the requested blocks.
    UnknownBlocks = 1,
    /// Layout fingerprints differ.
    FingerprintMismatch = 2,
    /// The blocks belong to another tenant.
    TenantMismatch = 3,
    /// The owner is out of capacity; retry later.
    Overloaded = 4,
    /// The peer is not allowed to read these blocks.
    NotAuthorized = 5,
    /// The request is malformed (bad chunk ids, sizes).
    BadRequest = 6,
    /// The owner failed internally.
    Internal = 7,
}

impl RefusalCode {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::UnknownBlocks,
            2 => Self::FingerprintMismatch,
            3 => Self::TenantMismatch,
            4 => Self::Overloaded,
            5 => Self::NotAuthorized,
            6 => Self::BadRequest,
            7 => Self::Internal,
            _ => return None,
        })
    }

    /// Whether asking again later can succeed.
    pub fn retryable(self) -> bool {
        matches!(self, Self::Overloaded | Self::Internal)
    }
}

/// Owner → requester: a typed refusal, sent before any KV byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub transfer_id: u128,
    pub code: RefusalCode,
    pub detail: String,
}

/// Header of one chunk; `len` payload bytes follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    pub transfer_id: u128,
    pub chunk_id: u32,
    /// Blocks `[start, end)` of the request's block list.
    pub blocks: (u32, u32),
    /// Layers `[start, end)`.
    pub layers: (u32, u32),
    /// Payload length.
    pub len: u64,
    /// xxh3-128 of the payload, seeded with the chunk id (see `checksum`).
    pub checksum: u128,
}

/// Owner → requester: every chunk has been sent at least once; the transfer digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Done {
    pub transfer_id: u128,
    pub digest: u128,
}

/// Requester → owner: send these chunks again (they failed verification or never arrived).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retransmit {
    pub transfer_id: u128,
    pub chunk_ids: Vec<u32>,
}

/// Either side: stop this transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cancel {
    pub transfer_id: u128,
    pub detail: String,
}

/// Requester → owner: digest matched, the blocks are committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Complete {
    pub transfer_id: u128,
}

/// Requester → owner: a link probe. The owner answers on the same stream with this frame echoed
/// and then `bytes` synthetic (zero) bytes, or with a [`Refusal`] when `bytes` is over its cap.
/// No KV byte is involved; it needs the same mutually authenticated connection as a fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probe {
    pub transfer_id: u128,
    /// Synthetic payload bytes asked for (the owner caps it; the codec does not).
    pub bytes: u64,
}

/// Owner → requester, after the manifest answering a [`Frame::Query`]: how loaded the owner's
/// fetch path is right now, so the requester's decision can price the queue it would join.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadReport {
    pub transfer_id: u128,
    /// Transfers the owner is serving now.
    pub active_transfers: u32,
    /// Serving staging bytes in use, and the bound.
    pub staging_used: u64,
    pub staging_bound: u64,
    /// The owner's egress cap toward the asking region, bits/s (0: none). A requester prices
    /// the fetch at no more than this, whatever the link could carry. On the wire only when
    /// set (appended last, never as 0, so the encoding stays canonical): a report without it,
    /// as peers before the field send, decodes as 0.
    pub egress_cap_bps: u64,
}

/// Every frame of the protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Request(FetchRequest),
    Manifest(Manifest),
    Refusal(Refusal),
    Chunk(ChunkHeader),
    Done(Done),
    Retransmit(Retransmit),
    Cancel(Cancel),
    Complete(Complete),
    Probe(Probe),
    /// Requester → owner: how many of these blocks do you hold? Same body as a request; the
    /// owner answers with a [`Manifest`] (nothing follows it) or a [`Refusal`], and reads no
    /// KV byte. This is how a region decides before the first byte moves.
    Query(FetchRequest),
    Load(LoadReport),
}

impl Frame {
    fn kind(&self) -> u8 {
        match self {
            Frame::Request(_) => 1,
            Frame::Manifest(_) => 2,
            Frame::Refusal(_) => 3,
            Frame::Chunk(_) => 4,
            Frame::Done(_) => 5,
            Frame::Retransmit(_) => 6,
            Frame::Cancel(_) => 7,
            Frame::Complete(_) => 8,
            Frame::Probe(_) => 9,
            Frame::Query(_) => 10,
            Frame::Load(_) => 11,
        }
    }

    /// The transfer this frame belongs to.
    pub fn transfer_id(&self) -> u128 {
        match self {
            Frame::Request(f) => f.transfer_id,
            Frame::Manifest(f) => f.transfer_id,
            Frame::Refusal(f) => f.transfer_id,
            Frame::Chunk(f) => f.transfer_id,
            Frame::Done(f) => f.transfer_id,
            Frame::Retransmit(f) => f.transfer_id,
            Frame::Cancel(f) => f.transfer_id,
            Frame::Complete(f) => f.transfer_id,
            Frame::Probe(f) => f.transfer_id,
            Frame::Query(f) => f.transfer_id,
            Frame::Load(f) => f.transfer_id,
        }
    }
}

/// A byte string that is not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DecodeError {
    #[error("bad magic {0:#06x}")]
    BadMagic(u16),
    #[error("unsupported protocol version {0}")]
    BadVersion(u8),
    #[error("unknown frame type {0}")]
    UnknownType(u8),
    #[error("frame body of {len} bytes exceeds the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    #[error("{what}: {len} exceeds the limit {max}")]
    LimitExceeded { what: &'static str, len: u64, max: u64 },
    #[error("frame body truncated while reading {0}")]
    Truncated(&'static str),
    #[error("{0} trailing bytes after the frame body")]
    Trailing(usize),
    #[error("{0} is not valid UTF-8")]
    BadUtf8(&'static str),
    #[error("unknown refusal code {0}")]
    BadRefusalCode(u8),
    #[error("invalid range {what}: [{start}, {end})")]
    BadRange { what: &'static str, start: u32, end: u32 },
    #[error("optional field {0} sent as 0 (absent means 0)")]
    ZeroField(&'static str),
}

/// Appends the encoding of `frame` to `out`.
pub fn encode(frame: &Frame, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.push(VERSION);
    out.push(frame.kind());
    out.extend_from_slice(&[0; 4]);
    let body = out.len();
    let mut w = Writer(out);
    match frame {
        Frame::Request(r) | Frame::Query(r) => {
            w.u128(r.transfer_id);
            w.str(&r.tenant);
            w.bytes(&r.fingerprint);
            w.u32(r.block_hashes.len() as u32);
            for h in &r.block_hashes {
                w.bytes(h);
            }
            w.u32(r.have_chunks.len() as u32);
            for c in &r.have_chunks {
                w.u32(*c);
            }
            w.u32(r.chunk_target_bytes);
        }
        Frame::Manifest(m) => {
            w.u128(m.transfer_id);
            w.u32(m.blocks_held);
            w.u32(m.layers);
            w.u64(m.bytes_per_block_layer);
            w.u32(m.chunk_target_bytes);
            w.u64(m.total_bytes);
            w.u32(m.chunk_count);
        }
        Frame::Refusal(r) => {
            w.u128(r.transfer_id);
            w.0.push(r.code as u8);
            w.str(&r.detail);
        }
        Frame::Chunk(c) => {
            w.u128(c.transfer_id);
            w.u32(c.chunk_id);
            w.u32(c.blocks.0);
            w.u32(c.blocks.1);
            w.u32(c.layers.0);
            w.u32(c.layers.1);
            w.u64(c.len);
            w.u128(c.checksum);
        }
        Frame::Done(d) => {
            w.u128(d.transfer_id);
            w.u128(d.digest);
        }
        Frame::Retransmit(r) => {
            w.u128(r.transfer_id);
            w.u32(r.chunk_ids.len() as u32);
            for c in &r.chunk_ids {
                w.u32(*c);
            }
        }
        Frame::Cancel(c) => {
            w.u128(c.transfer_id);
            w.str(&c.detail);
        }
        Frame::Complete(c) => w.u128(c.transfer_id),
        Frame::Probe(p) => {
            w.u128(p.transfer_id);
            w.u64(p.bytes);
        }
        Frame::Load(l) => {
            w.u128(l.transfer_id);
            w.u32(l.active_transfers);
            w.u64(l.staging_used);
            w.u64(l.staging_bound);
            if l.egress_cap_bps > 0 {
                w.u64(l.egress_cap_bps);
            }
        }
    }
    let len = (out.len() - body) as u32;
    out[start + 4..start + 8].copy_from_slice(&len.to_le_bytes());
}

/// Encodes one frame into a new buffer.
pub fn encode_to_vec(frame: &Frame) -> Vec<u8> {
    let mut v = Vec::new();
    encode(frame, &mut v);
    v
}

/// Decodes one frame from the front of `buf`: `Ok(Some((frame, consumed)))`, or `Ok(None)` when
/// more bytes are needed. A chunk frame's payload is not consumed.
pub fn decode(buf: &[u8]) -> Result<Option<(Frame, usize)>, DecodeError> {
    if buf.len() < PREFIX_LEN {
        // Reject garbage as early as possible.
        if buf.len() >= 2 {
            let magic = u16::from_le_bytes([buf[0], buf[1]]);
            if magic != MAGIC {
                return Err(DecodeError::BadMagic(magic));
            }
        }
        return Ok(None);
    }
    let magic = u16::from_le_bytes([buf[0], buf[1]]);
    if magic != MAGIC {
        return Err(DecodeError::BadMagic(magic));
    }
    if buf[2] != VERSION {
        return Err(DecodeError::BadVersion(buf[2]));
    }
    let kind = buf[3];
    if !(1..=11).contains(&kind) {
        return Err(DecodeError::UnknownType(kind));
    }
    let len = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]) as usize;
    if len > MAX_BODY {
        return Err(DecodeError::TooLarge { len, max: MAX_BODY });
    }
    let Some(body) = buf.get(PREFIX_LEN..PREFIX_LEN + len) else { return Ok(None) };
    let mut r = Reader(body);
    let frame = match kind {
        1 | 10 => {
            let transfer_id = r.u128("transfer_id")?;
            let tenant = r.str("tenant")?;
            let fingerprint = r.array::<32>("fingerprint")?;
            let n = r.count("block_hashes", MAX_BLOCKS, 32)?;
            let mut block_hashes = Vec::with_capacity(n);
            for _ in 0..n {
                block_hashes.push(r.array::<32>("block hash")?);
            }
            let n = r.count("have_chunks", MAX_BLOCKS, 4)?;
            let mut have_chunks = Vec::with_capacity(n);
            for _ in 0..n {
                have_chunks.push(r.u32("have_chunks")?);
            }
            let chunk_target_bytes = r.u32("chunk_target_bytes")?;
            let req = FetchRequest {
                transfer_id,
                tenant,
                fingerprint,
                block_hashes,
                have_chunks,
                chunk_target_bytes,
            };
            if kind == 1 { Frame::Request(req) } else { Frame::Query(req) }
        }
        2 => Frame::Manifest(Manifest {
            transfer_id: r.u128("transfer_id")?,
            blocks_held: r.u32("blocks_held")?,
            layers: r.u32("layers")?,
            bytes_per_block_layer: r.u64("bytes_per_block_layer")?,
            chunk_target_bytes: r.u32("chunk_target_bytes")?,
            total_bytes: r.u64("total_bytes")?,
            chunk_count: r.u32("chunk_count")?,
        }),
        3 => {
            let transfer_id = r.u128("transfer_id")?;
            let code = r.u8("code")?;
            let code = RefusalCode::from_u8(code).ok_or(DecodeError::BadRefusalCode(code))?;
            Frame::Refusal(Refusal { transfer_id, code, detail: r.str("detail")? })
        }
        4 => {
            let transfer_id = r.u128("transfer_id")?;
            let chunk_id = r.u32("chunk_id")?;
            let blocks = r.range("blocks")?;
            let layers = r.range("layers")?;
            let len = r.u64("len")?;
            if len > MAX_CHUNK_BYTES {
                return Err(DecodeError::LimitExceeded { what: "chunk len", len, max: MAX_CHUNK_BYTES });
            }
            let checksum = r.u128("checksum")?;
            Frame::Chunk(ChunkHeader { transfer_id, chunk_id, blocks, layers, len, checksum })
        }
        5 => Frame::Done(Done { transfer_id: r.u128("transfer_id")?, digest: r.u128("digest")? }),
        6 => {
            let transfer_id = r.u128("transfer_id")?;
            let n = r.count("chunk_ids", MAX_BLOCKS, 4)?;
            let mut chunk_ids = Vec::with_capacity(n);
            for _ in 0..n {
                chunk_ids.push(r.u32("chunk_ids")?);
            }
            Frame::Retransmit(Retransmit { transfer_id, chunk_ids })
        }
        7 => Frame::Cancel(Cancel { transfer_id: r.u128("transfer_id")?, detail: r.str("detail")? }),
        8 => Frame::Complete(Complete { transfer_id: r.u128("transfer_id")? }),
        11 => Frame::Load(LoadReport {
            transfer_id: r.u128("transfer_id")?,
            active_transfers: r.u32("active_transfers")?,
            staging_used: r.u64("staging_used")?,
            staging_bound: r.u64("staging_bound")?,
            egress_cap_bps: if r.0.is_empty() {
                0
            } else {
                match r.u64("egress_cap_bps")? {
                    0 => return Err(DecodeError::ZeroField("egress_cap_bps")),
                    cap => cap,
                }
            },
        }),
        9 => Frame::Probe(Probe { transfer_id: r.u128("transfer_id")?, bytes: r.u64("bytes")? }),
        _ => return Err(DecodeError::UnknownType(kind)),
    };
    if !r.0.is_empty() {
        return Err(DecodeError::Trailing(r.0.len()));
    }
    Ok(Some((frame, PREFIX_LEN + len)))
}

struct Writer<'a>(&'a mut Vec<u8>);

impl Writer<'_> {
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u128(&mut self, v: u128) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }
    fn str(&mut self, s: &str) {
        // Strings longer than the limit are cut at a char boundary so the frame stays decodable.
        let mut end = s.len().min(MAX_STRING);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.0.extend_from_slice(&(end as u16).to_le_bytes());
        self.0.extend_from_slice(&s.as_bytes()[..end]);
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&[u8], DecodeError> {
        if self.0.len() < n {
            return Err(DecodeError::Truncated(what));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], DecodeError> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    fn u128(&mut self, what: &'static str) -> Result<u128, DecodeError> {
        Ok(u128::from_le_bytes(self.array(what)?))
    }
    fn str(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let n = u16::from_le_bytes(self.array(what)?) as usize;
        if n > MAX_STRING {
            return Err(DecodeError::LimitExceeded { what, len: n as u64, max: MAX_STRING as u64 });
        }
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError::BadUtf8(what))
    }
    /// A count of items of `item` bytes each; checked against the limit and the bytes left.
    fn count(&mut self, what: &'static str, max: usize, item: usize) -> Result<usize, DecodeError> {
        let n = self.u32(what)? as usize;
        if n > max {
            return Err(DecodeError::LimitExceeded { what, len: n as u64, max: max as u64 });
        }
        if n * item > self.0.len() {
            return Err(DecodeError::Truncated(what));
        }
        Ok(n)
    }
    fn range(&mut self, what: &'static str) -> Result<(u32, u32), DecodeError> {
        let start = self.u32(what)?;
        let end = self.u32(what)?;
        if start >= end {
            return Err(DecodeError::BadRange { what, start, end });
        }
        Ok((start, end))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn samples() -> Vec<Frame> {
        vec![
            Frame::Request(FetchRequest {
                transfer_id: 0xDEAD_BEEF_0123_4567_89AB_CDEF_0011_2233,
                tenant: "tenant-ä".into(),
                fingerprint: [7; 32],
                block_hashes: vec![[1; 32], [2; 32], [3; 32]],
                have_chunks: vec![0, 5],
                chunk_target_bytes: 4 << 20,
            }),
            Frame::Manifest(Manifest {
                transfer_id: 1,
                blocks_held: 3,
                layers: 80,
                bytes_per_block_layer: 65536,
                chunk_target_bytes: 4 << 20,
                total_bytes: 3 * 80 * 65536,
                chunk_count: 4,
            }),
            Frame::Refusal(Refusal {
                transfer_id: 2,
                code: RefusalCode::TenantMismatch,
                detail: "no".into(),
            }),
            Frame::Chunk(ChunkHeader {
                transfer_id: 3,
                chunk_id: 9,
                blocks: (0, 3),
                layers: (4, 8),
                len: 1 << 20,
                checksum: u128::MAX - 5,
            }),
            Frame::Done(Done { transfer_id: 4, digest: 42 }),
            Frame::Retransmit(Retransmit { transfer_id: 5, chunk_ids: vec![1, 2, 3] }),
            Frame::Cancel(Cancel { transfer_id: 6, detail: "deadline".into() }),
            Frame::Complete(Complete { transfer_id: 7 }),
            Frame::Load(LoadReport {
                transfer_id: 9,
                active_transfers: 3,
                staging_used: 1 << 20,
                staging_bound: 1 << 28,
                egress_cap_bps: 2_000_000,
            }),
            Frame::Query(FetchRequest {
                transfer_id: 8,
                tenant: "t".into(),
                fingerprint: [1; 32],
                block_hashes: vec![[9; 32]],
                have_chunks: vec![],
                chunk_target_bytes: 0,
            }),
            Frame::Probe(Probe { transfer_id: 8, bytes: 64 << 20 }),
        ]
    }

    #[test]
    fn round_trip_every_frame() {
        for f in samples() {
            let bytes = encode_to_vec(&f);
            let (back, used) = decode(&bytes).unwrap().unwrap();
            assert_eq!(back, f);
            assert_eq!(used, bytes.len());
            // Every strict prefix is "need more bytes", never an error or a wrong frame.
            for cut in 0..bytes.len() {
                assert_eq!(decode(&bytes[..cut]), Ok(None), "{f:?} cut at {cut}");
            }
        }
    }

    #[test]
    fn a_load_report_without_the_egress_cap_decodes_as_uncapped() {
        let with = LoadReport {
            transfer_id: 3,
            active_transfers: 1,
            staging_used: 5,
            staging_bound: 9,
            egress_cap_bps: 7,
        };
        let mut b = encode_to_vec(&Frame::Load(with));
        // The report as a peer without the field sends it: 8 bytes shorter.
        b.truncate(b.len() - 8);
        let len = (b.len() - PREFIX_LEN) as u32;
        b[4..8].copy_from_slice(&len.to_le_bytes());
        let (back, _) = decode(&b).unwrap().unwrap();
        assert_eq!(back, Frame::Load(LoadReport { egress_cap_bps: 0, ..with }));
        // An explicit 0 is refused (it would have two encodings).
        let mut b = encode_to_vec(&Frame::Load(LoadReport { egress_cap_bps: 1, ..with }));
        let n = b.len();
        b[n - 8..].copy_from_slice(&0u64.to_le_bytes());
        assert_eq!(decode(&b), Err(DecodeError::ZeroField("egress_cap_bps")));
        // A partial field is refused, not read as a cap.
        let mut b = encode_to_vec(&Frame::Load(LoadReport { egress_cap_bps: 7, ..with }));
        b.truncate(b.len() - 4);
        let len = (b.len() - PREFIX_LEN) as u32;
        b[4..8].copy_from_slice(&len.to_le_bytes());
        assert!(decode(&b).is_err());
    }

    #[test]
    fn refuses_garbage_with_a_reason() {
        assert_eq!(decode(&[0, 0]), Err(DecodeError::BadMagic(0)));
        let mut b = encode_to_vec(&samples()[4]);
        b[2] = 9;
        assert_eq!(decode(&b), Err(DecodeError::BadVersion(9)));
        let mut b = encode_to_vec(&samples()[4]);
        b[3] = 99;
        assert_eq!(decode(&b), Err(DecodeError::UnknownType(99)));
        let mut b = encode_to_vec(&samples()[3]);
        // blocks (3, 0): an empty range.
        let at = PREFIX_LEN + 16 + 4;
        b[at..at + 4].copy_from_slice(&3u32.to_le_bytes());
        b[at + 4..at + 8].copy_from_slice(&0u32.to_le_bytes());
        assert!(matches!(decode(&b), Err(DecodeError::BadRange { what: "blocks", .. })));
        // A request claiming 2^18+1 hashes.
        let mut b = encode_to_vec(&samples()[0]);
        let at = PREFIX_LEN + 16 + 2 + "tenant-ä".len() + 32;
        b[at..at + 4].copy_from_slice(&((MAX_BLOCKS as u32) + 1).to_le_bytes());
        assert!(matches!(decode(&b), Err(DecodeError::LimitExceeded { what: "block_hashes", .. })));
        // A body longer than its frame type: trailing bytes.
        let mut b = encode_to_vec(&samples()[7]);
        b.push(0);
        let len = (b.len() - PREFIX_LEN) as u32;
        b[4..8].copy_from_slice(&len.to_le_bytes());
        assert_eq!(decode(&b), Err(DecodeError::Trailing(1)));
    }
}
