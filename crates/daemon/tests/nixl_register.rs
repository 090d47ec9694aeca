//! `RegisterPool` with NIXL access against a real daemon (in process) and a real engine-side
//! NIXL agent (in process too): malformed, truncated, mismatched and foreign descriptors get a
//! typed gRPC error (INVALID_ARGUMENT or FAILED_PRECONDITION), and the daemon keeps serving
//! (a good descriptor registers afterwards, and the attached pool reads and writes).
//!
//! Needs NIXL (`source deploy/install-nixl.sh`); without it the test fails with instructions,
//! as crates/pool-nixl's tests do.

use kvferry_pool_nixl::NixlPoolDescriptor;
use kvferry_proto::v1::LookupRequest;
use tonic::Code;

mod common;

use common::nixl::{engine_pool, request};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_nixl_descriptors_get_typed_errors_and_the_daemon_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::config(dir.path(), "region-a");
    let daemon = common::start(&cfg).await;
    let mut client = common::engine_client(&cfg).await;

    let lens = common::region_lens();
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
