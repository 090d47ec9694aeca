//! Passing a pool between processes: the engine sends one [`Offer`] (model id, optional
//! layout, region table) with the memfd attached as `SCM_RIGHTS` over a Unix stream socket;
//! the daemon receives it, re-validates everything and maps it.
//!
//! Frame: `b"KVFSHM01"`, `u32le` body length (at most 16 MiB), JSON body. The fd rides on the
//! first byte of the frame. Blocking std sockets: call from a blocking context.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use kvferry_layout::PoolLayout;
use kvferry_pool::PoolError;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags,
};
use serde::{Deserialize, Serialize};

use crate::{RegionTable, ShmBackend};

/// Frame magic (and version).
pub const MAGIC: [u8; 8] = *b"KVFSHM01";
/// Largest accepted body.
pub const MAX_BODY: u32 = 16 << 20;

/// What an engine offers with its pool's fd.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offer {
    /// Model identity (part of the layout fingerprint).
    pub model_id: String,
    /// The pool's layout, when the engine describes one (its region lengths must equal the
    /// table's).
    pub layout: Option<PoolLayout>,
    /// Where the regions sit in the file.
    pub table: RegionTable,
}

fn io(what: &str, e: impl std::fmt::Display) -> PoolError {
    PoolError::Backend { backend: "shm", retryable: false, detail: format!("{what}: {e}") }
}

/// Send `offer` with `fd` attached.
pub fn send_offer(stream: &UnixStream, offer: &Offer, fd: BorrowedFd<'_>) -> Result<(), PoolError> {
    let body = serde_json::to_vec(offer).map_err(|e| io("encode offer", e))?;
    send_frame(stream, &body, fd)
}

/// Send one frame with an arbitrary `body` and `fd` attached. [`send_offer`] is the normal
/// way; this exists so tools and tests can send what a broken or hostile engine would.
pub fn send_frame(stream: &UnixStream, body: &[u8], fd: BorrowedFd<'_>) -> Result<(), PoolError> {
    let len =
        u32::try_from(body.len()).ok().filter(|&l| l <= MAX_BODY).ok_or_else(|| io("offer", "too large"))?;
    let mut head = [0u8; 12];
    head[..8].copy_from_slice(&MAGIC);
    head[8..].copy_from_slice(&len.to_le_bytes());
    let fds = [fd];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io("sendmsg", "ancillary buffer too small"));
    }
    let iov = [IoSlice::new(&head), IoSlice::new(body)];
    let sent = rustix::net::sendmsg(stream, &iov, &mut control, SendFlags::NOSIGNAL)
        .map_err(|e| io("sendmsg", e))?;
    // The fd went with the first byte; finish the frame with plain writes.
    let frame_len = head.len() + body.len();
    if sent < frame_len {
        let mut w = stream;
        let rest: Vec<u8> = head.iter().chain(body).skip(sent).copied().collect();
        w.write_all(&rest).map_err(|e| io("write offer", e))?;
    }
    Ok(())
}

/// Receive an offer and its fd. A peer that closes before sending a whole frame gives
/// [`PoolError::Closed`]; a frame without an fd, with a bad magic, an oversized or malformed
/// body, or a layout that disagrees with the table gives [`PoolError::BadMetadata`].
pub fn recv_offer(stream: &UnixStream) -> Result<(Offer, OwnedFd), PoolError> {
    let mut head = [0u8; 12];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = {
        let mut iov = [IoSliceMut::new(&mut head)];
        rustix::net::recvmsg(stream, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)
            .map_err(|e| io("recvmsg", e))?
    };
    let mut fds: Vec<OwnedFd> = Vec::new();
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(it) = msg {
            fds.extend(it);
        }
    }
    if got.bytes == 0 {
        return Err(PoolError::Closed);
    }
    let mut r = stream;
    r.read_exact(&mut head[got.bytes..]).map_err(eof_is_closed)?;
    if head[..8] != MAGIC {
        return Err(PoolError::BadMetadata(format!("bad frame magic {:02x?}", &head[..8])));
    }
    let len = u32::from_le_bytes(head[8..].try_into().expect("4 bytes"));
    if len > MAX_BODY {
        return Err(PoolError::BadMetadata(format!("offer body of {len} bytes exceeds {MAX_BODY}")));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).map_err(eof_is_closed)?;
    if fds.len() != 1 {
        return Err(PoolError::BadMetadata(format!("offer carried {} fds, expected 1", fds.len())));
    }
    let offer: Offer =
        serde_json::from_slice(&body).map_err(|e| PoolError::BadMetadata(format!("offer: {e}")))?;
    if let Some(layout) = &offer.layout
        && layout.region_lens() != offer.table.lens()
    {
        return Err(PoolError::BadMetadata(format!(
            "layout region lengths {:?} differ from the shared table's {:?}",
            layout.region_lens(),
            offer.table.lens()
        )));
    }
    Ok((offer, fds.pop().expect("one fd")))
}

fn eof_is_closed(e: std::io::Error) -> PoolError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof { PoolError::Closed } else { io("read offer", e) }
}

/// Receive an offer and map it: the daemon's side of sharing a pool.
pub fn accept_pool(stream: &UnixStream) -> Result<(Offer, ShmBackend), PoolError> {
    let (offer, fd) = recv_offer(stream)?;
    let backend = ShmBackend::new(fd, offer.table.clone())?;
    Ok((offer, backend))
}
