//! The daemon's NIXL helper processes under load and under failure, against a real daemon:
//! - several NIXL pools registered at once (concurrent `RegisterPool`), then blocks read and
//!   written through all of them in parallel, round after round, every byte checked in the
//!   engines' own memory (5 rounds here; `KVFERRY_NIXL_STRESS_ROUNDS=50` for the long run);
//! - no helper program: the registration is refused with FAILED_PRECONDITION naming it;
//! - a helper that crashes (as a corrupted blob crashes NIXL/UCX): refused, the daemon serves on.
//!
//! One test function (the cases change a process-wide environment variable).
//! Needs NIXL (`source deploy/install-nixl.sh`) and the `kvferry-nixl-engine` binary next to the
//! test binary's directory (a workspace build has it).

use std::net::SocketAddr;
use std::path::Path;

use kvferry_daemon::{Config, Daemon};
use kvferry_pool_nixl::{MemKind, NixlPoolDescriptor, NixlPoolExport, NixlRegion};
use kvferry_proto::v1::engine_client::EngineClient;
use kvferry_proto::v1::{
    LookupRequest, NixlAccess, PoolLayoutSpec, PrefillProfile, RegisterPoolRequest, register_pool_request,
};
use tonic::Code;
use tonic::transport::{Channel, Endpoint, Uri};

fn spec() -> PoolLayoutSpec {
    PoolLayoutSpec {
        kind: "vllm_flash_attn_nhd".into(),
        layers: 2,
        kv_heads: 2,
        head_dim: 32,
        block_size: 16,
        num_blocks: 8,
        dtype: "f32".into(),
    }
}

async fn connect(path: &Path) -> EngineClient<Channel> {
    let path = path.to_owned();
    let ch = Endpoint::try_from("http://[::]:50051")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
        .unwrap();
    EngineClient::new(ch)
}

fn request(engine: &str, descriptor_json: Vec<u8>) -> RegisterPoolRequest {
    RegisterPoolRequest {
        engine_id: engine.into(),
        model_id: "model-nixl-test".into(),
        layout: Some(spec()),
        access: Some(register_pool_request::Access::Nixl(NixlAccess { descriptor_json })),
        profile: Some(PrefillProfile { linear_s_per_token: 1e-4, attention_s_per_pair: 1e-9, samples: 1 }),
    }
}

/// Host memory registered with an engine-side NIXL agent; the export is dropped first.
struct EnginePool {
    export: Option<NixlPoolExport>,
    regions: Vec<Vec<u8>>,
}

impl Drop for EnginePool {
    fn drop(&mut self) {
        self.export.take();
    }
}

fn engine_pool(lens: &[u64]) -> EnginePool {
    let mut export = NixlPoolExport::new(&format!("kvferry-test-engine-{}", std::process::id()))
        .unwrap_or_else(|e| panic!("NIXL is required: `source deploy/install-nixl.sh` first ({e})"));
    let mut regions: Vec<Vec<u8>> =
        lens.iter().enumerate().map(|(i, &l)| vec![i as u8 + 1; l as usize]).collect();
    for r in &mut regions {
        let region =
            NixlRegion { addr: r.as_mut_ptr() as u64, len: r.len() as u64, mem_type: MemKind::Dram, dev: 0 };
        // SAFETY: the Vec's heap buffer is plain host memory of exactly that length; it is
        // never reallocated, and `EnginePool::drop` drops the export (deregistering) before the
        // Vecs are freed. The test reads the Vecs only while no transfer is in flight.
        unsafe { export.register(region) }.unwrap();
    }
    EnginePool { export: Some(export), regions }
}

async fn start(dir: &Path) -> (Daemon, Config) {
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let mut cfg = Config { run_dir: dir.join("run"), ..Config::default() };
    cfg.tls.dev_dir = dir.join("dev-ca");
    cfg.listen.grpc = any;
    cfg.listen.http = any;
    cfg.listen.peer = any;
    (Daemon::start(cfg.clone()).await.unwrap(), cfg)
}

const POOLS: usize = 4;

async fn stress_round(daemon: &Daemon, client: &EngineClient<Channel>, round: usize) {
    let lens = kvferry_daemon::engine_api::layout_of(&spec()).unwrap().region_lens().to_vec();
    let pools: Vec<EnginePool> =
        (0..POOLS).map(|i| engine_pool_named(&lens, &format!("r{round}-p{i}"))).collect();
    // Register every pool at the same time.
    let mut regs = Vec::new();
    for (i, p) in pools.iter().enumerate() {
        let json = p.export.as_ref().unwrap().descriptor().unwrap().to_json().into_bytes();
        let mut c = client.clone();
        regs.push(tokio::spawn(async move {
            c.register_pool(request(&format!("engine-{round}-{i}"), json))
                .await
                .map(|r| r.into_inner().lease_id)
        }));
    }
    let mut leases = Vec::new();
    for r in regs {
        leases.push(r.await.unwrap().expect("concurrent registration"));
    }
    // Move bytes through all of them in parallel.
    let mut moves = Vec::new();
    for (i, lease) in leases.iter().enumerate() {
        let entry = daemon.shared.registry.by_lease(lease).expect("registered");
        moves.push(tokio::spawn(async move {
            let block = (i + round) as u32 % 8;
            let extents = entry.layout.extents(&[block], 0..2).unwrap();
            let bytes: usize = extents.iter().map(|e| e.len as usize).sum();
            let mut st = entry.backend.staging(bytes).unwrap();
            entry.backend.read(&extents, &mut st).await.unwrap();
            let read = st.as_slice()[..bytes].to_vec();
            let fill = 0x40 + (i as u8) + (round as u8 % 64);
            st.as_mut_slice()[..bytes].fill(fill);
            entry.backend.write(&extents, &st).await.unwrap();
            (extents, read, fill)
        }));
    }
    for (i, m) in moves.into_iter().enumerate() {
        let (extents, read, fill) = m.await.unwrap();
        let p = &pools[i];
        let mut at = 0;
        for e in &extents {
            let r = &p.regions[e.region as usize];
            let range = e.offset as usize..(e.offset + e.len) as usize;
            // What was read is what the engine held before (its initial fill) ...
            assert!(
                read[at..at + e.len as usize].iter().all(|&b| b == e.region as u8 + 1),
                "pool {i}: read wrong bytes"
            );
            // ... and what was written is what it holds now.
            assert!(r[range].iter().all(|&b| b == fill), "pool {i}: write did not land");
            at += e.len as usize;
        }
    }
    drop(pools);
}

fn engine_pool_named(lens: &[u64], tag: &str) -> EnginePool {
    let mut export = NixlPoolExport::new(&format!("kvferry-stress-{}-{tag}", std::process::id()))
        .unwrap_or_else(|e| panic!("NIXL is required: `source deploy/install-nixl.sh` first ({e})"));
    let mut regions: Vec<Vec<u8>> =
        lens.iter().enumerate().map(|(i, &l)| vec![i as u8 + 1; l as usize]).collect();
    for r in &mut regions {
        let region =
            NixlRegion { addr: r.as_mut_ptr() as u64, len: r.len() as u64, mem_type: MemKind::Dram, dev: 0 };
        // SAFETY: as in `engine_pool`: a Vec's heap buffer, never reallocated, deregistered
        // (export dropped) before it is freed; read by the test only between transfers.
        unsafe { export.register(region) }.unwrap();
    }
    EnginePool { export: Some(export), regions }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_helpers_under_concurrency_and_failure() {
    let dir = tempfile::tempdir().unwrap();
    let (daemon, cfg) = start(dir.path()).await;
    let client = connect(&cfg.engine_socket()).await;

    let rounds: usize =
        std::env::var("KVFERRY_NIXL_STRESS_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(5);
    let t = std::time::Instant::now();
    for round in 0..rounds {
        stress_round(&daemon, &client, round).await;
    }
    eprintln!(
        "{rounds} rounds x {POOLS} concurrent NIXL registrations + parallel reads/writes: {:?}",
        t.elapsed()
    );

    let lens = kvferry_daemon::engine_api::layout_of(&spec()).unwrap().region_lens().to_vec();
    let pool = engine_pool(&lens);
    let json = pool.export.as_ref().unwrap().descriptor().unwrap().to_json().into_bytes();
    let mut c = client.clone();

    // No helper program: refused, naming why.
    // SAFETY (of the process-wide change): this test binary has this one test; nothing else
    // reads the environment concurrently except the daemon's registration, which is the point.
    unsafe { std::env::set_var(kvferry_daemon::engine_api::NIXL_HELPER_ENV, "") };
    let e = c.register_pool(request("engine-no-helper", json.clone())).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());
    assert!(e.message().contains("no NIXL helper"), "{}", e.message());

    // A helper that dies of SIGSEGV, as a blob that crashes UCX makes it die.
    let crasher = dir.path().join("crashing-helper.sh");
    std::fs::write(&crasher, "#!/bin/sh\nkill -SEGV $$\n").unwrap();
    std::fs::set_permissions(&crasher, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    // SAFETY: as above.
    unsafe { std::env::set_var(kvferry_daemon::engine_api::NIXL_HELPER_ENV, &crasher) };
    let e = c.register_pool(request("engine-crash", json.clone())).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());
    assert!(e.message().contains("crashed"), "{}", e.message());

    // The daemon serves on: unknown lease is NOT_FOUND, and with the helper back a pool registers.
    let e =
        c.lookup(LookupRequest { lease_id: "no-such-lease".into(), ..Default::default() }).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    // SAFETY: as above.
    unsafe { std::env::remove_var(kvferry_daemon::engine_api::NIXL_HELPER_ENV) };
    let lease = c.register_pool(request("engine-after", json)).await.unwrap().into_inner();
    assert!(daemon.shared.registry.by_lease(&lease.lease_id).is_some());
    drop(pool);
    drop(daemon);
}
