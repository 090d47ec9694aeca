//! [`CudaBackend`]: an engine's KV pool opened from CUDA IPC handles (or, in-process, from raw
//! device pointers), implementing [`MemoryBackend`].
//!
//! The daemon never frees pool memory: IPC mappings are closed with `cuIpcCloseMemHandle` on
//! drop, raw pointers are merely forgotten. Staging is pinned with `cuMemHostRegister`
//! (portable, device-mapped; never write-combined) and unpinned by its guard. Each batch is
//! validated by `check_batch` before the first copy is enqueued.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream, sys};
use kvferry_pool::{
    BoxFut, Extent, MemoryBackend, PoolError, RegionInfo, Staging, check_batch, next_backend_id,
};

use crate::copy::{Pending, StreamFence, enqueue_memcpy};
use crate::descriptor::{CudaIpcDescriptor, IPC_HANDLE_LEN};
use crate::driver::{check, context, driver_err};
use crate::kernel::Kernel;
use crate::plan::{Direction, coalesce};
use crate::{CudaError, EnginePool};

/// How one direction's batches are copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyPath {
    /// One `cuMemcpyAsync` per coalesced extent (copy engines, no SMs used).
    Memcpy,
    /// One launch of the NVRTC-compiled gather/scatter kernel over mapped staging.
    Kernel,
}

/// The configured choice for one direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathChoice {
    /// Always this path (`Kernel` fails `open` when NVRTC is unusable).
    Fixed(CopyPath),
    /// Time both paths at open on scratch memory (never on the pool) and keep the faster;
    /// `Memcpy` when the kernel is unusable or scratch memory cannot be had.
    Measure,
}

/// Configuration of a [`CudaBackend`].
#[derive(Debug, Clone)]
pub struct CudaBackendConfig {
    /// Path for gathers (`read`).
    pub gather: PathChoice,
    /// Path for scatters (`write`).
    pub scatter: PathChoice,
    /// Streams that batches are spread over (at least 1).
    pub streams: usize,
    /// How long one batch may take before it fails with a retryable error.
    pub deadline: Duration,
}

impl Default for CudaBackendConfig {
    fn default() -> Self {
        Self {
            gather: PathChoice::Measure,
            scatter: PathChoice::Measure,
            streams: 4,
            deadline: Duration::from_secs(30),
        }
    }
}

/// Measured throughput of both paths for one batch shape, in GiB/s (`None`: path unusable).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PathTiming {
    /// Gather with `cuMemcpyAsync`.
    pub gather_memcpy: f64,
    /// Gather with the kernel.
    pub gather_kernel: Option<f64>,
    /// Scatter with `cuMemcpyAsync`.
    pub scatter_memcpy: f64,
    /// Scatter with the kernel.
    pub scatter_kernel: Option<f64>,
}

/// One opened IPC allocation, closed (never freed) on drop.
#[derive(Debug)]
struct IpcMapping {
    ctx: Arc<CudaContext>,
    base: sys::CUdeviceptr,
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `base` came from cuIpcOpenMemHandle in this context and is closed once; no
        // copy uses it any more (the backend synchronized its streams before its fields drop).
        unsafe { sys::cuIpcCloseMemHandle(self.base) };
    }
}

/// The engine's "ready" event, opened from its IPC handle.
#[derive(Debug)]
struct IpcEvent {
    ctx: Arc<CudaContext>,
    event: sys::CUevent,
}

// SAFETY: a CUevent handle may be used from any thread of the process (driver API objects are
// thread safe); the wrapper is the only owner.
unsafe impl Send for IpcEvent {}
// SAFETY: as above; shared use only enqueues waits.
unsafe impl Sync for IpcEvent {}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: opened by cuIpcOpenEventHandle, destroyed once.
        unsafe { sys::cuEventDestroy_v2(self.event) };
    }
}

/// Registration guard of a staging buffer: unpins on drop (before `Staging` frees the memory).
#[derive(Debug)]
struct PinGuard {
    ctx: Arc<CudaContext>,
    owner: u64,
    host: usize,
    len: usize,
    dptr: u64,
}

impl Drop for PinGuard {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `host` was registered by cuMemHostRegister and is unregistered once; copies
        // that used it completed before the staging borrow ended (see `copy::Pending`).
        unsafe { sys::cuMemHostUnregister(self.host as *mut std::ffi::c_void) };
    }
}

/// An engine's KV pool on a CUDA device, as seen by the daemon.
#[derive(Debug)]
pub struct CudaBackend {
    id: u64,
    ctx: Arc<CudaContext>,
    infos: Vec<RegionInfo>,
    bases: Vec<u64>,
    streams: Vec<Arc<CudaStream>>,
    next_stream: AtomicUsize,
    kernel: Option<Kernel>,
    gather: CopyPath,
    scatter: CopyPath,
    deadline: Duration,
    ready: Option<IpcEvent>,
    mappings: Vec<IpcMapping>,
    /// In-process pool memory this backend keeps alive (dropped last).
    owner: Option<Arc<EnginePool>>,
}

impl CudaBackend {
    /// Opens an engine's pool from its IPC descriptor: each distinct handle is opened once with
    /// `cuIpcOpenMemHandle_v2` (lazy peer access), every region is checked against the real
    /// allocation size, and the optional ready event is opened.
    pub fn open(desc: &CudaIpcDescriptor, config: CudaBackendConfig) -> Result<Self, CudaError> {
        desc.validate()?;
        let ctx = context(desc.device as usize, desc.uuid_bytes())?;
        let mut mappings = Vec::new();
        let mut opened: HashMap<[u8; IPC_HANDLE_LEN], (sys::CUdeviceptr, u64)> = HashMap::new();
        let mut regions = Vec::with_capacity(desc.handles.len());
        for (i, r) in desc.handles.iter().enumerate() {
            let (base, size) = match opened.get(&r.handle) {
                Some(&m) => m,
                None => {
                    let m = open_handle(&ctx, &r.handle)?;
                    mappings.push(IpcMapping { ctx: ctx.clone(), base: m.0 });
                    opened.insert(r.handle, m);
                    m
                }
            };
            if r.offset + r.len > size {
                return Err(CudaError::Descriptor(format!(
                    "region {i}: offset {} + len {} exceeds the allocation's {size} bytes",
                    r.offset, r.len
                )));
            }
            regions.push((base + r.offset, r.len));
        }
        let ready = desc.ready_event.map(|h| open_event(&ctx, &h)).transpose()?;
        Self::build(ctx, &regions, config, mappings, ready)
    }

    /// A backend over device memory of this process (an in-process engine, tests, benches).
    ///
    /// # Safety
    /// Each `(device_ptr, len)` must be device memory of device `device` valid for reads and
    /// writes of `len` bytes for the whole life of the backend. It is never freed.
    pub unsafe fn from_device_memory(
        device: usize,
        regions: &[(u64, u64)],
        config: CudaBackendConfig,
    ) -> Result<Self, CudaError> {
        if regions.is_empty() || regions.iter().any(|&(p, l)| l == 0 || p.checked_add(l).is_none()) {
            return Err(CudaError::Descriptor("regions must be non-empty ranges".into()));
        }
        let ctx = context(device, None)?;
        Self::build(ctx, regions, config, Vec::new(), None)
    }

    fn build(
        ctx: Arc<CudaContext>,
        regions: &[(u64, u64)],
        config: CudaBackendConfig,
        mappings: Vec<IpcMapping>,
        ready: Option<IpcEvent>,
    ) -> Result<Self, CudaError> {
        let streams = (0..config.streams.max(1))
            .map(|_| ctx.new_stream().map_err(|e| driver_err("cuStreamCreate", e)))
            .collect::<Result<Vec<_>, _>>()?;
        let wants_kernel =
            [config.gather, config.scatter].iter().any(|c| *c != PathChoice::Fixed(CopyPath::Memcpy));
        let kernel = match wants_kernel.then(|| Kernel::compile(&ctx)) {
            None => None,
            Some(Ok(k)) => Some(k),
            Some(Err(e))
                if [config.gather, config.scatter].contains(&PathChoice::Fixed(CopyPath::Kernel)) =>
            {
                return Err(e);
            }
            Some(Err(_)) => None,
        };
        let mut backend = Self {
            id: next_backend_id(),
            ctx,
            infos: regions.iter().map(|&(_, len)| RegionInfo { len }).collect(),
            bases: regions.iter().map(|&(ptr, _)| ptr).collect(),
            streams,
            next_stream: AtomicUsize::new(0),
            kernel,
            gather: CopyPath::Memcpy,
            scatter: CopyPath::Memcpy,
            deadline: config.deadline,
            ready,
            mappings,
            owner: None,
        };
        let timing =
            if [config.gather, config.scatter].contains(&PathChoice::Measure) && backend.kernel.is_some() {
                // 128 extents of 64 KiB: a typical layer-by-layer block shape. Failure (no scratch
                // memory beside a full engine) keeps the copy engines.
                Self::measure_paths(&backend.ctx, backend.kernel.as_ref(), 64 << 10, 128, 3).ok()
            } else {
                None
            };
        let resolve = |choice: PathChoice, memcpy: Option<f64>, kernel: Option<f64>| match choice {
            PathChoice::Fixed(p) => p,
            PathChoice::Measure => match (memcpy, kernel) {
                (Some(m), Some(k)) if k > m => CopyPath::Kernel,
                _ => CopyPath::Memcpy,
            },
        };
        backend.gather =
            resolve(config.gather, timing.map(|t| t.gather_memcpy), timing.and_then(|t| t.gather_kernel));
        backend.scatter =
            resolve(config.scatter, timing.map(|t| t.scatter_memcpy), timing.and_then(|t| t.scatter_kernel));
        Ok(backend)
    }

    pub(crate) fn keeping_alive(mut self, owner: Arc<EnginePool>) -> Self {
        self.owner = Some(owner);
        self
    }

    /// The paths in use, `(gather, scatter)`.
    pub fn paths(&self) -> (CopyPath, CopyPath) {
        (self.gather, self.scatter)
    }

    /// Overrides the paths (for benchmarks); `Kernel` needs a compiled kernel.
    pub fn set_paths(&mut self, gather: CopyPath, scatter: CopyPath) -> Result<(), CudaError> {
        if self.kernel.is_none() && (gather == CopyPath::Kernel || scatter == CopyPath::Kernel) {
            self.kernel = Some(Kernel::compile(&self.ctx)?);
        }
        self.gather = gather;
        self.scatter = scatter;
        Ok(())
    }

    /// Number of distinct IPC allocations this backend opened (0 for in-process memory).
    pub fn ipc_mappings(&self) -> usize {
        self.mappings.len()
    }

    /// The device's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Times gather and scatter of `count` extents of `extent_len` bytes (every other slot of
    /// a scratch allocation, so nothing coalesces) with both paths: best of `reps` after a
    /// warm-up. Scratch memory is this call's own; the pool is never touched.
    pub fn calibrate(&self, extent_len: u64, count: usize, reps: usize) -> Result<PathTiming, CudaError> {
        Self::measure_paths(&self.ctx, self.kernel.as_ref(), extent_len, count, reps)
    }

    fn measure_paths(
        ctx: &Arc<CudaContext>,
        kernel: Option<&Kernel>,
        extent_len: u64,
        count: usize,
        reps: usize,
    ) -> Result<PathTiming, CudaError> {
        let scratch = Arc::new(EnginePool::allocate(ctx.ordinal(), &[extent_len * 2 * count as u64])?);
        let mut probe = scratch.in_process_backend(CudaBackendConfig {
            gather: PathChoice::Fixed(CopyPath::Memcpy),
            scatter: PathChoice::Fixed(CopyPath::Memcpy),
            streams: 1,
            ..CudaBackendConfig::default()
        })?;
        if kernel.is_some() {
            probe.kernel = Kernel::compile(ctx).ok();
        }
        let extents: Vec<Extent> = (0..count as u64)
            .map(|i| Extent { region: 0, offset: i * 2 * extent_len, len: extent_len })
            .collect();
        let bytes = extent_len * count as u64;
        let mut staging = probe.staging(usize::try_from(bytes).expect("fits"))?;
        let has_kernel = probe.kernel.is_some();
        let mut time = |path: CopyPath, dir: Direction| -> Result<f64, CudaError> {
            probe.gather = path;
            probe.scatter = path;
            let mut best = f64::INFINITY;
            for _ in 0..=reps.max(1) {
                let t = Instant::now();
                let host = staging.as_mut_ptr() as usize;
                probe.run_blocking(&extents, &staging, host, dir)?;
                best = best.min(t.elapsed().as_secs_f64());
            }
            Ok(bytes as f64 / best / (1u64 << 30) as f64)
        };
        let gather_memcpy = time(CopyPath::Memcpy, Direction::Gather)?;
        let scatter_memcpy = time(CopyPath::Memcpy, Direction::Scatter)?;
        let (gather_kernel, scatter_kernel) = if has_kernel {
            (time(CopyPath::Kernel, Direction::Gather).ok(), time(CopyPath::Kernel, Direction::Scatter).ok())
        } else {
            (None, None)
        };
        Ok(PathTiming { gather_memcpy, gather_kernel, scatter_memcpy, scatter_kernel })
    }

    fn pinned<'s>(&self, staging: &'s Staging) -> Result<&'s PinGuard, PoolError> {
        staging
            .guard()
            .and_then(|g| g.downcast_ref::<PinGuard>())
            .filter(|g| g.owner == self.id && g.host == staging.as_ptr() as usize && g.len >= staging.len())
            .ok_or(PoolError::ForeignStaging)
    }

    /// Validates and enqueues one batch; `None` for an empty batch. `host` is the staging
    /// buffer's address (an integer so that the futures holding it stay `Send`).
    fn submit(
        &self,
        extents: &[Extent],
        staging: &Staging,
        host: usize,
        dir: Direction,
    ) -> Result<Option<(Pending<'_>, u64)>, PoolError> {
        let total = check_batch(&self.infos, extents, staging.len(), staging.owner(), self.id)?;
        if total == 0 {
            return Ok(None);
        }
        let pin = self.pinned(staging)?;
        let copies = coalesce(extents);
        let path = match dir {
            Direction::Gather => self.gather,
            Direction::Scatter => self.scatter,
        };
        let stream = &self.streams[self.next_stream.fetch_add(1, Ordering::Relaxed) % self.streams.len()];
        self.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        let fence = StreamFence::new(stream);
        if let Some(ready) = &self.ready {
            // SAFETY: both handles are live objects of this context.
            check("cuStreamWaitEvent", unsafe {
                sys::cuStreamWaitEvent(stream.cu_stream(), ready.event, 0)
            })?;
        }
        let list = match (path, &self.kernel) {
            (CopyPath::Kernel, Some(kernel)) => {
                kernel.enqueue(stream, &copies, &self.bases, pin.dptr, dir)?.map(|l| (l, kernel))
            }
            _ => {
                // SAFETY: `host` is the pinned staging buffer (guard checked above) and
                // `check_batch` put every staging range inside it and every pool range inside
                // its region; the caller keeps `staging` borrowed until `Pending` completed.
                unsafe { enqueue_memcpy(stream, &copies, &self.bases, host as *mut u8, dir) }?;
                None
            }
        };
        let pending = Pending::record(stream, list)?;
        fence.disarm();
        Ok(Some((pending, total)))
    }

    /// Validates, enqueues and waits for one batch without blocking the runtime.
    async fn run(
        &self,
        extents: &[Extent],
        staging: &Staging,
        host: usize,
        dir: Direction,
    ) -> Result<(), PoolError> {
        match self.submit(extents, staging, host, dir)? {
            None => Ok(()),
            Some((pending, total)) => Ok(pending.wait(self.deadline, total).await?),
        }
    }

    /// As `run`, blocking the calling thread (calibration).
    fn run_blocking(
        &self,
        extents: &[Extent],
        staging: &Staging,
        host: usize,
        dir: Direction,
    ) -> Result<(), PoolError> {
        match self.submit(extents, staging, host, dir)? {
            None => Ok(()),
            Some((pending, _)) => Ok(pending.finish()?),
        }
    }
}

fn open_handle(
    ctx: &Arc<CudaContext>,
    handle: &[u8; IPC_HANDLE_LEN],
) -> Result<(sys::CUdeviceptr, u64), CudaError> {
    let h = sys::CUipcMemHandle_st { reserved: handle.map(|b| b as std::ffi::c_char) };
    let mut base: sys::CUdeviceptr = 0;
    ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    // SAFETY: `base` is a valid out-pointer; the handle is plain bytes the driver validates
    // (a foreign or stale handle yields an error, not UB); the context is current.
    let r = unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, h, flags) };
    r.result().map_err(|e| match r {
        sys::CUresult::CUDA_ERROR_INVALID_VALUE | sys::CUresult::CUDA_ERROR_INVALID_HANDLE => {
            CudaError::Descriptor(format!(
                "cuIpcOpenMemHandle refused the handle: {}",
                crate::driver::describe(e)
            ))
        }
        _ => driver_err("cuIpcOpenMemHandle", e),
    })?;
    let mut alloc_base: sys::CUdeviceptr = 0;
    let mut size = 0usize;
    // SAFETY: valid out-pointers; `base` is a live mapping of this context.
    let ranged = check("cuMemGetAddressRange", unsafe {
        sys::cuMemGetAddressRange_v2(&mut alloc_base, &mut size, base)
    });
    if let Err(e) = ranged {
        // SAFETY: opened just above, closed once, never used again.
        unsafe { sys::cuIpcCloseMemHandle(base) };
        return Err(e);
    }
    Ok((base, size as u64 - (base - alloc_base)))
}

fn open_event(ctx: &Arc<CudaContext>, handle: &[u8; IPC_HANDLE_LEN]) -> Result<IpcEvent, CudaError> {
    let h = sys::CUipcEventHandle_st { reserved: handle.map(|b| b as std::ffi::c_char) };
    let mut event: sys::CUevent = std::ptr::null_mut();
    ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
    // SAFETY: valid out-pointer; the driver validates the handle bytes.
    check("cuIpcOpenEventHandle", unsafe { sys::cuIpcOpenEventHandle(&mut event, h) })
        .map_err(|e| CudaError::Descriptor(format!("ready_event: {e}")))?;
    Ok(IpcEvent { ctx: ctx.clone(), event })
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // No batch can be in flight (futures borrow the backend and finish or synchronize
        // before they let go), but be certain before the mappings close.
        for s in &self.streams {
            let _ = s.synchronize();
        }
    }
}

impl MemoryBackend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn id(&self) -> u64 {
        self.id
    }

    fn regions(&self) -> &[RegionInfo] {
        &self.infos
    }

    fn staging(&self, len: usize) -> Result<Staging, PoolError> {
        let mut s = Staging::new_host(len, self.id);
        if s.capacity() == 0 {
            return Ok(s);
        }
        self.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        let host = s.as_mut_ptr();
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: `host` is a page-aligned allocation of `capacity()` bytes owned by `s`; the
        // guard attached below unregisters it before `Staging` frees the memory.
        check("cuMemHostRegister", unsafe { sys::cuMemHostRegister_v2(host.cast(), s.capacity(), flags) })?;
        let mut guard = PinGuard {
            ctx: self.ctx.clone(),
            owner: self.id,
            host: host as usize,
            len: s.capacity(),
            dptr: 0,
        };
        // SAFETY: `host` was registered with DEVICEMAP just above; valid out-pointer. On error
        // the guard drops and unregisters.
        check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut guard.dptr, host.cast(), 0)
        })?;
        Ok(s.with_guard(Box::new(guard)))
    }

    fn read<'a>(
        &'a self,
        extents: &'a [Extent],
        staging: &'a mut Staging,
    ) -> BoxFut<'a, Result<(), PoolError>> {
        Box::pin(async move {
            let host = staging.as_mut_ptr() as usize;
            self.run(extents, staging, host, Direction::Gather).await
        })
    }

    fn write<'a>(&'a self, extents: &'a [Extent], staging: &'a Staging) -> BoxFut<'a, Result<(), PoolError>> {
        // The device only reads staging for a scatter; the pointer is `*mut` only because the
        // copy helper serves both directions.
        Box::pin(
            async move { self.run(extents, staging, staging.as_ptr() as usize, Direction::Scatter).await },
        )
    }
}
