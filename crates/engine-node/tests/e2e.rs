//! End-to-end tests of the engine process against `fixture::FakeDaemon` (a test fixture
//! standing in for the daemon's Engine API): two engine nodes exchange KV blocks and the
//! loaded prefix gives the same tokens and bit-identical logits as a full local recompute;
//! the own prefix cache, Recompute commands, eviction, error statuses, a failing Load, a
//! refused pool, and the daemon going away.

mod fixture;

use std::path::Path;

use fixture::{Call, FakeDaemon};
use kvferry_engine::{Engine, KvLayout, ModelConfig, ProfileOptions};
use kvferry_engine_node::daemon::connect_uds;
use kvferry_engine_node::memory::pool_layout;
use kvferry_engine_node::{EngineNode, NodeConfig, NodeError, ReconnectPolicy};
use kvferry_proto::v1::reference_engine_client::ReferenceEngineClient;
use kvferry_proto::v1::{DaemonCommand, GenerateRequest, GenerateResponse, Recompute, daemon_command};
use sha2::{Digest, Sha256};
use tonic::Code;
use tonic::transport::Channel;

const SEED: u64 = 11;

fn model() -> ModelConfig {
    ModelConfig::tiny(SEED)
}

async fn daemon() -> FakeDaemon {
    FakeDaemon::start(pool_layout(&KvLayout::for_model(&model(), 256).unwrap()).unwrap()).await
}

fn config(d: &FakeDaemon, id: &str, num_blocks: u32) -> NodeConfig {
    let dir = d.run_dir();
    let mut cfg = NodeConfig::new(&dir, id, dir.join(format!("{id}.ctl")));
    cfg.model = model();
    cfg.num_blocks = num_blocks;
    cfg.profile =
        ProfileOptions { contexts: vec![0, 32], chunk: 16, repeats: 1, ..ProfileOptions::default() };
    cfg.load_report_interval = std::time::Duration::from_millis(50);
    cfg
}

/// Starts engine `id` with a `num_blocks`-block pool against `d`.
async fn start(d: &FakeDaemon, id: &str, num_blocks: u32) -> EngineNode {
    EngineNode::start(config(d, id, num_blocks)).await.unwrap()
}

/// Shuts `nodes` down, then waits until each has stopped cleanly.
async fn stop<const N: usize>(nodes: [&mut EngineNode; N]) {
    for n in nodes.iter() {
        n.shutdown();
    }
    for n in nodes {
        n.wait().await.unwrap();
    }
}

async fn client(path: &Path) -> ReferenceEngineClient<Channel> {
    ReferenceEngineClient::new(connect_uds(path).await.expect("connect control socket"))
}

async fn generate(
    c: &mut ReferenceEngineClient<Channel>,
    tenant: &str,
    tokens: &[u32],
    max_new: u32,
    use_cache: bool,
) -> Result<GenerateResponse, tonic::Status> {
    let req = GenerateRequest {
        tenant: tenant.into(),
        token_ids: tokens.to_vec(),
        max_new_tokens: max_new,
        use_cache,
    };
    c.generate(req).await.map(|r| r.into_inner())
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    kvferry_engine_node::prompt(n, 256, u64::from(salt))
}

fn stored_blocks(calls: &[Call], lease: &str) -> usize {
    calls.iter().map(|c| matches!(c, Call::Stored { lease: l, .. } if l == lease) as usize).sum()
}

/// The daemon's `Recompute` command for `session`.
fn recompute_cmd(session: &str, tokens: Vec<u32>) -> DaemonCommand {
    DaemonCommand {
        command: Some(daemon_command::Command::Recompute(Recompute {
            session_id: session.into(),
            tenant: "t".into(),
            token_ids: tokens,
        })),
    }
}

/// Waits (up to `secs`) for `n` `RecomputeDone` answers and returns them in arrival order.
async fn recompute_dones(d: &FakeDaemon, n: usize, secs: u64) -> Vec<kvferry_proto::v1::RecomputeDone> {
    d.wait_for(secs, "RecomputeDone answers", |c| {
        c.iter().filter(|c| matches!(c, Call::RecomputeDone { .. })).count() == n
    })
    .await;
    d.calls()
        .into_iter()
        .filter_map(|c| if let Call::RecomputeDone { done, .. } = c { Some(done) } else { None })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_engines_exchange_blocks_and_match_a_full_recompute() {
    let d = daemon().await;
    let mut a = start(&d, "a", 64).await;
    let mut b = start(&d, "b", 64).await;
    let (la, lb) = (a.info().lease_id.clone(), b.info().lease_id.clone());
    assert_ne!(la, lb);
    assert_eq!(a.info().model_id, b.info().model_id, "same config and seed → same model id");
    // The fixture answers RegisterPool as the daemon does: the engine's own digest.
    assert_eq!(a.info().layout_fingerprint, a.info().local_fingerprint);
    let calls = d.calls();
    assert!(calls.iter().any(
        |c| matches!(c, Call::Register { kind, samples, .. } if kind == "vllm_flash_attn_nhd" && *samples > 0)
    ));
    d.wait_for(5, "a load report with a profile", |c| {
        c.iter().any(|c| matches!(c, Call::LoadReport { lease, has_profile: true, .. } if *lease == la))
    })
    .await;

    let p = prompt(70, 1);
    let mut ca = client(&a.info().control).await;
    let ra = generate(&mut ca, "t1", &p, 5, true).await.unwrap();
    assert_eq!((ra.loaded_tokens, ra.computed_tokens, ra.new_tokens.len()), (0, 70, 5));
    // A published the 4 full blocks of prompt + generated tokens (75 tokens).
    d.wait_for(5, "A's BlockStored", |c| {
        c.iter()
            .any(|c| matches!(c, Call::Stored { lease, tenant, blocks: 4 } if *lease == la && tenant == "t1"))
    })
    .await;
    assert_eq!(d.absorb(&la), 4);

    // B loads A's prefix through the daemon: 4 blocks (the 5th would hold the last token).
    let mut cb = client(&b.info().control).await;
    let rb = generate(&mut cb, "t1", &p, 5, true).await.unwrap();
    assert_eq!((rb.loaded_tokens, rb.computed_tokens), (64, 6));
    assert!(d.calls().iter().any(
        |c| matches!(c, Call::Load { lease, block_ids, loaded: 4 } if *lease == lb && block_ids.len() == 4)
    ));
    // B from scratch (fresh blocks, no cache): same tokens, bit-identical logits.
    let rb_full = generate(&mut cb, "t1", &p, 5, false).await.unwrap();
    assert_eq!((rb_full.loaded_tokens, rb_full.computed_tokens), (0, 70));
    assert_eq!(rb.new_tokens, rb_full.new_tokens);
    assert_eq!(rb.logits_digest, rb_full.logits_digest);
    assert_eq!(ra.new_tokens, rb.new_tokens);
    assert_eq!(ra.logits_digest, rb.logits_digest);
    // And the same as the core on heap memory.
    let mut heap = Engine::with_heap_pool(model(), 16).unwrap();
    let mut s = heap.start(&p).unwrap();
    let logits = heap.prefill(&mut s).unwrap();
    let mut h = Sha256::new();
    logits.iter().for_each(|x| h.update(x.to_le_bytes()));
    assert_eq!(rb.logits_digest, h.finalize().to_vec());

    // B's own prefix cache: a longer prompt sharing the prefix reuses B's blocks, no Load.
    let loads_before = d.calls().iter().filter(|c| matches!(c, Call::Load { .. })).count();
    let mut p2 = p.clone();
    p2.extend(prompt(20, 7));
    let r2 = generate(&mut cb, "t1", &p2, 2, true).await.unwrap();
    assert_eq!(r2.loaded_tokens, 64);
    assert_eq!(d.calls().iter().filter(|c| matches!(c, Call::Load { .. })).count(), loads_before);
    let r2_full = generate(&mut cb, "t1", &p2, 2, false).await.unwrap();
    assert_eq!((r2.new_tokens, r2.logits_digest), (r2_full.new_tokens, r2_full.logits_digest));
    // Another tenant shares nothing (salted hashes).
    let r3 = generate(&mut cb, "t2", &p, 1, true).await.unwrap();
    assert_eq!(r3.loaded_tokens, 0);

    stop([&mut a, &mut b]).await;
    assert!(!a.info().control.exists(), "control socket removed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_load_falls_back_to_recompute() {
    let d = daemon().await;
    let mut a = start(&d, "a", 32).await;
    let mut c = start(&d, "c", 32).await;
    let p = prompt(40, 3);
    let ra = generate(&mut client(&a.info().control).await, "t", &p, 2, true).await.unwrap();
    let la = a.info().lease_id.clone();
    d.wait_for(5, "A's blocks", |calls| stored_blocks(calls, &la) > 0).await;
    assert_eq!(d.absorb(&la), 2);
    d.fail_loads(true);
    let rc = generate(&mut client(&c.info().control).await, "t", &p, 2, true).await.unwrap();
    assert_eq!((rc.loaded_tokens, rc.computed_tokens), (0, 40));
    assert_eq!((rc.new_tokens, rc.logits_digest), (ra.new_tokens, ra.logits_digest));
    let lc = c.info().lease_id.clone();
    assert!(d.calls().iter().any(|x| matches!(x, Call::Load { lease, loaded: 0, .. } if *lease == lc)));
    stop([&mut a, &mut c]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recompute_command_warms_the_cache_and_reports() {
    let d = daemon().await;
    let mut a = start(&d, "a", 32).await;
    let la = a.info().lease_id.clone();
    let p = prompt(40, 5);
    d.send(&la, recompute_cmd("s1", p.clone())).await;
    d.send(&la, recompute_cmd("bad", vec![1, 2, 9999])).await;
    let done = recompute_dones(&d, 2, 10).await;
    assert_eq!((done[0].session_id.as_str(), done[0].tokens, done[0].error.as_str()), ("s1", 32, ""));
    assert!(done[0].seconds > 0.0);
    assert_eq!(done[1].session_id, "bad");
    assert!(done[1].error.contains("outside the vocabulary"), "{}", done[1].error);
    assert!(d.calls().iter().any(|c| matches!(c, Call::Stored { blocks: 2, tenant, .. } if tenant == "t")));
    // The next turn is warm: 32 of 40 tokens come from the engine's own cache.
    let mut ca = client(&a.info().control).await;
    let r = generate(&mut ca, "t", &p, 1, true).await.unwrap();
    assert_eq!((r.loaded_tokens, r.computed_tokens), (32, 8));
    stop([&mut a]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_is_reported_and_errors_are_typed_statuses() {
    let d = daemon().await;
    // 8 blocks = 128 tokens: each 50-token request needs 4 blocks.
    let mut a = start(&d, "a", 8).await;
    let la = a.info().lease_id.clone();
    let mut ca = client(&a.info().control).await;
    let first = generate(&mut ca, "t", &prompt(50, 0), 2, true).await.unwrap();
    for salt in 1..4 {
        generate(&mut ca, "t", &prompt(50, salt), 2, true).await.unwrap();
    }
    d.wait_for(5, "BlockRemoved", |c| {
        c.iter().any(|c| matches!(c, Call::Removed { lease, .. } if *lease == la))
    })
    .await;
    let again = generate(&mut ca, "t", &prompt(50, 0), 2, true).await.unwrap();
    assert_eq!((again.new_tokens, again.logits_digest), (first.new_tokens, first.logits_digest));

    let code = |r: Result<GenerateResponse, tonic::Status>| r.unwrap_err().code();
    assert_eq!(code(generate(&mut ca, "t", &[], 1, true).await), Code::InvalidArgument);
    assert_eq!(code(generate(&mut ca, "t", &[1, 256], 1, true).await), Code::InvalidArgument);
    assert_eq!(code(generate(&mut ca, "t", &[1, 2], 1 << 20, true).await), Code::InvalidArgument);
    assert_eq!(code(generate(&mut ca, "t", &prompt(50, 9), 200, true).await), Code::ResourceExhausted);
    // Nothing leaked: the whole pool is usable again.
    generate(&mut ca, "t", &prompt(100, 9), 20, false).await.unwrap();
    stop([&mut a]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_pool_and_daemon_going_away() {
    let d = daemon().await;
    d.refuse_pools(true);
    let err = EngineNode::start(config(&d, "x", 8)).await.unwrap_err();
    assert!(matches!(&err, NodeError::Register { detail, .. } if detail.contains("refused")), "{err}");
    d.refuse_pools(false);

    // An engine told never to reconnect stops when its daemon goes away.
    let mut cfg = config(&d, "a", 8);
    cfg.reconnect = ReconnectPolicy::NEVER;
    let mut a = EngineNode::start(cfg).await.unwrap();
    d.close_attach(&a.info().lease_id.clone());
    let r = tokio::time::timeout(std::time::Duration::from_secs(10), a.wait()).await.expect("node stops");
    assert!(matches!(r, Err(NodeError::DaemonGone(_))), "{r:?}");
    assert!(!a.info().control.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_whose_daemon_went_away_registers_again_and_republishes_its_cache() {
    let d = daemon().await;
    let mut a = start(&d, "a", 64).await;
    let la = a.info().lease_id.clone();
    let mut ca = client(&a.info().control).await;
    let p = prompt(70, 4);
    let first = generate(&mut ca, "t1", &p, 5, true).await.unwrap();
    generate(&mut ca, "t2", &prompt(40, 5), 1, true).await.unwrap();
    d.wait_for(5, "A's BlockStored for both tenants", |c| {
        c.iter()
            .any(|c| matches!(c, Call::Stored { lease, tenant, blocks: 4 } if *lease == la && tenant == "t1"))
            && c.iter()
                .any(|c| matches!(c, Call::Stored { lease, tenant, .. } if *lease == la && tenant == "t2"))
    })
    .await;
    let pools_before = d.calls().iter().filter(|c| matches!(c, Call::PoolShared { .. })).count();

    // The daemon ends the lease's stream, as a restarting daemon does.
    d.close_attach(&la);
    d.wait_for(10, "a second registration of engine a and its cache published on the new lease", |c| {
        let new: Vec<&String> = c
            .iter()
            .filter_map(|c| match c {
                Call::Register { engine_id, lease, .. } if engine_id == "a" && *lease != la => Some(lease),
                _ => None,
            })
            .collect();
        new.iter().any(|nl| {
            c.iter().any(|c| matches!(c, Call::Attach { lease } if lease == *nl))
                && c.iter().any(|c| matches!(c, Call::Stored { lease, tenant, blocks: 4 } if lease == *nl && tenant == "t1"))
                && c.iter().any(|c| matches!(c, Call::Stored { lease, tenant, blocks: 2 } if lease == *nl && tenant == "t2"))
        })
    })
    .await;
    let lb = a.lease_id();
    assert_ne!(lb, la);
    assert_eq!(a.reconnects(), 1);
    // The pool was offered again over pool.sock (a new token for the new lease).
    assert_eq!(d.calls().iter().filter(|c| matches!(c, Call::PoolShared { .. })).count(), pools_before + 1);
    // The engine kept its cache and serves on: same answer, the prompt's blocks reused.
    let again = generate(&mut ca, "t1", &p, 5, true).await.unwrap();
    assert_eq!((again.new_tokens, again.logits_digest), (first.new_tokens, first.logits_digest));
    assert_eq!(again.computed_tokens, 70 - 64);
    // What it publishes from now on goes to the new lease; the daemon can absorb the cache.
    assert_eq!(d.absorb(&lb), 6);
    stop([&mut a]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filled_blocks_travel_byte_identical_and_digests_agree() {
    use kvferry_proto::v1::PrefixRequest;
    let d = daemon().await;
    let mut a = start(&d, "a", 64).await;
    let mut b = start(&d, "b", 64).await;
    let la = a.info().lease_id.clone();
    let (mut ca, mut cb) = (client(&a.info().control).await, client(&b.info().control).await);
    let req = |tokens: &[u32]| PrefixRequest { tenant: "t1".into(), token_ids: tokens.to_vec() };
    let p = prompt(100, 3); // 6 full blocks + 4 tokens
    let filled = ca.fill(req(&p)).await.unwrap().into_inner();
    assert_eq!((filled.tokens, filled.loaded_tokens), (96, 0));
    let payload = KvLayout::for_model(&model(), 64).unwrap().payload_bytes() as u64;
    assert_eq!(filled.bytes, 6 * payload);
    d.wait_for(5, "A's BlockStored", |c| {
        c.iter().any(|c| matches!(c, Call::Stored { lease, blocks: 6, .. } if *lease == la))
    })
    .await;
    assert_eq!(d.absorb(&la), 6);
    // A's own digest of what it holds equals what Fill reported.
    let again = ca.prefix_digest(req(&p)).await.unwrap().into_inner();
    assert_eq!((again.tokens, again.digest.clone(), again.loaded_tokens), (96, filled.digest.clone(), 0));
    // B takes the blocks through the daemon's Load: same bytes.
    let got = cb.prefix_digest(req(&p)).await.unwrap().into_inner();
    assert_eq!((got.tokens, got.loaded_tokens, got.bytes), (96, 96, 6 * payload));
    assert_eq!(got.digest, filled.digest);
    // Another tenant's fill of the same tokens is other bytes (hash-seeded).
    let other = ca.fill(PrefixRequest { tenant: "t2".into(), token_ids: p.clone() }).await.unwrap();
    assert_ne!(other.into_inner().digest, filled.digest);
    // Bad input: typed statuses, the engine keeps serving.
    let short = ca.fill(req(&p[..10])).await.unwrap_err();
    assert_eq!(short.code(), Code::InvalidArgument, "{short}");
    let oov = ca.fill(req(&[5000; 32])).await.unwrap_err();
    assert_eq!(oov.code(), Code::InvalidArgument, "{oov}");
    assert_eq!(ca.prefix_digest(req(&p)).await.unwrap().into_inner().digest, filled.digest);
    stop([&mut a, &mut b]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_recompute_still_queued_never_runs_and_says_so() {
    let d = daemon().await;
    let mut a = start(&d, "a", 256).await;
    let la = a.info().lease_id.clone();
    let cancel = |session: &str| DaemonCommand {
        command: Some(daemon_command::Command::Cancel(kvferry_proto::v1::CancelRecompute {
            session_id: session.into(),
        })),
    };
    // A long recompute keeps the worker busy while the second one waits behind it, and the
    // second is cancelled before it starts (the three commands arrive back to back).
    d.send(&la, recompute_cmd("long", prompt(3000, 7))).await;
    d.send(&la, recompute_cmd("queued", prompt(64, 8))).await;
    d.send(&la, cancel("queued")).await;
    d.send(&la, cancel("unknown")).await;
    let done = recompute_dones(&d, 2, 60).await;
    assert_eq!((done[0].session_id.as_str(), done[0].cancelled, done[0].tokens), ("long", false, 2992));
    assert_eq!((done[1].session_id.as_str(), done[1].cancelled, done[1].tokens), ("queued", true, 0));
    assert_eq!(done[1].error, "");
    // Nothing answers the cancel of a recompute the engine never had.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(d.calls().iter().filter(|c| matches!(c, Call::RecomputeDone { .. })).count(), 2);
    stop([&mut a]).await;
}
