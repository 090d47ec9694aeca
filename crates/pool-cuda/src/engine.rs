//! The engine side: device memory that an engine (the reference engine, tests, benchmarks)
//! owns and exports to the daemon as CUDA IPC handles.
//!
//! Memory comes from raw `cuMemAlloc` (cudarc's stream-ordered allocations cannot be exported,
//! cudarc#521): one allocation carved into regions, so the descriptor exercises offsets and
//! shared handles. This side frees its memory on drop; the daemon side never does.

use std::sync::Arc;

use cudarc::driver::{CudaContext, sys};

use crate::CudaError;
use crate::backend::{CudaBackend, CudaBackendConfig};
use crate::descriptor::{CudaIpcDescriptor, IPC_HANDLE_LEN, IpcRegion};
use crate::driver::{check, context, driver_err, uuid_hex};

/// Alignment of each region inside the allocation.
const REGION_ALIGN: u64 = 256;

/// An exported pool: one device allocation, its regions, its IPC handle, and optionally an
/// interprocess "ready" event.
#[derive(Debug)]
pub struct EnginePool {
    ctx: Arc<CudaContext>,
    base: sys::CUdeviceptr,
    size: u64,
    regions: Vec<(u64, u64)>,
    handle: [u8; IPC_HANDLE_LEN],
    uuid: String,
    ready: Option<(sys::CUevent, [u8; IPC_HANDLE_LEN])>,
}

// SAFETY: the raw handles (a device pointer, an event) are usable from any thread of the process
// (driver API objects are thread safe) and uniquely owned by this value.
unsafe impl Send for EnginePool {}
// SAFETY: shared access only issues synchronous copies and reads plain fields.
unsafe impl Sync for EnginePool {}

impl EnginePool {
    /// Allocates zeroed regions of the given lengths on device `device` and exports the
    /// allocation with `cuIpcGetMemHandle`.
    pub fn allocate(device: usize, region_lens: &[u64]) -> Result<Self, CudaError> {
        if region_lens.is_empty() || region_lens.contains(&0) {
            return Err(CudaError::Descriptor("regions must be non-empty".into()));
        }
        let ctx = context(device, None)?;
        let mut regions = Vec::with_capacity(region_lens.len());
        let mut size = 0u64;
        for &len in region_lens {
            let offset = size.next_multiple_of(REGION_ALIGN);
            regions.push((offset, len));
            size = offset + len;
        }
        let bytes = usize::try_from(size).map_err(|_| CudaError::Descriptor("pool too large".into()))?;
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; the context is current (bound by `context`).
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut base, bytes) })?;
        let mut pool =
            Self { ctx, base, size, regions, handle: [0; IPC_HANDLE_LEN], uuid: String::new(), ready: None };
        // SAFETY: `base` is a live allocation of `bytes` bytes (freed by `pool`'s Drop on error).
        check("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(base, 0, bytes) })?;
        let mut h = sys::CUipcMemHandle_st { reserved: [0; IPC_HANDLE_LEN] };
        // SAFETY: `base` is the base of a cuMemAlloc allocation; valid out-pointer.
        check("cuIpcGetMemHandle", unsafe { sys::cuIpcGetMemHandle(&mut h, base) })?;
        pool.handle = h.reserved.map(|b| b as u8);
        pool.uuid = uuid_hex(&pool.ctx.uuid().map_err(|e| driver_err("cuDeviceGetUuid", e))?);
        Ok(pool)
    }

    /// Creates an interprocess event the engine records after writing ([`Self::record_ready`]);
    /// the descriptor then carries it and every daemon copy waits on it.
    pub fn with_ready_event(mut self) -> Result<Self, CudaError> {
        self.bind()?;
        let mut event: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: valid out-pointer; the context is current.
        check("cuEventCreate", unsafe { sys::cuEventCreate(&mut event, flags) })?;
        let mut h = sys::CUipcEventHandle_st { reserved: [0; IPC_HANDLE_LEN] };
        // SAFETY: `event` is a live interprocess event; valid out-pointer.
        let exported = check("cuIpcGetEventHandle", unsafe { sys::cuIpcGetEventHandle(&mut h, event) });
        if let Err(e) = exported {
            // SAFETY: created above, destroyed once.
            unsafe { sys::cuEventDestroy_v2(event) };
            return Err(e);
        }
        self.ready = Some((event, h.reserved.map(|b| b as u8)));
        Ok(self)
    }

    /// Records the ready event on the default stream (after the engine's writes).
    pub fn record_ready(&self) -> Result<(), CudaError> {
        let Some((event, _)) = self.ready else { return Ok(()) };
        self.bind()?;
        // SAFETY: a live event of this context; the null stream is always valid.
        check("cuEventRecord", unsafe { sys::cuEventRecord(event, std::ptr::null_mut()) })
    }

    /// The descriptor the daemon opens this pool with.
    pub fn descriptor(&self) -> CudaIpcDescriptor {
        CudaIpcDescriptor {
            handles: self
                .regions
                .iter()
                .map(|&(offset, len)| IpcRegion { handle: self.handle, offset, len })
                .collect(),
            device: u32::try_from(self.ctx.ordinal()).expect("device ordinals are small"),
            device_uuid: Some(self.uuid.clone()),
            ready_event: self.ready.map(|(_, h)| h),
        }
    }

    /// Number of regions.
    pub fn region_count(&self) -> usize {
        self.regions.len()
    }

    /// Device address of region `r`.
    pub fn region_ptr(&self, r: usize) -> u64 {
        self.base + self.regions[r].0
    }

    /// Length of region `r`.
    pub fn region_len(&self, r: usize) -> u64 {
        self.regions[r].1
    }

    /// The device's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A backend over this pool in this process (no IPC: a process cannot open its own IPC
    /// handle). The backend keeps the pool alive.
    pub fn in_process_backend(self: &Arc<Self>, config: CudaBackendConfig) -> Result<CudaBackend, CudaError> {
        let regions: Vec<(u64, u64)> =
            (0..self.regions.len()).map(|r| (self.region_ptr(r), self.region_len(r))).collect();
        // SAFETY: the regions are live device memory of this process, and the backend holds an
        // `Arc` of this pool, so the memory outlives it.
        let backend = unsafe { CudaBackend::from_device_memory(self.ctx.ordinal(), &regions, config) }?;
        Ok(backend.keeping_alive(self.clone()))
    }

    /// Copies `data` into region `r` at `offset` and waits until it is visible to every stream.
    pub fn write(&self, r: usize, offset: u64, data: &[u8]) -> Result<(), CudaError> {
        let dst = self.range(r, offset, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `dst .. dst + data.len()` lies inside the allocation (checked by `range`).
        check("cuMemcpyHtoD", unsafe { sys::cuMemcpyHtoD_v2(dst, data.as_ptr().cast(), data.len()) })?;
        // A pageable HtoD copy may return before its DMA lands: wait for it.
        self.ctx.synchronize().map_err(|e| driver_err("cuCtxSynchronize", e))
    }

    /// Copies region `r` at `offset` into `out` (after all device work finished).
    pub fn read(&self, r: usize, offset: u64, out: &mut [u8]) -> Result<(), CudaError> {
        let src = self.range(r, offset, out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        self.bind()?;
        self.ctx.synchronize().map_err(|e| driver_err("cuCtxSynchronize", e))?;
        // SAFETY: `src .. src + out.len()` lies inside the allocation (checked by `range`).
        check("cuMemcpyDtoH", unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), src, out.len()) })
    }

    fn range(&self, r: usize, offset: u64, len: usize) -> Result<u64, CudaError> {
        let &(start, rlen) = self
            .regions
            .get(r)
            .ok_or_else(|| CudaError::Descriptor(format!("region {r} of {}", self.regions.len())))?;
        match offset.checked_add(len as u64) {
            Some(end) if end <= rlen => Ok(self.base + start + offset),
            _ => Err(CudaError::Descriptor(format!("region {r}: {offset}+{len} exceeds {rlen}"))),
        }
    }

    fn bind(&self) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))
    }

    /// Total bytes allocated (regions plus alignment padding).
    pub fn allocated_bytes(&self) -> u64 {
        self.size
    }
}

impl Drop for EnginePool {
    fn drop(&mut self) {
        let _ = self.bind();
        let _ = self.ctx.synchronize();
        if let Some((event, _)) = self.ready.take() {
            // SAFETY: created by `with_ready_event`, destroyed once.
            unsafe { sys::cuEventDestroy_v2(event) };
        }
        // SAFETY: `base` came from cuMemAlloc and is freed once; this process's own backends
        // over it hold an `Arc` of this pool, so none is left.
        unsafe { sys::cuMemFree_v2(self.base) };
    }
}
