//! `RegisterPool` with NIXL access against a real daemon (in process) and a real engine-side
//! NIXL agent (in process too): malformed, truncated, mismatched and foreign descriptors get a
//! typed gRPC error (INVALID_ARGUMENT or FAILED_PRECONDITION), and the daemon keeps serving
//! (a good descriptor registers afterwards, and the attached pool reads and writes).
//!
//! Needs NIXL (`source deploy/install-nixl.sh`); without it the test fails with instructions,
//! as crates/pool-nixl's tests do.

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_nixl_descriptors_get_typed_errors_and_the_daemon_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let mut cfg = Config { run_dir: dir.path().join("run"), ..Config::default() };
    cfg.tls.dev_dir = dir.path().join("dev-ca");
    cfg.listen.grpc = any;
    cfg.listen.http = any;
    cfg.listen.peer = any;
    let daemon = Daemon::start(cfg.clone()).await.unwrap();
    let mut client = connect(&cfg.engine_socket()).await;

    let lens = kvferry_daemon::engine_api::layout_of(&spec()).unwrap().region_lens().to_vec();
    let pool = engine_pool(&lens);
    let good = pool.export.as_ref().unwrap().descriptor().unwrap();
    let good_json = good.to_json();
    let with = |f: &dyn Fn(&mut NixlPoolDescriptor)| {
        let mut d = good.clone();
        f(&mut d);
        d.to_json().into_bytes()
    };
    let md_len = good.agent_metadata.len();
    let cases: Vec<(&str, Vec<u8>, Code)> = vec![
        ("empty", Vec::new(), Code::InvalidArgument),
        ("not json", b"hello".to_vec(), Code::InvalidArgument),
        ("not utf-8", vec![0xff, 0xfe, b'{'], Code::InvalidArgument),
        ("truncated json", good_json.as_bytes()[..good_json.len() / 2].to_vec(), Code::InvalidArgument),
        ("json missing fields", br#"{"agent_name":"x"}"#.to_vec(), Code::InvalidArgument),
        ("one region short", with(&|d| d.regions.truncate(1)), Code::InvalidArgument),
        ("one region too many", with(&|d| d.regions.push(d.regions[0])), Code::InvalidArgument),
        ("region too small", with(&|d| d.regions[1].len -= 1), Code::InvalidArgument),
        ("no metadata", with(&|d| d.agent_metadata.clear()), Code::FailedPrecondition),
        ("garbage metadata", with(&|d| d.agent_metadata = b"garbage".to_vec()), Code::FailedPrecondition),
        ("truncated metadata", with(&|d| d.agent_metadata.truncate(md_len / 2)), Code::FailedPrecondition),
        ("renamed agent", with(&|d| d.agent_name = "someone-else".into()), Code::FailedPrecondition),
        (
            "region not registered",
            with(&|d| {
                d.regions[0].addr += 1 << 20;
            }),
            Code::FailedPrecondition,
        ),
    ];
    for (what, json, code) in cases {
        let e = client.register_pool(request("engine-bad", json)).await.expect_err(what);
        assert_eq!(e.code(), code, "{what}: {}", e.message());
        assert!(!e.message().is_empty(), "{what}");
    }

    // Still serving: a good descriptor registers, and the pool is reachable through NIXL.
    let lease =
        client.register_pool(request("engine-good", good_json.into_bytes())).await.unwrap().into_inner();
    assert_eq!(lease.lease_id.len(), 32);
    let entry = daemon.shared.registry.by_lease(&lease.lease_id).expect("registered");
    assert_eq!(entry.backend.name(), "nixl");
    let extents = entry.layout.extents(&[3], 0..2).unwrap();
    let bytes: usize = extents.iter().map(|e| e.len as usize).sum();
    let mut staging = entry.backend.staging(bytes).unwrap();
    entry.backend.read(&extents, &mut staging).await.unwrap();
    let mut want = Vec::new();
    for e in &extents {
        let r = &pool.regions[e.region as usize];
        want.extend_from_slice(&r[e.offset as usize..(e.offset + e.len) as usize]);
    }
    assert_eq!(&staging.as_slice()[..bytes], &want[..]);
    staging.as_mut_slice()[..bytes].fill(0xab);
    entry.backend.write(&extents, &staging).await.unwrap();
    for e in &extents {
        let r = &pool.regions[e.region as usize];
        assert!(r[e.offset as usize..(e.offset + e.len) as usize].iter().all(|&b| b == 0xab));
    }
    let e = client
        .lookup(LookupRequest { lease_id: "no-such-lease".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    drop(entry);
    drop(daemon);
}
