//! `RegisterPool` with CUDA IPC access against a real daemon (in process).
//!
//! On every build and host: malformed, invalid and mismatched descriptors get INVALID_ARGUMENT
//! naming the problem; a well-formed descriptor that cannot be opened here (a daemon built
//! without the `cuda` feature, no driver, or a handle that does not open) gets
//! FAILED_PRECONDITION; and the daemon keeps serving (an unknown lease is NOT_FOUND, a shm pool
//! registers afterwards).
//!
//! With `--features cuda` and a driver: an engine child process (this test binary re-executed
//! as `cuda_engine_child`; a process cannot open its own IPC handles) allocates device memory,
//! fills it with a known pattern and exports it; the daemon registers it through RegisterPool
//! and reads the pattern back (and writes, checked from the engine side). Without a driver that
//! test is `#[ignore]`d (native/gpu-check.sh runs it with --include-ignored) and fails if run
//! without one.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;

use kvferry_daemon::{Config, Daemon};
use kvferry_pool_cuda::{CudaIpcDescriptor, IPC_HANDLE_LEN, IpcRegion};
use kvferry_proto::v1::engine_client::EngineClient;
use kvferry_proto::v1::{
    CudaIpcAccess, LookupRequest, RegisterPoolRequest, ShmAccess, register_pool_request,
};
use tonic::Code;
use tonic::transport::Channel;

mod common;

const MODEL: &str = "model-cuda-test";

/// Writes a line to stderr past libtest's output capture (visible without `--nocapture`).
fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

async fn start_daemon(dir: &Path) -> (Daemon, Config) {
    let cfg = common::config(dir, "region-a");
    (common::start(&cfg).await, cfg)
}

async fn connect(path: &Path) -> EngineClient<Channel> {
    EngineClient::new(kvferry_engine_node::daemon::connect_uds(path).await.unwrap())
}

fn request(engine: &str, access: register_pool_request::Access) -> RegisterPoolRequest {
    RegisterPoolRequest {
        engine_id: engine.into(),
        model_id: MODEL.into(),
        layout: Some(common::spec()),
        access: Some(access),
        profile: Some(common::profile()),
    }
}

fn cuda(descriptor_json: Vec<u8>) -> register_pool_request::Access {
    register_pool_request::Access::Cuda(CudaIpcAccess { descriptor_json })
}

/// A well-formed descriptor matching the layout, with handles that name no allocation: one
/// allocation carved into the layout's regions.
fn plausible_descriptor(lens: &[u64]) -> CudaIpcDescriptor {
    let mut offset = 0;
    let handles = lens
        .iter()
        .map(|&len| {
            let r = IpcRegion { handle: [0x5a; IPC_HANDLE_LEN], offset, len };
            offset += len.next_multiple_of(256);
            r
        })
        .collect();
    CudaIpcDescriptor { handles, device: 0, device_uuid: None, ready_event: None }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_cuda_descriptors_get_typed_errors_and_the_daemon_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let (daemon, cfg) = start_daemon(dir.path()).await;
    let mut client = connect(&cfg.engine_socket()).await;

    let lens = common::region_lens();
    assert!(lens.len() >= 2, "the test layout has several regions");
    let good = plausible_descriptor(&lens);
    let good_json = serde_json::to_string(&good).unwrap();
    let with = |f: &dyn Fn(&mut CudaIpcDescriptor)| {
        let mut d = good.clone();
        f(&mut d);
        serde_json::to_vec(&d).unwrap()
    };
    let handle_hex = "5a".repeat(IPC_HANDLE_LEN);
    // (case, descriptor JSON, what the message must mention)
    let invalid: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty", Vec::new(), "cuda.descriptor_json"),
        ("not json", b"hello".to_vec(), "cuda.descriptor_json"),
        ("not utf-8", vec![0xff, 0xfe, b'{'], "cuda.descriptor_json"),
        ("truncated json", good_json.as_bytes()[..good_json.len() / 2].to_vec(), "cuda.descriptor_json"),
        ("json missing fields", br#"{"device":0}"#.to_vec(), "handles"),
        (
            "short handle",
            br#"{"handles":[{"handle":"abcd","offset":0,"len":1}],"device":0}"#.to_vec(),
            "hex digits",
        ),
        (
            "handle not hex",
            format!(r#"{{"handles":[{{"handle":"{}","offset":0,"len":1}}],"device":0}}"#, "zz".repeat(64))
                .into_bytes(),
            "not a hex digit",
        ),
        (
            "negative length",
            format!(r#"{{"handles":[{{"handle":"{handle_hex}","offset":0,"len":-1}}],"device":0}}"#)
                .into_bytes(),
            "cuda.descriptor_json",
        ),
        ("no regions", with(&|d| d.handles.clear()), "no regions"),
        ("empty region", with(&|d| d.handles[1].len = 0), "region 1 has length 0"),
        ("overflowing region", with(&|d| d.handles[0].offset = u64::MAX), "overflows"),
        ("bad uuid", with(&|d| d.device_uuid = Some("xyz".into())), "device_uuid"),
        ("one region short", with(&|d| d.handles.truncate(d.handles.len() - 1)), "regions, the layout has"),
        (
            "one region too many",
            with(&|d| {
                let extra = d.handles[0].clone();
                d.handles.push(extra);
            }),
            "regions, the layout has",
        ),
        ("region too small", with(&|d| d.handles[1].len -= 1), "region 1 is"),
    ];
    for (what, json, mentions) in invalid {
        let e = client.register_pool(request("engine-bad", cuda(json))).await.expect_err(what);
        assert_eq!(e.code(), Code::InvalidArgument, "{what}: {}", e.message());
        assert!(e.message().contains(mentions), "{what}: {:?} should mention {mentions:?}", e.message());
    }

    // Well formed and matching the layout, but not openable here: a daemon without the
    // feature, a host without a driver, or (with one) a handle that names no allocation.
    let e = client.register_pool(request("engine-cuda", cuda(good_json.into_bytes()))).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());
    if cfg!(not(feature = "cuda")) {
        assert!(e.message().contains("built without the `cuda` feature"), "{}", e.message());
    } else if !driver_present() {
        assert!(e.message().contains("no CUDA driver on this host"), "{}", e.message());
    }
    say(&format!("well-formed descriptor on this host: {:?} {}", e.code(), e.message()));
    assert!(daemon.shared.registry.all().is_empty(), "nothing was registered");

    // Still serving: an unknown lease is NOT_FOUND, and a shm pool registers and reads.
    let e = client
        .lookup(LookupRequest { lease_id: "no-such-lease".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let layout = kvferry_daemon::engine_api::layout_of(&common::spec()).unwrap();
    let shm = kvferry_engine_sdk::ShmPool::create(layout).unwrap();
    let stream = shm.connect_and_share(cfg.pool_socket(), MODEL).unwrap();
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line).unwrap();
    let pool_token = line.trim_end().to_owned();
    assert!(!pool_token.is_empty() && !pool_token.starts_with("error"), "{line:?}");
    let lease = client
        .register_pool(request("engine-shm", register_pool_request::Access::Shm(ShmAccess { pool_token })))
        .await
        .unwrap()
        .into_inner();
    let entry = daemon.shared.registry.by_lease(&lease.lease_id).expect("registered");
    assert_eq!(entry.backend.name(), "shm");
    let extents = entry.layout.extents(&[1], 0..2).unwrap();
    let bytes: usize = extents.iter().map(|e| e.len as usize).sum();
    let mut staging = entry.backend.staging(bytes).unwrap();
    entry.backend.read(&extents, &mut staging).await.unwrap();
    drop(staging);
    drop(entry);
    drop(stream);
    drop(daemon);
}

#[cfg(feature = "cuda")]
fn driver_present() -> bool {
    kvferry_pool_cuda::available()
}

#[cfg(not(feature = "cuda"))]
fn driver_present() -> bool {
    false
}

#[cfg(feature = "cuda")]
mod gpu {
    //! A real CUDA IPC pool registered through RegisterPool (needs a driver and a device).

    use std::io::{BufRead, BufReader, Write};
    use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

    use kvferry_pool_cuda::descriptor::{decode_hex, encode_hex};
    use kvferry_pool_cuda::{CudaIpcDescriptor, EnginePool, unavailable_reason};
    use tonic::Code;

    use super::{connect, cuda, request, say, start_daemon};
    use crate::common::region_lens;

    const CHILD_ENV: &str = "KVFERRY_DAEMON_CUDA_ENGINE_CHILD";

    /// The byte the engine child writes at `offset` of region `region`.
    fn pattern(region: usize, offset: u64) -> u8 {
        ((offset.wrapping_mul(31) + region as u64 * 17) % 251) as u8
    }

    /// The engine child process, spoken to line by line (`R region offset len`, `Q`).
    struct Engine {
        child: Child,
        stdin: ChildStdin,
        stdout: BufReader<ChildStdout>,
    }

    impl Engine {
        fn spawn(lens: &[u64]) -> (Self, CudaIpcDescriptor) {
            let spec = lens.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
            let mut child = Command::new(std::env::current_exe().expect("test binary"))
                .args(["gpu::cuda_engine_child", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
                .env(CHILD_ENV, spec)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn the engine child");
            let stdin = child.stdin.take().expect("stdin");
            let stdout = BufReader::new(child.stdout.take().expect("stdout"));
            let mut engine = Self { child, stdin, stdout };
            let desc = engine.reply("KVF-DESC");
            (engine, serde_json::from_str(&desc).expect("descriptor JSON"))
        }

        fn reply(&mut self, tag: &str) -> String {
            let mut line = String::new();
            loop {
                line.clear();
                assert!(self.stdout.read_line(&mut line).expect("read") > 0, "engine child exited");
                // Searched, not stripped: with one test thread libtest prints "test NAME ... "
                // on the same line before the child's first reply.
                let l = line.trim_end();
                if let Some(at) = l.find(tag) {
                    return l[at + tag.len()..].trim_start().to_string();
                }
                if let Some(at) = l.find("KVF-ERR") {
                    panic!("engine child: {}", &l[at..]);
                }
            }
        }

        fn read(&mut self, region: u32, offset: u64, len: usize) -> Vec<u8> {
            writeln!(self.stdin, "R {region} {offset} {len}").expect("write");
            self.stdin.flush().expect("flush");
            let mut out = vec![0u8; len];
            decode_hex(&self.reply("KVF-DATA"), &mut out).expect("hex");
            out
        }
    }

    impl Drop for Engine {
        fn drop(&mut self) {
            let _ = writeln!(self.stdin, "Q");
            let _ = self.stdin.flush();
            let _ = self.child.wait();
        }
    }

    /// Not a test of its own: the engine process of `cuda_pool_registers_and_reads_back`
    /// (does nothing unless spawned by it).
    #[test]
    #[ignore = "helper process of cuda_pool_registers_and_reads_back (spawned with --ignored)"]
    fn cuda_engine_child() {
        let Ok(spec) = std::env::var(CHILD_ENV) else { return };
        let out = std::io::stdout();
        let send = |line: String| {
            let mut o = out.lock();
            let _ = writeln!(o, "{line}");
            let _ = o.flush();
        };
        let lens: Vec<u64> = spec.split(',').map(|l| l.parse().expect("region length")).collect();
        let pool = match EnginePool::allocate(0, &lens) {
            Ok(p) => p,
            Err(e) => {
                send(format!("KVF-ERR allocate: {e}"));
                return;
            }
        };
        for (r, &len) in lens.iter().enumerate() {
            let data: Vec<u8> = (0..len).map(|o| pattern(r, o)).collect();
            if let Err(e) = pool.write(r, 0, &data) {
                send(format!("KVF-ERR write region {r}: {e}"));
                return;
            }
        }
        send(format!("KVF-DESC {}", serde_json::to_string(&pool.descriptor()).expect("json")));
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            let parts: Vec<&str> = line.split(' ').collect();
            match parts.as_slice() {
                ["R", r, off, len] => {
                    let mut data = vec![0u8; len.parse().expect("len")];
                    let reply = pool
                        .read(r.parse().expect("region"), off.parse().expect("offset"), &mut data)
                        .map(|()| format!("KVF-DATA {}", encode_hex(&data)))
                        .unwrap_or_else(|e| format!("KVF-ERR {e}"));
                    send(reply);
                }
                _ => break,
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs a CUDA driver and device (native/gpu-check.sh runs it)"]
    async fn cuda_pool_registers_and_reads_back() {
        if let Some(reason) = unavailable_reason() {
            panic!("cuda_pool_registers_and_reads_back needs a CUDA driver and device: {reason}");
        }
        let dir = tempfile::tempdir().unwrap();
        let (daemon, cfg) = start_daemon(dir.path()).await;
        let mut client = connect(&cfg.engine_socket()).await;
        let lens = region_lens();
        let (mut engine, desc) = Engine::spawn(&lens);
        assert_eq!(desc.handles.len(), lens.len());

        // Real handles, but a region past the end of the allocation: refused when opened.
        let mut oversized = desc.clone();
        oversized.handles.last_mut().expect("a region").len = 1 << 40;
        let e = client
            .register_pool(request("engine-oversized", cuda(serde_json::to_vec(&oversized).unwrap())))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());
        assert!(e.message().contains("exceeds"), "{}", e.message());
        // A device UUID that no visible device has.
        let mut foreign = desc.clone();
        foreign.device_uuid = Some("00".repeat(16));
        let e = client
            .register_pool(request("engine-foreign", cuda(serde_json::to_vec(&foreign).unwrap())))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());

        let t = std::time::Instant::now();
        let lease = client
            .register_pool(request("engine-gpu", cuda(serde_json::to_vec(&desc).unwrap())))
            .await
            .unwrap_or_else(|e| panic!("RegisterPool with a real CUDA IPC pool: {e}"))
            .into_inner();
        say(&format!("CUDA IPC pool registered in {:?} (lease {})", t.elapsed(), lease.lease_id));
        let entry = daemon.shared.registry.by_lease(&lease.lease_id).expect("registered");
        assert_eq!(entry.backend.name(), "cuda");

        // The daemon gathers blocks 3 and 6 (every layer) and sees the engine's bytes.
        let layers = entry.layout.num_layers();
        let extents = entry.layout.extents(&[3, 6], 0..layers).unwrap();
        let bytes: usize = extents.iter().map(|e| e.len as usize).sum();
        let mut staging = entry.backend.staging(bytes).unwrap();
        entry.backend.read(&extents, &mut staging).await.unwrap();
        let mut want = Vec::with_capacity(bytes);
        for e in &extents {
            want.extend((e.offset..e.offset + e.len).map(|o| pattern(e.region as usize, o)));
        }
        assert_eq!(&staging.as_slice()[..bytes], &want[..], "gathered bytes differ from the engine's");

        // And scatters into the engine's memory (checked from the engine process).
        staging.as_mut_slice()[..bytes].fill(0xab);
        entry.backend.write(&extents, &staging).await.unwrap();
        for e in &extents {
            let got = engine.read(e.region, e.offset, e.len as usize);
            assert!(
                got.iter().all(|&b| b == 0xab),
                "region {} offset {}: scatter not visible",
                e.region,
                e.offset
            );
        }
        // Bytes outside the extents are untouched (block 4 of region 0).
        let other = entry.layout.extents(&[4], 0..1).unwrap();
        let e0 = other[0];
        let got = engine.read(e0.region, e0.offset, e0.len as usize);
        let want: Vec<u8> = (e0.offset..e0.offset + e0.len).map(|o| pattern(e0.region as usize, o)).collect();
        assert_eq!(got, want, "a block outside the batch changed");
        say(&format!("CUDA IPC pool through RegisterPool: {bytes} bytes gathered and scattered, verified"));

        drop(staging);
        drop(entry);
        // The daemon closes its mapping (never frees) before the engine frees its memory.
        drop(daemon.shared.registry.remove(&lease.lease_id).expect("still registered"));
        drop(daemon);
        drop(engine);
    }
}
