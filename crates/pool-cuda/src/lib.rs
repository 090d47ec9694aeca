//! The CUDA memory backend of kvferry: opens an engine's KV pool from CUDA IPC handles and
//! gathers/scatters blocks between the paged device pool and pinned host staging.
//!
//! Without the `cuda` feature this crate exposes only plain data ([`CudaIpcDescriptor`]), the
//! copy planner and [`available`], which then returns `false`. With it (cudarc, dynamic
//! loading: it builds with no CUDA toolkit and loads `libcuda` only at run time):
//!
//! - `CudaBackend::open` imports the pool with `cuIpcOpenMemHandle_v2` (closed with
//!   `cuIpcCloseMemHandle` on drop; the daemon never frees memory it does not own) and
//!   implements [`kvferry_pool::MemoryBackend`];
//! - staging is ordinary [`kvferry_pool::Staging`] pinned with `cuMemHostRegister`
//!   (portable, device-mapped, *not* write-combined: the wire reads it on the CPU);
//! - copies run on the backend's streams either as batched `cuMemcpyAsync` per coalesced
//!   extent or as one launch of the NVRTC-compiled kernel in `native/kv_gather.cu`
//!   ([`KERNEL_SOURCE`]), chosen per direction by configuration or by a measurement at open;
//!   completion is an event, polled without blocking the async runtime, under a deadline;
//! - `EnginePool` is the engine side (tests, benchmarks, a reference engine): device memory
//!   from raw `cuMemAlloc` (cudarc's own allocations cannot be exported) and its IPC handle.
//!
//! Every entry point that needs the driver checks [`available`] first: with no driver it
//! returns an error, never panics.

pub mod descriptor;
pub mod plan;

#[cfg(feature = "cuda")]
mod backend;
#[cfg(feature = "cuda")]
mod copy;
#[cfg(feature = "cuda")]
mod driver;
#[cfg(feature = "cuda")]
mod engine;
#[cfg(feature = "cuda")]
mod kernel;

#[cfg(feature = "cuda")]
pub use backend::{CopyPath, CudaBackend, CudaBackendConfig, PathChoice, PathTiming};
pub use descriptor::{CudaIpcDescriptor, DescriptorError, IPC_HANDLE_LEN, IpcRegion};
#[cfg(feature = "cuda")]
pub use driver::unavailable_reason;
#[cfg(feature = "cuda")]
pub use engine::EnginePool;

/// Source of the gather/scatter kernel (`native/kv_gather.cu`), compiled by NVRTC at run time.
pub const KERNEL_SOURCE: &str = include_str!("../../../native/kv_gather.cu");

/// Name of the kernel's entry point in [`KERNEL_SOURCE`].
pub const KERNEL_NAME: &str = "kv_copy_extents";

/// Errors of the CUDA backend outside the pool contract (opening, engine side, calibration).
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The crate was built without the `cuda` feature, or no usable driver/device is present.
    #[error("CUDA unavailable: {0}")]
    Unavailable(String),
    /// The descriptor is malformed or does not match the device's memory.
    #[error("bad CUDA IPC descriptor: {0}")]
    Descriptor(String),
    /// A driver call failed.
    #[error("{op} failed: {detail}")]
    Driver {
        /// The driver entry point.
        op: &'static str,
        /// The driver's error name and string.
        detail: String,
    },
    /// NVRTC could not compile or the driver could not load the kernel.
    #[error("kernel unavailable: {0}")]
    Kernel(String),
    /// A copy did not finish before its deadline.
    #[error("copy still running after {0:?}")]
    Deadline(std::time::Duration),
    /// A pool-contract error from a batch run outside the trait (calibration).
    #[error(transparent)]
    Pool(#[from] kvferry_pool::PoolError),
}

impl From<DescriptorError> for CudaError {
    fn from(e: DescriptorError) -> Self {
        CudaError::Descriptor(e.to_string())
    }
}

impl From<CudaError> for kvferry_pool::PoolError {
    fn from(e: CudaError) -> Self {
        use kvferry_pool::PoolError;
        match e {
            CudaError::Descriptor(d) => PoolError::BadMetadata(d),
            CudaError::Pool(p) => p,
            CudaError::Deadline(_) => {
                PoolError::Backend { backend: "cuda", retryable: true, detail: e.to_string() }
            }
            other => PoolError::Backend { backend: "cuda", retryable: false, detail: other.to_string() },
        }
    }
}

/// Whether this build can use CUDA right now: the `cuda` feature is on, the driver library
/// loads, `cuInit` succeeds and at least one device is visible. Cached after the first call;
/// never panics.
pub fn available() -> bool {
    #[cfg(feature = "cuda")]
    {
        driver::unavailable_reason().is_none()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_source_is_present() {
        assert!(!KERNEL_SOURCE.trim().is_empty());
        assert!(KERNEL_SOURCE.contains(&format!("extern \"C\" __global__ void {KERNEL_NAME}(")));
        assert!(!KERNEL_SOURCE.contains("#include"), "NVRTC compiles it with no include paths");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn feature_off_is_unavailable() {
        assert!(!available());
    }

    #[test]
    fn errors_map_onto_the_pool_contract() {
        use kvferry_pool::PoolError;
        let e: PoolError = CudaError::Descriptor("x".into()).into();
        assert!(matches!(e, PoolError::BadMetadata(_)));
        let e: PoolError = CudaError::Unavailable("no driver".into()).into();
        assert!(matches!(e, PoolError::Backend { backend: "cuda", retryable: false, .. }));
        let e: PoolError = CudaError::Deadline(std::time::Duration::from_secs(1)).into();
        assert!(e.is_retryable());
    }
}
