//! Finding `libnixl_capi.so` before the nixl-sys stub does.
//!
//! With feature `stub-api`, nixl-sys resolves every C call through
//! `dlopen("libnixl_capi.so")` on first use and **aborts** if that fails. [`ensure_nixl`] runs
//! first: it optionally preloads the library from `$KVFERRY_NIXL_LIB_DIR` (the stub's by-name
//! dlopen then finds the already loaded object through its SONAME), then asks the stub whether
//! it found the library (`nixl_sys::is_stub()`, which never aborts). The answer is cached for
//! the process: the stub caches its own dlopen result too.

use std::ffi::{CStr, CString};
use std::sync::OnceLock;

use kvferry_pool::PoolError;

/// Environment variable naming the directory that holds `libnixl_capi.so` (the wheel's
/// `.nixl_cu12.mesonpy.libs`). Optional when `LD_LIBRARY_PATH` already contains it.
pub const LIB_DIR_ENV: &str = "KVFERRY_NIXL_LIB_DIR";

const LIB_NAME: &str = "libnixl_capi.so";

static STATE: OnceLock<Result<(), String>> = OnceLock::new();

/// Make sure NIXL's C library can be used in this process, or say why not.
///
/// Call before any nixl-sys function (every constructor in this crate does). Returns
/// `PoolError::Backend { backend: "nixl", retryable: false, .. }` with install instructions
/// when the library cannot be loaded; never aborts.
pub fn ensure_nixl() -> Result<(), PoolError> {
    STATE.get_or_init(probe).clone().map_err(|detail| PoolError::Backend {
        backend: crate::BACKEND,
        retryable: false,
        detail,
    })
}

fn probe() -> Result<(), String> {
    let mut notes = Vec::new();
    if let Some(dir) = std::env::var_os(LIB_DIR_ENV) {
        let path = std::path::Path::new(&dir).join(LIB_NAME);
        match dlopen(&path.to_string_lossy(), libc::RTLD_NOW | libc::RTLD_GLOBAL) {
            Ok(()) => {}
            Err(e) => notes.push(format!("{LIB_DIR_ENV}: {e}")),
        }
    }
    // Our own by-name attempt, only to capture dlerror() for the message: the stub prints its
    // error to stderr, not to us.
    if let Err(e) = dlopen(LIB_NAME, libc::RTLD_NOW | libc::RTLD_LOCAL) {
        notes.push(e);
    }
    // A safe call: `is_stub` only reports whether the stub's dlopen succeeded; unlike every
    // other nixl-sys function it never aborts.
    if nixl_sys::is_stub() {
        return Err(format!(
            "{LIB_NAME} not found ({}); install NIXL with deploy/install-nixl.sh and export the \
             LD_LIBRARY_PATH it prints (or set {LIB_DIR_ENV} to the directory holding {LIB_NAME})",
            notes.join("; ")
        ));
    }
    Ok(())
}

/// `dlopen(name, flags)`, keeping the handle open for the life of the process.
fn dlopen(name: &str, flags: libc::c_int) -> Result<(), String> {
    let c = CString::new(name).map_err(|_| format!("library path {name:?} contains NUL"))?;
    // SAFETY: `c` is a valid NUL-terminated string for the duration of the call; dlopen has no
    // other preconditions. Loading libnixl_capi.so runs its (and its dependencies') static
    // constructors, which is exactly what the nixl-sys stub would do on first use anyway.
    let handle = unsafe { libc::dlopen(c.as_ptr(), flags) };
    if handle.is_null() {
        // SAFETY: dlerror returns NULL or a pointer to a NUL-terminated thread-local string
        // that stays valid until the next dl* call on this thread; we copy it out at once.
        let err = unsafe { libc::dlerror() };
        let msg = if err.is_null() {
            "unknown dlopen error".to_owned()
        } else {
            // SAFETY: non-null, NUL-terminated (see above).
            unsafe { CStr::from_ptr(err) }.to_string_lossy().into_owned()
        };
        return Err(msg);
    }
    // The handle is deliberately never closed: nixl-sys keeps using the library.
    Ok(())
}
