//! The CUDA backend against the shared conformance suite and its own IPC behaviour.
//!
//! `without_a_driver_every_entry_point_errs` runs everywhere and checks that every entry point
//! reports a missing driver as an error instead of panicking. Every test that needs a GPU is
//! `#[ignore]`d with that reason (so a machine without one reports it skipped, not passed) and
//! fails if asked for where no driver is present. With a GPU (`--include-ignored`):
//! - the suite runs in-process (engine memory of this process) once with the copy engines and
//!   once with the NVRTC kernel forced, so both paths are checked byte for byte;
//! - the suite runs over real CUDA IPC: a process cannot open its own handles, so each pool's
//!   engine is a child process (this test binary re-executed as `engine_child`) that allocates,
//!   exports and serves the "engine side" reads/writes over a line protocol on stdin/stdout.
#![cfg(feature = "cuda")]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};

use kvferry_pool::conformance::{self, Created, EngineSide, Fixture, FixtureError};
use kvferry_pool::{Extent, MemoryBackend, PoolError};
use kvferry_pool_cuda::descriptor::{decode_hex, encode_hex};
use kvferry_pool_cuda::{
    CopyPath, CudaBackend, CudaBackendConfig, CudaError, CudaIpcDescriptor, EnginePool, IPC_HANDLE_LEN,
    IpcRegion, PathChoice, unavailable_reason,
};

const CHILD_ENV: &str = "KVFERRY_CUDA_ENGINE_CHILD";

/// Writes a line to stderr past libtest's output capture (visible without `--nocapture`).
fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Reason string of the `#[ignore]` on every test that needs a GPU: run them with
/// `--include-ignored` where a device is present (native/gpu-check.sh does).
const NEEDS_GPU: &str = "needs a CUDA driver and device (native/gpu-check.sh runs it)";

/// Fails the test when there is no usable CUDA driver/device: these tests are `#[ignore]`d,
/// so reaching here means someone asked for them on a machine expected to have a GPU.
fn require_gpu(test: &str) {
    if let Some(reason) = unavailable_reason() {
        panic!("{test}: {NEEDS_GPU}; no CUDA driver here ({reason})");
    }
}

fn fixed(path: CopyPath) -> CudaBackendConfig {
    CudaBackendConfig {
        gather: PathChoice::Fixed(path),
        scatter: PathChoice::Fixed(path),
        ..CudaBackendConfig::default()
    }
}

/// Engine side of an in-process pool: synchronous driver copies on the pool's own memory.
struct LocalEngine(Arc<EnginePool>);

impl EngineSide for LocalEngine {
    fn read(&self, region: u32, offset: u64, out: &mut [u8]) -> Result<(), FixtureError> {
        Ok(self.0.read(region as usize, offset, out)?)
    }
    fn write(&self, region: u32, offset: u64, data: &[u8]) -> Result<(), FixtureError> {
        Ok(self.0.write(region as usize, offset, data)?)
    }
}

struct InProcess(CudaBackendConfig);

impl Fixture for InProcess {
    fn create(&self, region_lens: &[u64]) -> Result<Created, FixtureError> {
        let pool = Arc::new(EnginePool::allocate(0, region_lens)?);
        let backend = pool.in_process_backend(self.0.clone())?;
        Ok((Box::new(backend), Box::new(LocalEngine(pool))))
    }
}

/// The engine in a child process, spoken to line by line.
struct ChildEngine {
    io: Mutex<(Child, ChildStdin, BufReader<ChildStdout>)>,
}

impl ChildEngine {
    /// Starts an engine with regions of `lens` bytes; returns it and its descriptor.
    fn spawn(lens: &[u64], ready_event: bool) -> Result<(Self, CudaIpcDescriptor), FixtureError> {
        let spec = format!(
            "{};{}",
            lens.iter().map(u64::to_string).collect::<Vec<_>>().join(","),
            u8::from(ready_event)
        );
        let mut child = Command::new(std::env::current_exe()?)
            .args(["engine_child", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, spec)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let stdout = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        let engine = Self { io: Mutex::new((child, stdin, stdout)) };
        let desc = engine.reply("KVF-DESC")?;
        Ok((engine, serde_json::from_str(&desc)?))
    }

    fn send(&self, line: &str) -> Result<(), FixtureError> {
        let mut io = self.io.lock().unwrap_or_else(|p| p.into_inner());
        writeln!(io.1, "{line}")?;
        io.1.flush()?;
        Ok(())
    }

    /// The payload of the next `KVF-` line, which must carry `tag`.
    fn reply(&self, tag: &str) -> Result<String, FixtureError> {
        let mut io = self.io.lock().unwrap_or_else(|p| p.into_inner());
        let mut line = String::new();
        loop {
            line.clear();
            if io.2.read_line(&mut line)? == 0 {
                return Err("engine child exited".into());
            }
            // Searched, not stripped: with one test thread libtest prints "test engine_child ... "
            // on the same line before the child's first reply (a prefix match never sees it and
            // waits forever).
            let l = line.trim_end();
            if let Some(at) = l.find(tag) {
                return Ok(l[at + tag.len()..].trim_start().to_string());
            }
            if let Some(at) = l.find("KVF-ERR") {
                return Err(format!("engine child: {}", &l[at + "KVF-ERR".len()..]).into());
            }
        }
    }
}

impl EngineSide for ChildEngine {
    fn read(&self, region: u32, offset: u64, out: &mut [u8]) -> Result<(), FixtureError> {
        self.send(&format!("R {region} {offset} {}", out.len()))?;
        decode_hex(&self.reply("KVF-DATA")?, out)?;
        Ok(())
    }
    fn write(&self, region: u32, offset: u64, data: &[u8]) -> Result<(), FixtureError> {
        self.send(&format!("W {region} {offset} {}", encode_hex(data)))?;
        self.reply("KVF-OK").map(drop)
    }
}

impl Drop for ChildEngine {
    fn drop(&mut self) {
        let _ = self.send("Q");
        let io = self.io.get_mut().unwrap_or_else(|p| p.into_inner());
        let _ = io.0.wait();
    }
}

struct OverIpc;

impl Fixture for OverIpc {
    fn create(&self, region_lens: &[u64]) -> Result<Created, FixtureError> {
        let (engine, desc) = ChildEngine::spawn(region_lens, false)?;
        let backend = CudaBackend::open(&desc, CudaBackendConfig::default())?;
        Ok((Box::new(backend), Box::new(engine)))
    }
    fn large_pool_bytes(&self) -> u64 {
        64 << 20
    }
}

/// Not a test of its own: the engine process of the IPC tests, run only when they spawn it.
#[test]
#[ignore = "helper process of the IPC tests (spawned with --ignored)"]
fn engine_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else { return };
    let out = std::io::stdout();
    let say = |line: String| {
        let mut o = out.lock();
        let _ = writeln!(o, "{line}");
        let _ = o.flush();
    };
    let (lens, event) = spec.split_once(';').expect("spec is lens;event");
    let lens: Vec<u64> = lens.split(',').map(|l| l.parse().expect("region length")).collect();
    let mut pool = EnginePool::allocate(0, &lens).expect("engine child: allocate");
    if event == "1" {
        pool = pool.with_ready_event().expect("engine child: ready event");
    }
    say(format!("KVF-DESC {}", serde_json::to_string(&pool.descriptor()).expect("json")));
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("stdin");
        let parts: Vec<&str> = line.split(' ').collect();
        let result = match parts.as_slice() {
            ["Q"] => break,
            ["W", r, off, hex] => {
                let mut data = vec![0u8; hex.len() / 2];
                decode_hex(hex, &mut data)
                    .map_err(CudaError::Descriptor)
                    .and_then(|()| {
                        pool.write(r.parse().expect("region"), off.parse().expect("offset"), &data)
                    })
                    .and_then(|()| pool.record_ready())
                    .map(|()| "KVF-OK".to_string())
            }
            ["R", r, off, len] => {
                let mut data = vec![0u8; len.parse().expect("len")];
                pool.read(r.parse().expect("region"), off.parse().expect("offset"), &mut data)
                    .map(|()| format!("KVF-DATA {}", encode_hex(&data)))
            }
            other => Err(CudaError::Descriptor(format!("bad command {other:?}"))),
        };
        say(result.unwrap_or_else(|e| format!("KVF-ERR {e}")));
    }
}

#[test]
fn without_a_driver_every_entry_point_errs() {
    if unavailable_reason().is_none() {
        say("driver present: the no-driver paths are not exercised in this run");
        return;
    }
    assert!(!kvferry_pool_cuda::available());
    assert!(matches!(EnginePool::allocate(0, &[4096]), Err(CudaError::Unavailable(_))));
    let desc = CudaIpcDescriptor {
        handles: vec![IpcRegion { handle: [7; IPC_HANDLE_LEN], offset: 0, len: 4096 }],
        device: 0,
        device_uuid: None,
        ready_event: None,
    };
    let err = CudaBackend::open(&desc, CudaBackendConfig::default()).expect_err("no driver");
    assert!(matches!(err, CudaError::Unavailable(_)), "{err}");
    let pool_err: PoolError = err.into();
    assert!(!pool_err.is_retryable());
    // A malformed descriptor is refused before the driver is asked anything.
    let empty = CudaIpcDescriptor { handles: vec![], ..desc };
    assert!(matches!(CudaBackend::open(&empty, CudaBackendConfig::default()), Err(CudaError::Descriptor(_))));
    say(&format!(
        "SKIPPED: no CUDA driver ({}); no-driver errors checked",
        unavailable_reason().unwrap_or_default()
    ));
}

#[test]
#[ignore = "needs a CUDA driver and device (native/gpu-check.sh runs it)"]
fn conformance_in_process_memcpy() {
    require_gpu("conformance_in_process_memcpy");
    conformance::run_all(&InProcess(fixed(CopyPath::Memcpy)));
}

#[test]
#[ignore = "needs a CUDA driver and device (native/gpu-check.sh runs it)"]
fn conformance_in_process_kernel() {
    require_gpu("conformance_in_process_kernel");
    let probe = Arc::new(EnginePool::allocate(0, &[4096]).expect("allocate"));
    if let Err(e) = probe.in_process_backend(fixed(CopyPath::Kernel)) {
        panic!("kernel path unusable on a machine with a GPU (is libnvrtc on the library path?): {e}");
    }
    conformance::run_all(&InProcess(fixed(CopyPath::Kernel)));
}

#[test]
#[ignore = "needs a CUDA driver and device (native/gpu-check.sh runs it)"]
fn conformance_over_ipc() {
    require_gpu("conformance_over_ipc");
    // Every case once (each pool is a new engine process, so the full seed matrix would be slow).
    let fx = OverIpc;
    let seed = conformance::seeds()[0];
    conformance::staging_alloc(&fx);
    conformance::empty_sets(&fx);
    conformance::read_after_write(&fx, seed);
    conformance::out_of_bounds_writes_nothing(&fx, seed);
    conformance::concurrent_disjoint(&fx, seed);
    conformance::staging_too_small(&fx);
    conformance::foreign_staging(&fx);
    conformance::large_pool(&fx);
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

#[test]
#[ignore = "needs a CUDA driver and device (native/gpu-check.sh runs it)"]
fn ipc_shares_handles_waits_on_ready_event_and_never_frees() {
    require_gpu("ipc_shares_handles_waits_on_ready_event_and_never_frees");
    let rt = rt();
    let (engine, desc) = ChildEngine::spawn(&[8192, 4096, 100], true).expect("engine child");
    assert!(desc.ready_event.is_some());
    assert_eq!(desc.handles.len(), 3);
    let pattern: Vec<u8> = (0..8192u32).map(|i| (i * 31 % 251) as u8).collect();
    engine.write(0, 0, &pattern).expect("engine write");
    for path in [CopyPath::Memcpy, CopyPath::Kernel] {
        let backend = match CudaBackend::open(&desc, fixed(path)) {
            Ok(b) => b,
            Err(e) if path == CopyPath::Kernel => panic!("kernel path unusable: {e}"),
            Err(e) => panic!("open: {e}"),
        };
        assert_eq!(backend.ipc_mappings(), 1, "three regions of one allocation open one mapping");
        let extents = [Extent { region: 0, offset: 0, len: 8192 }];
        let mut st = backend.staging(8192).expect("staging");
        rt.block_on(backend.read(&extents, &mut st)).expect("read");
        assert_eq!(st.as_slice(), pattern.as_slice(), "{path:?} gather");
        // Scatter into the last (odd-sized, unaligned-length) region, check from the engine.
        let tail = [Extent { region: 2, offset: 1, len: 99 }];
        st.as_mut_slice()[..99].fill(0xC3);
        rt.block_on(backend.write(&tail, &st)).expect("write");
        let mut got = [0u8; 100];
        engine.read(2, 0, &mut got).expect("engine read");
        assert_eq!(got[0], 0, "{path:?}: byte before the extent untouched");
        assert!(got[1..].iter().all(|&b| b == 0xC3), "{path:?} scatter");
        engine.write(2, 0, &[0u8; 100]).expect("reset");
        drop(st);
        drop(backend);
        // Closing the mapping must not have freed the engine's memory.
        let mut again = vec![0u8; 8192];
        engine.read(0, 0, &mut again).expect("engine read after close");
        assert_eq!(again, pattern);
    }
}

#[test]
#[ignore = "needs a CUDA driver and device (native/gpu-check.sh runs it)"]
fn foreign_or_stale_handles_are_bad_metadata() {
    require_gpu("foreign_or_stale_handles_are_bad_metadata");
    let desc = CudaIpcDescriptor {
        handles: vec![IpcRegion { handle: [0x5a; IPC_HANDLE_LEN], offset: 0, len: 4096 }],
        device: 0,
        device_uuid: None,
        ready_event: None,
    };
    match CudaBackend::open(&desc, fixed(CopyPath::Memcpy)) {
        Err(CudaError::Descriptor(_) | CudaError::Driver { .. }) => {}
        other => panic!("garbage handle: expected an error, got {other:?}"),
    }
    // A region past the end of a real allocation is refused.
    let (_engine, mut desc) = ChildEngine::spawn(&[4096], false).expect("engine child");
    desc.handles[0].len = 1 << 40;
    match CudaBackend::open(&desc, fixed(CopyPath::Memcpy)) {
        Err(CudaError::Descriptor(msg)) => assert!(msg.contains("exceeds"), "{msg}"),
        other => panic!("oversized region: expected Descriptor error, got {other:?}"),
    }
    desc.handles[0].len = 4096;
    desc.device_uuid = Some("00".repeat(16));
    match CudaBackend::open(&desc, fixed(CopyPath::Memcpy)) {
        Err(CudaError::Descriptor(msg)) => assert!(msg.contains("UUID"), "{msg}"),
        other => panic!("unknown device UUID: expected Descriptor error, got {other:?}"),
    }
}

#[test]
#[ignore = "needs a CUDA driver and device (native/gpu-check.sh runs it)"]
fn cancelled_batches_finish_before_staging_is_released() {
    require_gpu("cancelled_batches_finish_before_staging_is_released");
    let rt = rt();
    let pool = Arc::new(EnginePool::allocate(0, &[64 << 20]).expect("allocate"));
    for path in [CopyPath::Memcpy, CopyPath::Kernel] {
        let backend = pool.in_process_backend(fixed(path)).expect("backend");
        let extents: Vec<Extent> =
            (0..32).map(|i| Extent { region: 0, offset: i * (2 << 20), len: 2 << 20 }).collect();
        for _ in 0..8 {
            let mut st = backend.staging(64 << 20).expect("staging");
            let fut = backend.read(&extents, &mut st);
            // Poll once (enqueues the copies), then drop the future and the staging at once.
            rt.block_on(async {
                let mut fut = fut;
                let _ = futures_poll_once(&mut fut).await;
            });
            drop(st);
        }
        let mut st = backend.staging(4096).expect("staging");
        rt.block_on(backend.read(&extents[..1], &mut st)).expect_err("staging too small is refused");
        let mut st = backend.staging(2 << 20).expect("staging");
        rt.block_on(backend.read(&extents[..1], &mut st)).expect("the backend still works");
    }
}

/// Polls a future exactly once.
async fn futures_poll_once<F: std::future::Future + Unpin>(f: &mut F) -> std::task::Poll<F::Output> {
    std::future::poll_fn(|cx| std::task::Poll::Ready(std::pin::Pin::new(&mut *f).poll(cx))).await
}

#[test]
#[ignore = "needs a CUDA driver and device (native/gpu-check.sh runs it)"]
fn calibration_reports_both_paths() {
    require_gpu("calibration_reports_both_paths");
    let pool = Arc::new(EnginePool::allocate(0, &[4096]).expect("allocate"));
    let backend = pool.in_process_backend(CudaBackendConfig::default()).expect("backend");
    let t = backend.calibrate(64 << 10, 64, 2).expect("calibrate");
    say(&format!("calibration (64 x 64 KiB): {t:?}; chosen paths {:?}", backend.paths()));
    assert!(t.gather_memcpy > 0.0 && t.scatter_memcpy > 0.0);
}
