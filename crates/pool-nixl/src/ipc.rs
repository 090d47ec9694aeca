//! The daemon ↔ NIXL-helper protocol: typed messages as length-prefixed JSON frames over a
//! Unix stream socket, a file descriptor (a staging memfd) riding on a frame's first byte.
//!
//! Pure data plus two blocking functions ([`send`], [`recv`]); no NIXL here, so both the
//! daemon side and the helper side share it. Frame: `u32le` body length (at most
//! [`MAX_FRAME`]), JSON body.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use kvferry_pool::PoolError;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags,
};
use serde::{Deserialize, Serialize};

use crate::descriptor::NixlPoolDescriptor;

/// Largest frame either side accepts (a descriptor with its metadata is the largest message).
pub(crate) const MAX_FRAME: u32 = 64 << 20;

/// One extent as it travels: `(region, offset, len)`.
pub(crate) type WireExtent = (u32, u64, u64);

/// Daemon → helper.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(crate) enum Request {
    /// Load the engine's metadata and check its regions (the untrusted step).
    Attach { req: u64, descriptor: NixlPoolDescriptor, agent_name: Option<String>, timeout_ms: u64 },
    /// Map the attached memfd (`cap` bytes) and register it as staging buffer `id`.
    Staging { req: u64, id: u64, len: usize, cap: usize },
    /// Deregister and unmap staging buffer `id` (no reply).
    DropStaging { id: u64 },
    /// NIXL READ: engine pool → staging `staging`.
    Read { req: u64, staging: u64, extents: Vec<WireExtent> },
    /// NIXL WRITE: staging `staging` → engine pool.
    Write { req: u64, staging: u64, extents: Vec<WireExtent> },
}

/// Error kinds that survive the trip (everything else arrives as a backend error).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum ErrorKind {
    BadMetadata,
    Closed,
    Backend,
}

/// A `PoolError` in transit.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct WireError {
    pub(crate) kind: ErrorKind,
    pub(crate) retryable: bool,
    pub(crate) detail: String,
}

impl From<&PoolError> for WireError {
    fn from(e: &PoolError) -> Self {
        match e {
            PoolError::BadMetadata(d) => {
                Self { kind: ErrorKind::BadMetadata, retryable: false, detail: d.clone() }
            }
            PoolError::Closed => Self { kind: ErrorKind::Closed, retryable: false, detail: String::new() },
            PoolError::Backend { retryable, detail, .. } => {
                Self { kind: ErrorKind::Backend, retryable: *retryable, detail: detail.clone() }
            }
            other => {
                Self { kind: ErrorKind::Backend, retryable: other.is_retryable(), detail: other.to_string() }
            }
        }
    }
}

impl From<WireError> for PoolError {
    fn from(e: WireError) -> Self {
        match e.kind {
            ErrorKind::BadMetadata => PoolError::BadMetadata(e.detail),
            ErrorKind::Closed => PoolError::Closed,
            ErrorKind::Backend => {
                PoolError::Backend { backend: crate::BACKEND, retryable: e.retryable, detail: e.detail }
            }
        }
    }
}

/// What went well.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "ok", rename_all = "snake_case")]
pub(crate) enum Done {
    /// Attached: the engine's agent name and the helper's.
    Attached { peer: String, agent_name: String },
    /// Staging registered, or a transfer finished.
    Done,
}

/// Helper → daemon: the answer to request `req`.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Reply {
    pub(crate) req: u64,
    pub(crate) result: Result<Done, WireError>,
}

fn io_err(what: &str, e: impl std::fmt::Display) -> PoolError {
    PoolError::Backend {
        backend: crate::BACKEND,
        retryable: false,
        detail: format!("NIXL helper {what}: {e}"),
    }
}

/// Send `msg` (with `fd` attached when given). Blocking.
pub(crate) fn send<T: Serialize>(
    stream: &UnixStream,
    msg: &T,
    fd: Option<BorrowedFd<'_>>,
) -> Result<(), PoolError> {
    let body = serde_json::to_vec(msg).map_err(|e| io_err("encode", e))?;
    let len = u32::try_from(body.len())
        .ok()
        .filter(|&l| l <= MAX_FRAME)
        .ok_or_else(|| io_err("frame", "too large"))?;
    let head = len.to_le_bytes();
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&head);
    frame.extend_from_slice(&body);
    let mut sent = 0;
    if let Some(fd) = fd {
        let fds = [fd];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
            return Err(io_err("sendmsg", "ancillary buffer too small"));
        }
        sent = rustix::net::sendmsg(stream, &[IoSlice::new(&frame)], &mut control, SendFlags::NOSIGNAL)
            .map_err(|e| io_err("sendmsg", e))?;
    }
    let mut w = stream;
    w.write_all(&frame[sent..]).map_err(|e| {
        if e.kind() == std::io::ErrorKind::BrokenPipe { PoolError::Closed } else { io_err("write", e) }
    })
}

/// Receive one message and the fd that came with it, if any. `Ok(None)`: the other side closed
/// the socket between frames. Blocking.
pub(crate) fn recv<T: for<'de> Deserialize<'de>>(
    stream: &UnixStream,
) -> Result<Option<(T, Option<OwnedFd>)>, PoolError> {
    let mut head = [0u8; 4];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = {
        let mut iov = [IoSliceMut::new(&mut head)];
        rustix::net::recvmsg(stream, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)
            .map_err(|e| io_err("recvmsg", e))?
    };
    let mut fds: Vec<OwnedFd> = Vec::new();
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(it) = msg {
            fds.extend(it);
        }
    }
    if got.bytes == 0 {
        return Ok(None);
    }
    let mut r = stream;
    let eof = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof { PoolError::Closed } else { io_err("read", e) }
    };
    r.read_exact(&mut head[got.bytes..]).map_err(eof)?;
    let len = u32::from_le_bytes(head);
    if len > MAX_FRAME {
        return Err(io_err("frame", format!("{len} bytes exceeds {MAX_FRAME}")));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).map_err(eof)?;
    if fds.len() > 1 {
        return Err(io_err("frame", format!("{} fds attached, at most 1 expected", fds.len())));
    }
    let msg = serde_json::from_slice(&body).map_err(|e| io_err("decode", e))?;
    Ok(Some((msg, fds.pop())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_with_and_without_an_fd() {
        let (a, b) = UnixStream::pair().expect("pair");
        let msg = Request::Read { req: 7, staging: 3, extents: vec![(0, 4096, 8192), (1, 0, 1)] };
        send(&a, &msg, None).expect("send");
        let (got, fd): (Request, _) = recv(&b).expect("recv").expect("a frame");
        assert!(fd.is_none());
        assert!(matches!(got, Request::Read { req: 7, staging: 3, ref extents } if extents.len() == 2));
        let file = tempfile_fd();
        send(
            &a,
            &Request::Staging { req: 8, id: 1, len: 10, cap: 4096 },
            Some(std::os::fd::AsFd::as_fd(&file)),
        )
        .expect("send with fd");
        let (got, fd): (Request, _) = recv(&b).expect("recv").expect("a frame");
        assert!(matches!(got, Request::Staging { req: 8, id: 1, len: 10, cap: 4096 }));
        assert!(fd.is_some(), "the fd came along");
        drop(a);
        assert!(recv::<Request>(&b).expect("clean close").is_none());
    }

    #[test]
    fn errors_keep_their_kind_across_the_trip() {
        for e in [
            PoolError::BadMetadata("x".into()),
            PoolError::Closed,
            PoolError::Backend { backend: "nixl", retryable: true, detail: "y".into() },
        ] {
            let back: PoolError = WireError::from(&e).into();
            assert_eq!(back.to_string(), e.to_string());
            assert_eq!(back.is_retryable(), e.is_retryable());
        }
    }

    fn tempfile_fd() -> std::fs::File {
        std::fs::File::open("/dev/null").expect("open /dev/null")
    }
}
