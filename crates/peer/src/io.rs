//! Reading and writing protocol frames on a link's channels (QUIC streams or TLS-over-TCP
//! connections, see `crate::link`), and the sources and sinks of chunk bytes that the
//! transfer driver moves between pools and channels.

use std::future::Future;
use std::pin::Pin;

use kvferry_wire::frame::{self, Frame, PREFIX_LEN};
use kvferry_wire::{Cause, ChunkSpec, LocalError, WireError};
use tokio::sync::mpsc;

use crate::link::{ReadEnd, RecvHalf, SendHalf};

/// A boxed, sendable future.
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Chunk bytes owned by whoever produced them (a heap buffer, a pool staging buffer).
pub type ChunkBytes = Box<dyn AsRef<[u8]> + Send + Sync>;

/// Why a chunk could not be read or landed, by origin.
#[derive(Debug, thiserror::Error)]
pub enum ChunkError {
    /// The memory backend failed or refused the batch.
    #[error("pool: {0}")]
    Pool(#[from] kvferry_pool::PoolError),
    /// The chunk does not fit this side's layout or transfer (a layout mismatch or a bug).
    #[error("chunk {chunk}: {detail}")]
    Mismatch { chunk: u32, detail: String },
    /// The blocks were withdrawn or reused while they were read: the transfer must end.
    #[error("{0}")]
    Withdrawn(String),
    /// The blocking task that read, hashed or landed the chunk did not finish (it panicked,
    /// or the runtime is shutting down): nothing about the chunk's bytes is known.
    #[error("chunk {chunk}: its blocking task failed: {detail}")]
    Task { chunk: u32, detail: String },
}

impl From<ChunkError> for WireError {
    /// A chunk source's or sink's failure is this side's: kept typed as the local cause.
    fn from(e: ChunkError) -> Self {
        WireError::Local(LocalError::Memory(Cause::new(e)))
    }
}

/// Where the owner reads a chunk's bytes (in the layout's staging order).
pub trait ChunkSource: Send + Sync {
    /// Returns exactly `spec.len` bytes of chunk `spec`.
    fn read(&self, spec: ChunkSpec) -> BoxFut<'_, Result<ChunkBytes, ChunkError>>;

    /// Fault injection (feature `fault-injection`, test builds only): whether the owner
    /// corrupts chunk `spec`'s payload *after* checksumming it, as a bit flip in memory or on
    /// the wire would, so that the requester's verification is exercised end to end.
    #[cfg(feature = "fault-injection")]
    fn corrupt_after_checksum(&self, _spec: &ChunkSpec) -> bool {
        false
    }

    /// Fault injection (feature `fault-injection`, test builds only): lets the owner lie in
    /// chunk `spec`'s header after checksumming it (a wrong checksum, a chunk id out of range,
    /// blocks that were not requested, another transfer's id), as a lying peer would; the
    /// payload stays the real bytes. The requester must refuse it and ask again.
    #[cfg(feature = "fault-injection")]
    fn tamper_header(&self, _spec: &ChunkSpec, _header: &mut kvferry_wire::ChunkHeader) {}
}

/// Where the requester lands a verified chunk.
pub trait ChunkSink: Send + Sync {
    /// Writes a verified chunk's payload to its place.
    fn land<'a>(&'a self, spec: ChunkSpec, payload: &'a [u8]) -> BoxFut<'a, Result<(), ChunkError>>;
}

/// Flips one bit of the payload when `source` asks for it (see
/// [`ChunkSource::corrupt_after_checksum`]); the checksum already sent stays that of the
/// original bytes.
#[cfg(feature = "fault-injection")]
pub(crate) fn maybe_corrupt(source: &dyn ChunkSource, spec: &ChunkSpec, bytes: ChunkBytes) -> ChunkBytes {
    if !source.corrupt_after_checksum(spec) {
        return bytes;
    }
    let mut v = (*bytes).as_ref().to_vec();
    let mid = v.len() / 2;
    if let Some(b) = v.get_mut(mid) {
        *b ^= 0x01;
    }
    tracing::warn!(chunk = spec.id, "fault injection: corrupted a served chunk after its checksum");
    Box::new(v)
}

pub(crate) fn conn_err(e: impl std::fmt::Display) -> WireError {
    WireError::Connection(e.to_string())
}

/// Maps a QUIC connection error: a TLS failure (a crypto error code, 0x100–0x1ff: bad chain,
/// identity refused) is final — retrying cannot help; anything else is a lost connection.
pub(crate) fn from_conn_error(e: &quinn::ConnectionError) -> WireError {
    let crypto = |code: quinn::TransportErrorCode| (0x100..0x200).contains(&u64::from(code));
    match e {
        quinn::ConnectionError::TransportError(t) if crypto(t.code) => {
            WireError::NotAuthorised(t.to_string())
        }
        quinn::ConnectionError::ConnectionClosed(c) if crypto(c.error_code) => {
            WireError::NotAuthorised(c.to_string())
        }
        other => WireError::Connection(other.to_string()),
    }
}

pub(crate) fn read_err(e: quinn::ReadExactError) -> WireError {
    match e {
        quinn::ReadExactError::ReadError(quinn::ReadError::ConnectionLost(c)) => from_conn_error(&c),
        other => conn_err(other),
    }
}

pub(crate) fn write_err(e: quinn::WriteError) -> WireError {
    match e {
        quinn::WriteError::ConnectionLost(c) => from_conn_error(&c),
        other => conn_err(other),
    }
}

/// Reads one frame; `Ok(None)` when the stream ended cleanly at a frame boundary.
pub(crate) async fn read_frame(recv: &mut RecvHalf) -> Result<Option<Frame>, WireError> {
    let mut prefix = [0u8; PREFIX_LEN];
    match recv.read_exact(&mut prefix).await {
        Ok(()) => {}
        Err(ReadEnd::Finished(0)) => return Ok(None),
        Err(e) => return Err(read_end(e)),
    }
    // Validate the prefix (magic, version, type, size limit) before allocating the body.
    if let Err(e) = frame::decode(&prefix) {
        return Err(WireError::Decode(e));
    }
    let len = u32::from_le_bytes([prefix[4], prefix[5], prefix[6], prefix[7]]) as usize;
    let mut buf = vec![0u8; PREFIX_LEN + len];
    buf[..PREFIX_LEN].copy_from_slice(&prefix);
    recv.read_exact(&mut buf[PREFIX_LEN..]).await.map_err(read_end)?;
    match frame::decode(&buf)? {
        Some((f, _)) => Ok(Some(f)),
        None => Err(WireError::Protocol("frame shorter than its length".into())),
    }
}

/// A read that stopped short, as an error: a channel that ended inside a frame or a payload.
pub(crate) fn read_end(e: ReadEnd) -> WireError {
    match e {
        ReadEnd::Finished(n) => WireError::Connection(format!("channel ended after {n} bytes of a read")),
        ReadEnd::Failed(e) => e,
    }
}

/// Writes one frame.
pub(crate) async fn write_frame(send: &mut SendHalf, f: &Frame) -> Result<(), WireError> {
    let bytes = frame::encode_to_vec(f);
    send.write_all(&bytes).await
}

/// Aborts its tasks when dropped (a driver that returns early leaves no reader behind).
pub(crate) struct AbortOnDrop(pub(crate) Vec<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for h in &self.0 {
            h.abort();
        }
    }
}

/// Forwards a request's control frames to its driver until the stream ends or fails.
pub(crate) async fn control_reader(mut recv: RecvHalf, tx: mpsc::Sender<Result<Frame, WireError>>) {
    loop {
        let item = match read_frame(&mut recv).await {
            Ok(Some(f)) => Ok(f),
            Ok(None) => return,
            Err(e) => Err(e),
        };
        let stop = item.is_err();
        if tx.send(item).await.is_err() || stop {
            return;
        }
    }
}
