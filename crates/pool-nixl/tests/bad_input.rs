//! Bad input gets a typed error and performs no write: truncated, foreign, mismatched or
//! corrupted NIXL metadata, descriptors naming memory the engine never registered, an engine
//! that died, and a missing NIXL library (typed error instead of the stub's abort).

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{EngineKind, EngineProcess, nixl_available, serial, start_engine};
use kvferry_pool::{Extent, MemoryBackend, PoolError};
use kvferry_pool_nixl::{NixlBackend, NixlOptions, NixlPoolDescriptor};

fn opts() -> NixlOptions {
    common::helper_opts(Duration::from_secs(10))
}

fn expect_bad_metadata(desc: &NixlPoolDescriptor, what: &str) {
    match NixlBackend::attach_with(desc, opts()) {
        Err(PoolError::BadMetadata(msg)) => assert!(!msg.is_empty(), "{what}"),
        Err(other) => panic!("{what}: expected BadMetadata, got {other:?}"),
        Ok(b) => panic!("{what}: attach succeeded (peer {:?})", b.peer()),
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

/// Fill the engine's memory with a pattern, run `f`, and check not one byte changed.
fn assert_no_write(engine: &common::MemfdEngine, f: impl FnOnce()) {
    for (i, m) in engine.maps.iter().enumerate() {
        let pattern: Vec<u8> = (0..m.len()).map(|j| (j * 31 + i * 7) as u8).collect();
        m.write(0, &pattern).expect("fill");
    }
    let before: Vec<Vec<u8>> = engine.maps.iter().map(|m| m.to_vec()).collect();
    f();
    for (i, m) in engine.maps.iter().enumerate() {
        assert!(m.to_vec() == before[i], "engine region {i} changed");
    }
}

/// Control: a good descriptor attaches and a write through it lands (so the no-write checks
/// above would have seen a write).
fn assert_write_lands(engine: &common::MemfdEngine) {
    let b = NixlBackend::attach_with(&engine.process.descriptor, opts()).expect("good descriptor attaches");
    let mut st = b.staging(4096).expect("staging");
    st.as_mut_slice().fill(0xC3);
    rt().block_on(b.write(&[Extent { region: 0, offset: 8192, len: 4096 }], &st)).expect("write");
    let mut got = vec![0; 4096];
    engine.maps[0].read(8192, &mut got).expect("read back");
    assert!(got.iter().all(|&x| x == 0xC3), "control write did not land");
}

#[test]
fn truncated_metadata_is_refused_at_every_cut() {
    let _g = serial();
    assert!(nixl_available());
    let engine = start_engine(EngineKind::Rust, &[1 << 20, 12_345]);
    let good = engine.process.descriptor.clone();
    let n = good.agent_metadata.len();
    let mut cuts: Vec<usize> = (0..n).step_by(7).collect();
    cuts.extend([n - 1, n - 2, n / 2]);
    assert_no_write(&engine, || {
        for cut in cuts {
            let mut d = good.clone();
            d.agent_metadata.truncate(cut);
            expect_bad_metadata(&d, &format!("metadata truncated to {cut} of {n} bytes"));
        }
    });
    assert_write_lands(&engine);
}

#[test]
fn foreign_and_mismatched_metadata_is_refused() {
    let _g = serial();
    assert!(nixl_available());
    let a = start_engine(EngineKind::Rust, &[1 << 20]);
    let b = start_engine(EngineKind::Rust, &[1 << 20]);
    let good = a.process.descriptor.clone();
    assert_no_write(&a, || {
        let with_md = |md: Vec<u8>| NixlPoolDescriptor { agent_metadata: md, ..good.clone() };
        expect_bad_metadata(&with_md(Vec::new()), "empty metadata");
        expect_bad_metadata(&with_md(b"definitely not nixl metadata".to_vec()), "foreign bytes");
        expect_bad_metadata(&with_md(br#"{"agent":"x","conn":"y"}"#.to_vec()), "JSON instead of metadata");
        expect_bad_metadata(&with_md((0..=255u8).cycle().take(600).collect()), "pseudo-random bytes");
        let mut header_only_garbage = b"nixlSerDes|Agent".to_vec();
        header_only_garbage.extend_from_slice(&(good.agent_name.len() as u64).to_le_bytes());
        header_only_garbage.extend_from_slice(good.agent_name.as_bytes());
        header_only_garbage.extend_from_slice(b"|garbage that is not a NIXL field");
        expect_bad_metadata(&with_md(header_only_garbage), "valid header, garbage body");
        // Engine B's metadata under engine A's name and regions.
        expect_bad_metadata(
            &with_md(b.process.descriptor.agent_metadata.clone()),
            "another agent's metadata",
        );
        // Engine B's metadata and name, engine A's regions: B never registered them.
        let mixed = NixlPoolDescriptor { regions: good.regions.clone(), ..b.process.descriptor.clone() };
        expect_bad_metadata(&mixed, "regions the named agent did not register");
        // Name that does not match the metadata.
        expect_bad_metadata(
            &NixlPoolDescriptor { agent_name: "someone-else".into(), ..good.clone() },
            "renamed",
        );
        // Daemon agent with the engine's own name.
        let same = NixlOptions { agent_name: Some(good.agent_name.clone()), ..opts() };
        assert!(matches!(NixlBackend::attach_with(&good, same), Err(PoolError::BadMetadata(_))));
        // Descriptor JSON that is not one.
        for s in ["", "{}", "[1,2]", r#"{"agent_name":"a","agent_metadata":"zz","regions":[]}"#] {
            assert!(matches!(NixlPoolDescriptor::from_json(s), Err(PoolError::BadMetadata(_))), "{s:?}");
        }
    });
    assert_write_lands(&a);
}

#[test]
fn regions_beyond_the_registration_are_refused() {
    let _g = serial();
    assert!(nixl_available());
    let engine = start_engine(EngineKind::Rust, &[1 << 20, 64 << 10]);
    let good = engine.process.descriptor.clone();
    assert_no_write(&engine, || {
        let mut d = good.clone();
        d.regions[0].len += 4096;
        expect_bad_metadata(&d, "region longer than registered");
        let mut d = good.clone();
        d.regions[1].addr += 4096;
        expect_bad_metadata(&d, "region shifted past its registration");
        let mut d = good.clone();
        d.regions[0].addr = 0x1000;
        expect_bad_metadata(&d, "unregistered address");
        let mut d = good.clone();
        d.regions[0].mem_type = kvferry_pool_nixl::MemKind::Vram;
        d.regions[1].mem_type = kvferry_pool_nixl::MemKind::Vram;
        expect_bad_metadata(&d, "DRAM registration described as VRAM");
        let mut d = good.clone();
        d.regions.clear();
        expect_bad_metadata(&d, "no regions");
    });
    assert_write_lands(&engine);
}

/// Corrupted bytes inside well-framed metadata can crash NIXL/UCX in the process that loads
/// them (see `src/proxy.rs`). The daemon side never loads them: the helper process does. Every
/// corruption is refused (`BadMetadata`, also when it crashed the helper) or attaches, and a
/// transfer through an attached one then ends, either way, well before its timeout; this
/// process (the "daemon") survives all of them and never loads engine metadata itself.
#[test]
fn corrupted_metadata_never_crashes_or_hangs_the_daemon_side() {
    let _g = serial();
    assert!(nixl_available());
    let engine = start_engine(EngineKind::Rust, &[1 << 20]);
    let good = engine.process.descriptor.clone();
    let n = good.agent_metadata.len();
    let rt = rt();
    let (mut refused, mut crashed, mut attached) = (0, 0, 0);
    for at in (40..n).step_by(23).chain([n - 9]) {
        let mut d = good.clone();
        for byte in &mut d.agent_metadata[at..(at + 8).min(n)] {
            *byte ^= 0x5A;
        }
        match NixlBackend::attach_with(&d, opts()) {
            Err(PoolError::BadMetadata(msg)) => {
                refused += 1;
                crashed += usize::from(msg.contains("crashed"));
            }
            Err(other) => panic!("corruption at {at}: expected BadMetadata or success, got {other:?}"),
            Ok(b) => {
                attached += 1;
                let mut st = b.staging(4096).expect("staging");
                let t = Instant::now();
                let _ = rt.block_on(b.read(&[Extent { region: 0, offset: 0, len: 4096 }], &mut st));
                assert!(
                    t.elapsed() < Duration::from_secs(16),
                    "corruption at {at}: read took {:?}",
                    t.elapsed()
                );
            }
        }
    }
    eprintln!("corrupted metadata: {refused} refused ({crashed} crashed the helper), {attached} attached");
    assert!(refused > 0, "no corruption was refused");
    assert_write_lands(&engine);
}

/// A helper that dies mid-life (killed) fails its pool's transfers with a typed, non-retryable
/// error at once; this process survives and a fresh attach works.
#[test]
fn helper_death_fails_the_pool_not_the_daemon() {
    let _g = serial();
    assert!(nixl_available());
    let engine = start_engine(EngineKind::Rust, &[1 << 20]);
    let b = NixlBackend::attach_with(&engine.process.descriptor, opts()).expect("attach");
    let rt = rt();
    let ext = [Extent { region: 0, offset: 0, len: 4096 }];
    let mut st = b.staging(4096).expect("staging");
    rt.block_on(b.read(&ext, &mut st)).expect("read while the helper lives");
    let pid = b.helper_pid().expect("helper pid");
    // SAFETY: plain kill(2) of our own child process.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    let t = Instant::now();
    let r = rt.block_on(b.read(&ext, &mut st));
    match r {
        Err(PoolError::Backend { backend: "nixl", retryable: false, detail }) => {
            assert!(detail.contains("gone"), "{detail}")
        }
        other => panic!("expected a non-retryable backend error, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(3), "took {:?}", t.elapsed());
    assert!(b.staging(4096).is_err(), "a dead helper registers no staging");
    drop(b);
    assert_write_lands(&engine);
}

#[test]
fn engine_exit_gives_errors_not_hangs() {
    let _g = serial();
    assert!(nixl_available());
    let mut engine = start_engine(EngineKind::Rust, &[1 << 20]);
    let b = NixlBackend::attach_with(&engine.process.descriptor, opts()).expect("attach");
    let rt = rt();
    let ext = [Extent { region: 0, offset: 0, len: 64 << 10 }];
    let mut st = b.staging(64 << 10).expect("staging");
    rt.block_on(b.read(&ext, &mut st)).expect("read while the engine lives");
    engine.process.kill();
    for round in 0..3 {
        let t = Instant::now();
        let r = rt.block_on(b.write(&ext, &st));
        assert!(
            matches!(r, Err(PoolError::Backend { backend: "nixl", .. } | PoolError::Closed)),
            "write {round}: {r:?}"
        );
        let r = rt.block_on(b.read(&ext, &mut st));
        assert!(
            matches!(r, Err(PoolError::Backend { backend: "nixl", .. } | PoolError::Closed)),
            "read {round}: {r:?}"
        );
        assert!(t.elapsed() < Duration::from_secs(21), "round {round} took {:?}", t.elapsed());
    }
}

/// Where libnixl_capi.so lives, from the environment the tests run with.
fn lib_dir() -> Option<String> {
    let mut dirs: Vec<String> = std::env::var("KVFERRY_NIXL_LIB_DIR").into_iter().collect();
    dirs.extend(std::env::var("LD_LIBRARY_PATH").unwrap_or_default().split(':').map(str::to_owned));
    dirs.into_iter().find(|d| !d.is_empty() && std::path::Path::new(d).join("libnixl_capi.so").exists())
}

#[test]
fn missing_library_is_a_typed_error_not_an_abort() {
    let _g = serial();
    assert!(nixl_available());
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry-nixl-engine"))
        .args(["--name", "no-lib", "--anon", "4096"])
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("KVFERRY_NIXL_LIB_DIR")
        .output()
        .expect("run engine");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        eprintln!("libnixl_capi.so is on the default search path; the missing-library case cannot be staged");
        return;
    }
    assert_eq!(out.status.code(), Some(1), "expected a clean exit 1, got {:?}; stderr: {stderr}", out.status);
    assert!(stderr.contains("libnixl_capi.so not found"), "stderr: {stderr}");

    // And KVFERRY_NIXL_LIB_DIR alone (no LD_LIBRARY_PATH) is enough to load it.
    let Some(dir) = lib_dir() else {
        panic!("cannot locate libnixl_capi.so's directory from the environment")
    };
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvferry-nixl-engine"));
    cmd.args(["--name", "lib-dir-only", "--anon", "4096"])
        .env_remove("LD_LIBRARY_PATH")
        .env("KVFERRY_NIXL_LIB_DIR", dir);
    let engine = EngineProcess::start(cmd);
    assert_eq!(engine.descriptor.regions.len(), 1);
}
