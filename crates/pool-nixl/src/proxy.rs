//! Daemon side: [`NixlBackend`], a `MemoryBackend` over an engine's NIXL-registered pool whose
//! NIXL side runs in a helper process (one per pool).
//!
//! Why a process: NIXL's `loadRemoteMD` hands the engine's packed UCX addresses and keys to
//! UCX, which trusts them. A well-framed blob with corrupted bytes can crash the loading
//! process, and whether it does depends on that process's UCX state: the same blob that a
//! throwaway checker loaded cleanly failed endpoint creation in the loading process
//! (`failed to unpack address, invalid bandwidth 0.00`, then SIGSEGV in CI). So the daemon
//! never loads engine metadata and never creates NIXL agents at all: the helper does, and a
//! crash there fails that one pool (`PoolError::Backend`, not retryable) while the daemon
//! serves on. This also gives every pool its own agent in its own process, so no two NIXL
//! agents ever share a process's UCX state.
//!
//! Data path: staging buffers are memfds mapped by both processes; NIXL moves bytes between
//! the engine's memory and the helper's mapping of the same pages, so there is no extra copy.
//! Each read/write is one request/reply over the socket (tens of microseconds).
//!
//! Cancellation: dropping a read/write future stops waiting; the helper still finishes (or
//! times out) the transfer into the shared staging pages, which it keeps mapped until then.
//! The daemon's own mapping is released when its `Staging` drops, so no daemon memory is
//! ever written after it was freed.

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Stdio};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvferry_pool::{
    BoxFut, Extent, MemoryBackend, PoolError, RegionInfo, STAGING_ALIGN, Staging, check_batch,
    next_backend_id,
};
use kvferry_pool_shm::{Mapping, create_memfd};

use crate::BACKEND;
use crate::descriptor::{NixlPoolDescriptor, NixlRegion};
use crate::ipc::{self, Done, Reply, Request};
use crate::options::NixlOptions;

/// How long the daemon waits past the helper's own transfer timeout before giving up on a
/// reply, and how long attach and staging registration may take.
const REPLY_GRACE: Duration = Duration::from_secs(5);
const SETUP_TIMEOUT: Duration = Duration::from_secs(60);

type Answer = Result<Done, PoolError>;

enum Waiter {
    Blocking(std::sync::mpsc::Sender<Answer>),
    Async(tokio::sync::oneshot::Sender<Answer>),
}

impl Waiter {
    fn send(self, a: Answer) {
        match self {
            Waiter::Blocking(tx) => drop(tx.send(a)),
            Waiter::Async(tx) => drop(tx.send(a)),
        }
    }
}

#[derive(Default)]
struct Pending {
    waiters: HashMap<u64, Waiter>,
    /// Why the helper is gone, once it is.
    dead: Option<String>,
}

/// The socket to one helper, its pending requests and the child process.
struct Conn {
    writer: Mutex<UnixStream>,
    pending: Mutex<Pending>,
    next: AtomicU64,
    child: Mutex<Option<Child>>,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn").finish_non_exhaustive()
    }
}

fn gone(why: &str) -> PoolError {
    PoolError::Backend { backend: BACKEND, retryable: false, detail: format!("NIXL helper gone: {why}") }
}

impl Conn {
    fn pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `waiter` and sends the request that `make` builds with the new id.
    fn submit(
        &self,
        make: impl FnOnce(u64) -> Request,
        fd: Option<std::os::fd::BorrowedFd<'_>>,
        waiter: Waiter,
    ) -> Result<u64, PoolError> {
        let req = self.next.fetch_add(1, Ordering::Relaxed);
        {
            let mut p = self.pending();
            if let Some(why) = &p.dead {
                return Err(gone(why));
            }
            p.waiters.insert(req, waiter);
        }
        let sent = {
            let w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
            ipc::send(&w, &make(req), fd)
        };
        if let Err(e) = sent {
            self.pending().waiters.remove(&req);
            if matches!(e, PoolError::Closed) {
                // The socket closed under our send: the helper is gone. Say so the same way
                // the reader thread does, whichever of the two noticed first.
                let why = self.exit_reason();
                self.pending().dead.get_or_insert_with(|| why.clone());
                return Err(gone(&why));
            }
            return Err(e);
        }
        Ok(req)
    }

    /// Fire and forget (no reply expected).
    fn notify(&self, msg: &Request) {
        let w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let _ = ipc::send(&w, msg, None);
    }

    /// A blocking request (attach, staging): waits up to `timeout`.
    fn call(
        &self,
        make: impl FnOnce(u64) -> Request,
        fd: Option<std::os::fd::BorrowedFd<'_>>,
        timeout: Duration,
    ) -> Answer {
        let (tx, rx) = std::sync::mpsc::channel();
        let req = self.submit(make, fd, Waiter::Blocking(tx))?;
        match rx.recv_timeout(timeout) {
            Ok(a) => a,
            Err(_) => {
                self.pending().waiters.remove(&req);
                Err(PoolError::Backend {
                    backend: BACKEND,
                    retryable: false,
                    detail: format!("NIXL helper did not answer within {timeout:?}"),
                })
            }
        }
    }

    /// Called by the reader thread when the socket ends: every waiter gets the reason.
    fn died(&self) {
        let why = self.exit_reason();
        let waiters: Vec<Waiter> = {
            let mut p = self.pending();
            p.dead = Some(why.clone());
            p.waiters.drain().map(|(_, w)| w).collect()
        };
        for w in waiters {
            w.send(Err(gone(&why)));
        }
    }

    /// How the child ended (waits briefly for its exit status).
    fn exit_reason(&self) -> String {
        use std::os::unix::process::ExitStatusExt;
        let mut child = self.child.lock().unwrap_or_else(|p| p.into_inner());
        let Some(c) = child.as_mut() else { return "closed".into() };
        let until = Instant::now() + Duration::from_millis(500);
        loop {
            match c.try_wait() {
                Ok(Some(st)) => {
                    return match (st.code(), st.signal()) {
                        (_, Some(sig)) => format!("the helper process died of signal {sig}"),
                        (Some(code), _) => format!("the helper process exited with status {code}"),
                        _ => format!("the helper process ended ({st})"),
                    };
                }
                Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(5)),
                _ => return "the helper closed its socket".into(),
            }
        }
    }
}

fn reader_loop(conn: Arc<Conn>, reader: UnixStream) {
    loop {
        match ipc::recv::<Reply>(&reader) {
            Ok(Some((reply, _))) => {
                let waiter = conn.pending().waiters.remove(&reply.req);
                if let Some(w) = waiter {
                    w.send(reply.result.map_err(PoolError::from));
                }
            }
            Ok(None) | Err(_) => {
                conn.died();
                return;
            }
        }
    }
}

/// An engine's pool as seen from the daemon: NIXL READ/WRITE carried out by a helper process
/// that holds the engine's metadata. See the module docs for why.
#[derive(Debug)]
pub struct NixlBackend {
    id: u64,
    conn: Arc<Conn>,
    peer: String,
    agent_name: String,
    regions: Vec<NixlRegion>,
    infos: Vec<RegionInfo>,
    timeout: Duration,
    next_staging: AtomicU64,
    /// Staging buffers registered in the helper and idle, for reuse (see [`StagingCache`]).
    cache: Arc<StagingCache>,
}

/// Idle staging buffers, still registered in the helper: registering a new memfd there costs
/// milliseconds (a Load or a served chunk used to pay it every time). Buffers come back here
/// when their `Staging` drops, up to [`STAGING_CACHE_BYTES`]; beyond that, and when the
/// backend goes, they are released. A reused buffer is zeroed before it is handed out again,
/// so no caller ever sees bytes another transfer left.
#[derive(Default)]
struct StagingCache {
    idle: Mutex<Vec<Idle>>,
}

impl std::fmt::Debug for StagingCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A poisoned list is still a list of idle buffers (each push/pop is whole).
        let n = self.idle.lock().unwrap_or_else(|p| p.into_inner()).len();
        f.debug_struct("StagingCache").field("idle", &n).finish()
    }
}

/// Idle staging memory kept per NIXL pool.
const STAGING_CACHE_BYTES: usize = 64 << 20;

struct Idle {
    mapping: Mapping,
    id: u64,
    cap: usize,
}

impl StagingCache {
    /// An idle buffer of exactly `cap` bytes, if one is cached.
    fn take(&self, cap: usize) -> Option<Idle> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let i = idle.iter().position(|b| b.cap == cap)?;
        Some(idle.swap_remove(i))
    }

    /// Keeps `b` for reuse, or releases it in the helper when the cache is full.
    fn put(&self, b: Idle, conn: &Conn) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let held: usize = idle.iter().map(|b| b.cap).sum();
        if held + b.cap <= STAGING_CACHE_BYTES {
            idle.push(b);
        } else {
            drop(idle);
            conn.notify(&Request::DropStaging { id: b.id });
        }
    }
}

impl NixlBackend {
    /// Attach to the pool `desc` describes, with default options (which name no helper, so
    /// this fails: use [`NixlBackend::attach_with`]).
    pub fn attach(desc: &NixlPoolDescriptor) -> Result<Self, PoolError> {
        Self::attach_with(desc, NixlOptions::default())
    }

    /// Attach to the pool `desc` describes.
    ///
    /// Validates the descriptor and the metadata's header here (no NIXL involved), starts the
    /// helper, which loads the metadata (NIXL's refusal becomes `PoolError::BadMetadata`),
    /// checks the loaded agent's name and that every region is covered by its registrations.
    /// A helper that crashes while doing so gives `PoolError::BadMetadata` naming the signal.
    pub fn attach_with(desc: &NixlPoolDescriptor, opts: NixlOptions) -> Result<Self, PoolError> {
        desc.validate()?;
        let Some(helper) = &opts.helper else {
            return Err(PoolError::Backend {
                backend: BACKEND,
                retryable: false,
                detail: "no NIXL helper program given: engine metadata is loaded only in a helper process"
                    .into(),
            });
        };
        let id = next_backend_id();
        let agent_name =
            opts.agent_name.clone().unwrap_or_else(|| format!("kvferry-daemon-{}-{id}", std::process::id()));
        if agent_name == desc.agent_name {
            return Err(PoolError::BadMetadata(format!(
                "engine agent {agent_name:?} has the daemon agent's name: agent names must be unique"
            )));
        }
        let (ours, theirs) = UnixStream::pair().map_err(|e| io("socketpair", e))?;
        let child = Command::new(&helper.program)
            .args(&helper.args)
            .stdin(Stdio::from(std::os::fd::OwnedFd::from(theirs)))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| io(&format!("start {}", helper.program.display()), e))?;
        let reader = ours.try_clone().map_err(|e| io("clone socket", e))?;
        let conn = Arc::new(Conn {
            writer: Mutex::new(ours),
            pending: Mutex::default(),
            next: AtomicU64::new(1),
            child: Mutex::new(Some(child)),
        });
        {
            let conn = conn.clone();
            std::thread::Builder::new()
                .name("nixl-helper-rx".into())
                .spawn(move || reader_loop(conn, reader))
                .map_err(|e| io("spawn reader thread", e))?;
        }
        let timeout_ms = u64::try_from(opts.timeout.as_millis()).unwrap_or(u64::MAX);
        let attached = conn.call(
            |req| Request::Attach {
                req,
                descriptor: desc.clone(),
                agent_name: Some(agent_name.clone()),
                timeout_ms,
            },
            None,
            SETUP_TIMEOUT,
        );
        let (peer, agent_name) = match attached {
            Ok(Done::Attached { peer, agent_name }) => (peer, agent_name),
            Ok(Done::Done) => return Err(io("protocol", "attach answered without an agent")),
            Err(e) => {
                // However the failure surfaced (a reply saying the helper is gone, or our send
                // hitting a closed socket because it died first), a helper killed by a signal
                // while attaching is the crash this design isolates: refuse the metadata.
                let why = conn.exit_reason();
                if why.contains("died of signal") {
                    return Err(PoolError::BadMetadata(format!(
                        "the engine's NIXL metadata crashed the isolated helper ({why}); refused"
                    )));
                }
                return Err(e);
            }
        };
        let infos = desc.regions.iter().map(|r| RegionInfo { len: r.len }).collect();
        Ok(Self {
            id,
            conn,
            peer,
            agent_name,
            regions: desc.regions.clone(),
            infos,
            timeout: opts.timeout,
            next_staging: AtomicU64::new(1),
            cache: Arc::default(),
        })
    }

    /// Name of the engine's agent this backend talks to.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Name of the helper's NIXL agent.
    pub fn agent_name(&self) -> String {
        self.agent_name.clone()
    }

    /// The engine's regions (addresses in the engine's address space).
    pub fn nixl_regions(&self) -> &[NixlRegion] {
        &self.regions
    }

    /// Process id of the helper (tests kill it to check the failure path).
    pub fn helper_pid(&self) -> Option<u32> {
        self.conn.child.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(Child::id)
    }

    fn wire_extents(extents: &[Extent]) -> Vec<ipc::WireExtent> {
        extents.iter().map(|e| (e.region, e.offset, e.len)).collect()
    }

    async fn transfer(&self, staging: u64, extents: &[Extent], read: bool) -> Result<(), PoolError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let extents = Self::wire_extents(extents);
        let req = self.conn.submit(
            |req| {
                if read {
                    Request::Read { req, staging, extents }
                } else {
                    Request::Write { req, staging, extents }
                }
            },
            None,
            Waiter::Async(tx),
        )?;
        // Stop waiting if the caller drops us: the reply then finds no waiter.
        struct Forget<'a>(&'a Conn, u64);
        impl Drop for Forget<'_> {
            fn drop(&mut self) {
                self.0.pending().waiters.remove(&self.1);
            }
        }
        let _forget = Forget(&self.conn, req);
        match tokio::time::timeout(self.timeout + REPLY_GRACE, rx).await {
            Ok(Ok(answer)) => answer.map(|_| ()),
            Ok(Err(_)) => Err(gone("reply channel closed")),
            Err(_) => Err(PoolError::Backend {
                backend: BACKEND,
                retryable: true,
                detail: format!(
                    "NIXL helper did not finish a transfer within {:?}",
                    self.timeout + REPLY_GRACE
                ),
            }),
        }
    }
}

impl Drop for NixlBackend {
    fn drop(&mut self) {
        // Closing our end ends the helper (EOF); reap it off this thread, killing it if it lingers.
        // Poisoned or not, the socket must be shut so the helper sees EOF and exits.
        let w = self.conn.writer.lock().unwrap_or_else(|p| p.into_inner());
        let _ = w.shutdown(std::net::Shutdown::Both);
        drop(w);
        let child = self.conn.child.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(mut child) = child {
            let _ = std::thread::Builder::new().name("nixl-helper-reap".into()).spawn(move || {
                let until = Instant::now() + Duration::from_secs(5);
                while Instant::now() < until {
                    if let Ok(Some(_)) = child.try_wait() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                let _ = child.kill();
                let _ = child.wait();
            });
        }
    }
}

/// Drops the helper's side of a staging buffer when the daemon's side goes.
/// Marks a Staging as this backend's, with its helper-side id (its release is the cache's).
struct StagingGuard {
    id: u64,
}

/// The helper-side id of a staging buffer this backend allocated.
fn staging_id(staging: &Staging) -> Option<u64> {
    staging.guard().and_then(|g| g.downcast_ref::<StagingGuard>()).map(|g| g.id)
}

impl MemoryBackend for NixlBackend {
    fn name(&self) -> &'static str {
        BACKEND
    }

    fn id(&self) -> u64 {
        self.id
    }

    fn regions(&self) -> &[RegionInfo] {
        &self.infos
    }

    fn staging(&self, len: usize) -> Result<Staging, PoolError> {
        if len == 0 {
            return Ok(Staging::new_host(0, self.id));
        }
        // Capacities are powers of two (at least one alignment unit) so that buffers recycle.
        let cap = len
            .checked_next_power_of_two()
            .map(|c| c.max(STAGING_ALIGN))
            .ok_or_else(|| io("staging", "length overflows"))?;
        let b = match self.cache.take(cap) {
            Some(b) => {
                // SAFETY: the mapping is `cap >= len` bytes, writable, and idle: it came out of
                // the cache, so no Staging refers to it and the helper moves no byte of it.
                unsafe { std::ptr::write_bytes(b.mapping.as_ptr(), 0, len) };
                b
            }
            None => {
                let fd = create_memfd("kvferry-nixl-staging", cap as u64)?;
                let helper_fd = fd.try_clone().map_err(|e| io("dup staging fd", e))?;
                let mapping = Mapping::map(fd, cap as u64)?;
                let id = self.next_staging.fetch_add(1, Ordering::Relaxed);
                self.conn.call(
                    |req| Request::Staging { req, id, len: cap, cap },
                    Some(std::os::fd::AsFd::as_fd(&helper_fd)),
                    SETUP_TIMEOUT,
                )?;
                Idle { mapping, id, cap }
            }
        };
        let ptr = NonNull::new(b.mapping.as_ptr()).ok_or_else(|| io("mmap", "null mapping"))?;
        let (id, cache, conn) = (b.id, self.cache.clone(), self.conn.clone());
        // SAFETY: `b.mapping` is a MAP_SHARED mapping of `cap` bytes (mmap returns page-aligned
        // addresses; cap is a multiple of 4096), zero-filled (by the kernel when new, by us
        // when reused) over its first `len` bytes, kept alive until the release callback hands
        // it back to the cache or drops it, and referenced by nothing else in this process.
        // The helper touches the same pages only during the transfers this backend's
        // read/write ask for, which borrow the Staging for their whole duration.
        let staging =
            unsafe { Staging::from_external(ptr, len, cap, self.id, Box::new(move || cache.put(b, &conn))) };
        Ok(staging.with_guard(Box::new(StagingGuard { id })))
    }

    fn read<'a>(
        &'a self,
        extents: &'a [Extent],
        staging: &'a mut Staging,
    ) -> BoxFut<'a, Result<(), PoolError>> {
        Box::pin(async move {
            check_batch(&self.infos, extents, staging.len(), staging.owner(), self.id)?;
            if extents.iter().all(|e| e.len == 0) {
                return Ok(());
            }
            let id = staging_id(staging).ok_or(PoolError::ForeignStaging)?;
            // `staging` stays mutably borrowed by this future until the helper answered.
            self.transfer(id, extents, true).await
        })
    }

    fn write<'a>(&'a self, extents: &'a [Extent], staging: &'a Staging) -> BoxFut<'a, Result<(), PoolError>> {
        Box::pin(async move {
            check_batch(&self.infos, extents, staging.len(), staging.owner(), self.id)?;
            if extents.iter().all(|e| e.len == 0) {
                return Ok(());
            }
            let id = staging_id(staging).ok_or(PoolError::ForeignStaging)?;
            self.transfer(id, extents, false).await
        })
    }
}

fn io(what: &str, e: impl std::fmt::Display) -> PoolError {
    PoolError::Backend { backend: BACKEND, retryable: false, detail: format!("NIXL helper {what}: {e}") }
}
