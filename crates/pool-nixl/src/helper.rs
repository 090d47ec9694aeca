//! The NIXL helper process: the only place the engine's (untrusted) NIXL metadata is loaded.
//!
//! Run as `kvferry nixl-helper` (what the daemon spawns) or `kvferry-nixl-engine
//! --nixl-helper`, with a Unix stream socket as its stdin. It receives one `Attach` (the
//! engine's descriptor), builds a [`DirectBackend`] in this process, then serves `Staging`
//! (a memfd the daemon also maps, registered with this agent), `Read`/`Write` (NIXL transfers
//! between the engine's memory and that shared staging) and `DropStaging`, each answered with
//! a `Reply` carrying its request id. Transfers run concurrently. A crash here (corrupted UCX
//! keys) kills only this process: the daemon sees the socket close and fails that pool.
//! End of input (the daemon dropped the pool or died: the kernel closes its end) ends the
//! process. (Not `PR_SET_PDEATHSIG`: it fires when the spawning *thread* exits, and the daemon
//! attaches pools on short-lived blocking threads.)

use std::collections::{HashMap, HashSet};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvferry_pool::{Extent, MemoryBackend, PoolError, Staging};
use kvferry_pool_shm::Mapping;

use crate::direct::DirectBackend;
use crate::ipc::{self, Done, Reply, Request, WireError};

/// Runs the helper on this process's stdin (a Unix socket) and returns its exit code.
pub fn helper_main() -> ExitCode {
    let stream = match std::io::stdin().as_fd().try_clone_to_owned() {
        Ok(fd) => UnixStream::from(fd),
        Err(e) => {
            eprintln!("kvferry nixl-helper: stdin: {e}");
            return ExitCode::FAILURE;
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvferry nixl-helper: runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(serve(stream)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvferry nixl-helper: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Staging buffers by id; an id is absent while a transfer uses it.
#[derive(Default)]
struct Stagings {
    idle: HashMap<u64, Staging>,
    /// Dropped by the daemon while a transfer still used them: released when it ends.
    doomed: HashSet<u64>,
}

struct State {
    backend: DirectBackend,
    writer: Mutex<UnixStream>,
    stagings: Mutex<Stagings>,
}

impl State {
    fn reply(&self, req: u64, result: Result<Done, PoolError>) {
        let msg = Reply { req, result: result.map_err(|e| WireError::from(&e)) };
        let w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        // A daemon that went away cannot be told; the read loop ends on its EOF.
        let _ = ipc::send(&w, &msg, None);
    }

    fn stagings(&self) -> std::sync::MutexGuard<'_, Stagings> {
        self.stagings.lock().unwrap_or_else(|p| p.into_inner())
    }
}

type Incoming = Result<Option<(Request, Option<std::os::fd::OwnedFd>)>, PoolError>;

/// Reads frames on a plain thread (blocking socket) and hands them to the runtime.
fn spawn_reader(reader: UnixStream) -> tokio::sync::mpsc::UnboundedReceiver<Incoming> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        loop {
            let msg = ipc::recv::<Request>(&reader);
            let end = !matches!(msg, Ok(Some(_)));
            if tx.send(msg).is_err() || end {
                return;
            }
        }
    });
    rx
}

async fn serve(stream: UnixStream) -> Result<(), PoolError> {
    let mut rx = spawn_reader(stream.try_clone().map_err(|e| io("clone socket", e))?);
    // The first message must be the attach.
    let first = rx.recv().await.unwrap_or(Ok(None))?;
    let Some((Request::Attach { req, descriptor, agent_name, timeout_ms }, _)) = first else {
        return Err(io("protocol", "the first message must be attach"));
    };
    let backend = match DirectBackend::attach_with(&descriptor, agent_name, Duration::from_millis(timeout_ms))
    {
        Ok(b) => b,
        Err(e) => {
            let _ = ipc::send(&stream, &Reply { req, result: Err(WireError::from(&e)) }, None);
            return Ok(());
        }
    };
    let attached = Done::Attached { peer: backend.peer().to_owned(), agent_name: backend.agent_name() };
    ipc::send(&stream, &Reply { req, result: Ok(attached) }, None)?;
    let state = Arc::new(State { backend, writer: Mutex::new(stream), stagings: Mutex::default() });
    loop {
        let Some((msg, fd)) = rx.recv().await.unwrap_or(Ok(None))? else { return Ok(()) };
        match msg {
            Request::Attach { req, .. } => state.reply(req, Err(io("protocol", "attach twice"))),
            Request::Staging { req, id, len, cap } => {
                let r = fd.ok_or_else(|| io("protocol", "staging without an fd")).and_then(|fd| {
                    let staging = map_staging(fd, len, cap, state.backend.id())?;
                    let staging = state.backend.register(staging)?;
                    state.stagings().idle.insert(id, staging);
                    Ok(Done::Done)
                });
                state.reply(req, r);
            }
            Request::DropStaging { id } => {
                let mut s = state.stagings();
                if s.idle.remove(&id).is_none() {
                    s.doomed.insert(id);
                }
            }
            Request::Read { req, staging, extents } => spawn_transfer(&state, req, staging, extents, true),
            Request::Write { req, staging, extents } => spawn_transfer(&state, req, staging, extents, false),
        }
    }
}

fn spawn_transfer(state: &Arc<State>, req: u64, id: u64, extents: Vec<ipc::WireExtent>, read: bool) {
    let Some(mut staging) = state.stagings().idle.remove(&id) else {
        state.reply(req, Err(io("protocol", format!("staging {id} unknown or in use"))));
        return;
    };
    let state = state.clone();
    tokio::spawn(async move {
        let extents: Vec<Extent> =
            extents.into_iter().map(|(region, offset, len)| Extent { region, offset, len }).collect();
        let r = if read {
            state.backend.read(&extents, &mut staging).await
        } else {
            state.backend.write(&extents, &staging).await
        };
        {
            let mut s = state.stagings();
            if !s.doomed.remove(&id) {
                s.idle.insert(id, staging);
            }
        }
        state.reply(req, r.map(|()| Done::Done));
    });
}

/// This process's mapping of the daemon's staging memfd, as a `Staging` owned by `owner`.
fn map_staging(fd: std::os::fd::OwnedFd, len: usize, cap: usize, owner: u64) -> Result<Staging, PoolError> {
    if cap == 0 || len > cap || !cap.is_multiple_of(kvferry_pool::STAGING_ALIGN) {
        return Err(io("protocol", format!("staging len {len} cap {cap}")));
    }
    let mapping = Mapping::map(fd, cap as u64)?;
    let ptr = NonNull::new(mapping.as_ptr()).ok_or_else(|| io("mmap", "null mapping"))?;
    // SAFETY: `mapping` is a fresh MAP_SHARED mapping of `cap` bytes (page-aligned: mmap
    // returns page-aligned addresses, and cap is a multiple of 4096), kept alive until the
    // release callback drops it. This process creates no references into it; the daemon maps
    // the same pages and touches them only outside the transfers it asks for, which borrow its
    // own Staging (the protocol's contract, as for any registered buffer).
    Ok(unsafe { Staging::from_external(ptr, len, cap, owner, Box::new(move || drop(mapping))) })
}

fn io(what: &str, e: impl std::fmt::Display) -> PoolError {
    PoolError::Backend {
        backend: crate::BACKEND,
        retryable: false,
        detail: format!("NIXL helper {what}: {e}"),
    }
}
