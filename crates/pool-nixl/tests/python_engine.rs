//! The engine is NIXL's own Python API (`nixl_cu12`, as vLLM's NixlConnector uses it) in a
//! separate process: its metadata must load into the daemon's Rust agent and the conformance
//! cases must pass against it.

mod common;

use common::{EngineKind, NixlFixture, nixl_available, serial};
use kvferry_pool::conformance as c;

/// NIXL's Python API must be importable too; same no-silent-skip rule as the library.
fn python_ready() -> bool {
    if !nixl_available() {
        return false;
    }
    let py = std::env::var("KVFERRY_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = std::process::Command::new(&py).args(["-c", "import nixl_cu12, numpy"]).output();
    match out {
        Ok(o) if o.status.success() => true,
        other => {
            let why = match other {
                Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
                Err(e) => e.to_string(),
            };
            panic!(
                "NIXL's Python API is not importable with {py}: {why}\nRun `source deploy/install-nixl.sh` \
                 (installs nixl-cu12 and numpy)."
            );
        }
    }
}

fn fx() -> NixlFixture {
    NixlFixture { kind: EngineKind::Python, large_pool_bytes: 64 << 20 }
}

#[test]
fn python_engine_read_after_write() {
    let _g = serial();
    if !python_ready() {
        return;
    }
    c::read_after_write(&fx(), 0x5EED_0001);
}

#[test]
fn python_engine_refuses_bad_batches() {
    let _g = serial();
    if !python_ready() {
        return;
    }
    c::out_of_bounds_writes_nothing(&fx(), 0x5EED_0002);
    c::staging_too_small(&fx());
}

#[test]
fn python_engine_large_pool() {
    let _g = serial();
    if !python_ready() {
        return;
    }
    c::large_pool(&fx());
}
