//! The gather/scatter kernel: compiled from `native/kv_gather.cu` by NVRTC at run time (once per
//! backend), loaded into the backend's context, and launched with a copy list in pinned,
//! device-mapped host memory from a small reusable pool.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg, sys};
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};

use crate::driver::{check, driver_err};
use crate::plan::{self, Direction, PlannedCopy};
use crate::{CudaError, KERNEL_NAME, KERNEL_SOURCE};

/// The compiled kernel and the pool of pinned copy-list buffers its launches read.
#[derive(Debug)]
pub(crate) struct Kernel {
    func: CudaFunction,
    lists: ListPool,
}

impl Kernel {
    /// Compiles and loads the kernel for the context's device. Fails (never panics) when
    /// `libnvrtc` is missing or compilation fails.
    pub(crate) fn compile(ctx: &Arc<CudaContext>) -> Result<Self, CudaError> {
        // SAFETY: only tries to `dlopen` candidate library names; runs no NVRTC code.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(CudaError::Kernel("no NVRTC library (libnvrtc.so) could be loaded".into()));
        }
        let (major, minor) = ctx.compute_capability().map_err(|e| driver_err("cuDeviceGetAttribute", e))?;
        let ptx = Ptx::from_src(ptx_for(major, minor)?);
        let module = ctx.load_module(ptx).map_err(|e| driver_err("cuModuleLoadData", e))?;
        let func = module.load_function(KERNEL_NAME).map_err(|e| driver_err("cuModuleGetFunction", e))?;
        Ok(Self { func, lists: ListPool::new(ctx.clone()) })
    }

    /// Enqueues one launch copying `copies` on `stream`. The returned buffer holds the copy
    /// list the kernel reads: keep it alive until the stream has passed the launch.
    pub(crate) fn enqueue(
        &self,
        stream: &CudaStream,
        copies: &[PlannedCopy],
        region_bases: &[u64],
        staging_dptr: u64,
        dir: Direction,
    ) -> Result<Option<ListBuf>, CudaError> {
        let Some(geo) = plan::geometry(copies) else { return Ok(None) };
        let words = plan::triples(copies, region_bases, staging_dptr, dir);
        let mut list = self.lists.take(words.len())?;
        list.as_mut_slice()[..words.len()].copy_from_slice(&words);
        let n_copies = u32::try_from(copies.len())
            .map_err(|_| CudaError::Kernel(format!("{} copies exceed one launch", copies.len())))?;
        let cfg = LaunchConfig {
            grid_dim: (geo.grid_x, geo.grid_y, 1),
            block_dim: (geo.block, 1, 1),
            shared_mem_bytes: 0,
        };
        let list_dptr = list.dptr;
        let mut launch = stream.launch_builder(&self.func);
        launch.arg(&list_dptr).arg(&n_copies);
        // SAFETY: the kernel's signature is `(const u64* triples, u32 n_copies)`, matching the
        // two arguments. `list_dptr` is the device-mapped address of a pinned buffer holding
        // `3 * n_copies` initialized words, kept alive by the returned `ListBuf` until the
        // caller has waited for the stream. Every triple addresses memory the caller validated
        // (`check_batch`: extents inside their regions, staging large enough and registered).
        unsafe { launch.launch(cfg) }.map_err(|e| driver_err("cuLaunchKernel", e))?;
        Ok(Some(list))
    }

    /// Returns a copy-list buffer once the launch that read it has completed.
    pub(crate) fn recycle(&self, list: ListBuf) {
        self.lists.put(list);
    }
}

/// The kernel's PTX for compute capability `major.minor`, compiled by NVRTC once per process
/// and architecture (compilation takes tens of milliseconds; loading is per context).
fn ptx_for(major: i32, minor: i32) -> Result<String, CudaError> {
    static CACHE: Mutex<Vec<((i32, i32), String)>> = Mutex::new(Vec::new());
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, ptx)) = cache.iter().find(|(arch, _)| *arch == (major, minor)) {
        return Ok(ptx.clone());
    }
    let arch = format!("--gpu-architecture=compute_{major}{minor}");
    let compile = |options: Vec<String>| {
        let opts = CompileOptions { options, name: Some("kv_gather.cu".into()), ..Default::default() };
        std::panic::catch_unwind(|| compile_ptx_with_opts(KERNEL_SOURCE, opts))
            .map_err(|_| "NVRTC panicked (library lacks an entry point?)".to_string())?
            .map_err(|e| format!("{e:?}"))
    };
    // An NVRTC older than the device does not know its architecture: fall back to NVRTC's
    // default target, which the driver JIT-compiles for the device.
    let ptx = compile(vec![arch.clone(), "-std=c++17".into()])
        .or_else(|first| {
            compile(vec!["-std=c++17".into()]).map_err(|e| format!("{arch}: {first}; default: {e}"))
        })
        .map_err(CudaError::Kernel)?
        .to_src();
    cache.push(((major, minor), ptx.clone()));
    Ok(ptx)
}

/// A pinned, device-mapped host buffer of u64 words (`cuMemHostAlloc`, not write-combined).
#[derive(Debug)]
pub(crate) struct ListBuf {
    ctx: Arc<CudaContext>,
    host: *mut u64,
    words: usize,
    dptr: u64,
}

// SAFETY: the buffer is uniquely owned (like a `Box<[u64]>`); the pointer is not shared with
// other Rust values, and the device only reads it while the owner keeps it alive.
unsafe impl Send for ListBuf {}
// SAFETY: `&ListBuf` gives no access to the memory.
unsafe impl Sync for ListBuf {}

impl ListBuf {
    fn new(ctx: Arc<CudaContext>, words: usize) -> Result<Self, CudaError> {
        ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: `host` is a valid out-pointer; the context is current.
        check("cuMemHostAlloc", unsafe { sys::cuMemHostAlloc(&mut host, words * 8, flags) })?;
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: `host` was just allocated with DEVICEMAP in the current context.
        let mapped = check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut dptr, host, 0)
        });
        if let Err(e) = mapped {
            // SAFETY: `host` came from cuMemHostAlloc and is not used afterwards.
            unsafe { sys::cuMemFreeHost(host) };
            return Err(e);
        }
        Ok(Self { ctx, host: host.cast(), words, dptr })
    }

    fn as_mut_slice(&mut self) -> &mut [u64] {
        // SAFETY: `host` points to `words` u64s (8-byte aligned: cuMemHostAlloc returns page
        // aligned memory), exclusively owned by `self`; the device does not read it while the
        // host writes (a buffer is only written after it came back from a completed launch).
        unsafe { std::slice::from_raw_parts_mut(self.host, self.words) }
    }
}

impl Drop for ListBuf {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by cuMemHostAlloc; no launch reads it any more (buffers are dropped
        // only after their launch completed, or never handed to a launch).
        unsafe { sys::cuMemFreeHost(self.host.cast()) };
    }
}

/// Reuses copy-list buffers: pinning is far too slow to do per batch.
#[derive(Debug)]
struct ListPool {
    ctx: Arc<CudaContext>,
    free: Mutex<Vec<ListBuf>>,
}

/// Buffers kept for reuse at most.
const POOL_KEEP: usize = 16;
/// Smallest buffer (words): 1365 copies.
const MIN_WORDS: usize = 4096;

impl ListPool {
    fn new(ctx: Arc<CudaContext>) -> Self {
        Self { ctx, free: Mutex::new(Vec::new()) }
    }

    fn take(&self, words: usize) -> Result<ListBuf, CudaError> {
        {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(i) = free.iter().position(|b| b.words >= words) {
                return Ok(free.swap_remove(i));
            }
        }
        ListBuf::new(self.ctx.clone(), words.max(MIN_WORDS).next_power_of_two())
    }

    fn put(&self, buf: ListBuf) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if free.len() < POOL_KEEP {
            free.push(buf);
        }
    }
}
