//! A migration's fetch striped over two QUIC connections between two real daemons in this
//! process (`[transfer] stripes = 2`, real mutual TLS on loopback, real shared-memory pools):
//! the fetch verifies, the receipt's path says it ran on two connections, and B's landing zone
//! holds every block byte-identical to A's pool.

use std::time::Duration;

use kvferry_proto::v1::{PolicyMode, PoolLayoutSpec};

mod common;

use common::abuse::*;

/// 64 blocks of 16 KiB (1 MiB) in 64 KiB chunks: two stripes of 32 blocks, eight chunks each.
const BLOCKS: u32 = 64;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_striped_migration_fetch_verifies_on_two_connections() {
    let dir = tempfile::tempdir().unwrap();
    let spec = PoolLayoutSpec { num_blocks: BLOCKS, ..common::spec() };
    let (pa, pb) = (common::free_udp(), common::free_udp());
    let mut cfg_a = common::config(dir.path(), "region-a");
    (cfg_a.listen.peer, cfg_a.peers) = (pa, vec![common::peer("region-b", pb, 0.0)]);
    let mut cfg_b = common::config(dir.path(), "region-b");
    (cfg_b.listen.peer, cfg_b.peers) = (pb, vec![common::peer("region-a", pa, 0.0)]);
    for c in [&mut cfg_a, &mut cfg_b] {
        c.transfer.chunk_bytes = 65_536;
        c.transfer.stripes = 2;
    }
    let _a = common::start(&cfg_a).await;
    let b = common::start(&cfg_b).await;
    let (pool_a, _sa, lease_a) = register_shm(&cfg_a, "ea", spec.clone()).await;
    let (_ea, _ta) = answering_engine(&cfg_a, &lease_a).await;
    let (_pool_b, _sb, lease_b) = register_shm(&cfg_b, "eb", spec).await;
    let (_eb, _tb) = answering_engine(&cfg_b, &lease_b).await;

    // A's pool: distinct bytes in every block, published as one session's chain.
    let layers = pool_a.layout().num_layers();
    let ids: Vec<u32> = (0..BLOCKS).collect();
    let len = pool_a.layout().staging_len(u64::from(BLOCKS), 0..layers).unwrap() as usize;
    let mut x = 0x5712_1BE5u64;
    let data: Vec<u8> = (0..len / 8)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect();
    pool_a.write_blocks(&ids, 0..layers, &data).unwrap();
    let prompt = kvferry_engine_node::prompt(BLOCKS as usize * 16 + 5, 512, 77);
    let hashes = kvferry_daemon::engine_api::hashes_for(TENANT, &prompt, 16);
    assert_eq!(hashes.len(), BLOCKS as usize);
    let mut engine_a = common::engine_client(&cfg_a).await;
    common::publish_chain(&mut engine_a, &lease_a, TENANT, &hashes, ids.clone()).await;
    let bytes: Vec<Vec<u8>> = ids.iter().map(|&id| common::block_bytes(&pool_a, id)).collect();
    let session = common::HeldSession { tenant: TENANT, prompt: prompt.clone(), hashes, bytes, extra: () };

    let mut r = router(b.grpc_addr).await;
    let mut req = request("striped", prompt, PolicyMode::Fetch);
    req.source_region = "region-a".into();
    // A's engine reports its blocks asynchronously: retry until the fetch is planned.
    let mut last = None;
    for _ in 0..50 {
        match receipt(&mut r, req.clone()).await {
            Ok(rc) if rc.action == "fetch" && rc.fallback.is_empty() => {
                last = Some(rc);
                break;
            }
            other => last = other.ok(),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rc = last.expect("a receipt");
    assert_eq!((rc.action.as_str(), rc.fallback.as_str()), ("fetch", ""), "{rc:?}");
    assert!(rc.path.contains("2 connections"), "{rc:?}");
    assert_eq!(rc.bytes_moved, len as u64, "{rc:?}");
    let (present, wrong, _) = common::landed(&b, &session);
    assert_eq!((present, wrong), (BLOCKS as usize, 0), "landed blocks");
}
