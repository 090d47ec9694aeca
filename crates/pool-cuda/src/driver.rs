//! Driver access shared by the backend and the engine side: the availability probe (the one
//! place that decides whether the driver may be touched at all), device selection, and
//! driver-error conversion.
//!
//! cudarc with `dynamic-loading` panics on the first call into a library it cannot load, so no
//! function of this crate calls into the driver before [`unavailable_reason`] said `None`.

use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, result::DriverError, sys};

use crate::CudaError;

/// Why CUDA cannot be used here, or `None` when it can: driver library loadable, `cuInit`
/// succeeds, at least one device. Probed once per process; never panics.
pub fn unavailable_reason() -> Option<String> {
    static PROBE: OnceLock<Option<String>> = OnceLock::new();
    PROBE.get_or_init(probe).clone()
}

fn probe() -> Option<String> {
    // SAFETY: `is_culib_present` only tries to `dlopen` the candidate library names and drops
    // the handles again; it runs no CUDA code.
    if !unsafe { sys::is_culib_present() } {
        return Some("no CUDA driver library (libcuda.so) could be loaded".into());
    }
    // A driver older than the bindings may lack a symbol; cudarc panics then. Turn that into
    // "unavailable" instead of taking the process down.
    let probed = std::panic::catch_unwind(|| -> Result<i32, String> {
        // SAFETY: the library is present (checked above); `cuInit(0)` has no preconditions.
        unsafe { sys::cuInit(0) }.result().map_err(|e| format!("cuInit failed: {}", describe(e)))?;
        let mut count = 0i32;
        // SAFETY: `count` is a valid out-pointer; the driver is initialized.
        unsafe { sys::cuDeviceGetCount(&mut count) }
            .result()
            .map_err(|e| format!("cuDeviceGetCount failed: {}", describe(e)))?;
        Ok(count)
    });
    match probed {
        Ok(Ok(0)) => Some("the CUDA driver sees no device".into()),
        Ok(Ok(_)) => None,
        Ok(Err(reason)) => Some(reason),
        Err(_) => Some("the CUDA driver library lacks a required entry point (driver too old?)".into()),
    }
}

/// Errs with [`CudaError::Unavailable`] unless the driver may be used.
pub(crate) fn ensure_available() -> Result<(), CudaError> {
    match unavailable_reason() {
        None => Ok(()),
        Some(reason) => Err(CudaError::Unavailable(reason)),
    }
}

/// "NAME: description" of a driver error (falls back to the numeric code).
pub(crate) fn describe(e: DriverError) -> String {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned());
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned());
    match (name, text) {
        (Ok(n), Ok(t)) => format!("{n}: {t}"),
        _ => format!("{:?}", e.0),
    }
}

/// Converts a raw driver status into a `Result`, naming the entry point on error.
pub(crate) fn check(op: &'static str, r: sys::CUresult) -> Result<(), CudaError> {
    r.result().map_err(|e| driver_err(op, e))
}

/// A [`CudaError::Driver`] for `op`.
pub(crate) fn driver_err(op: &'static str, e: DriverError) -> CudaError {
    CudaError::Driver { op, detail: describe(e) }
}

/// Lowercase hex of a device UUID.
pub(crate) fn uuid_hex(u: &sys::CUuuid) -> String {
    let bytes: Vec<u8> = u.bytes.iter().map(|&b| b as u8).collect();
    crate::descriptor::encode_hex(&bytes)
}

/// The primary context of the device with ordinal `ordinal`, or, when `uuid` is given, of the
/// device with that UUID (ordinals differ between processes with different
/// `CUDA_VISIBLE_DEVICES`).
pub(crate) fn context(ordinal: usize, uuid: Option<[u8; 16]>) -> Result<Arc<CudaContext>, CudaError> {
    ensure_available()?;
    let ordinal = match uuid {
        None => ordinal,
        Some(want) => find_by_uuid(want)?,
    };
    CudaContext::new(ordinal).map_err(|e| driver_err("cuDevicePrimaryCtxRetain", e))
}

fn find_by_uuid(want: [u8; 16]) -> Result<usize, CudaError> {
    let count = CudaContext::device_count().map_err(|e| driver_err("cuDeviceGetCount", e))?;
    for ordinal in 0..count {
        let dev = cudarc::driver::result::device::get(ordinal).map_err(|e| driver_err("cuDeviceGet", e))?;
        let uuid =
            cudarc::driver::result::device::get_uuid(dev).map_err(|e| driver_err("cuDeviceGetUuid", e))?;
        if uuid.bytes.iter().zip(want).all(|(&a, b)| a as u8 == b) {
            return Ok(usize::try_from(ordinal).expect("ordinal is non-negative"));
        }
    }
    Err(CudaError::Descriptor(format!("no visible device has UUID {}", crate::descriptor::encode_hex(&want))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_never_panics_and_is_stable() {
        let first = unavailable_reason();
        assert_eq!(first, unavailable_reason());
        if let Some(reason) = &first {
            assert!(!reason.is_empty());
            use std::io::Write;
            // Straight to stderr: libtest captures `println!`, and a skip must be visible.
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: no CUDA driver ({reason}); probe returned without touching it"
            );
        }
        assert_eq!(crate::available(), first.is_none());
    }
}
