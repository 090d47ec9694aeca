//! An engine survives its daemon's restart (real processes: two `kvferry daemon`s and two
//! `kvferry engine`s on loopback). Region A's engine holds a conversation's prefix; A's daemon
//! is restarted, once with SIGKILL and once with a clean SIGTERM stop. Each time the engine
//! process must stay up, register again (a new lease), and publish its cache again: B's plan
//! sees A's blocks again, a fetch from A succeeds with verified bytes, and B's next turn on
//! the fetched prefix is bit-identical to a recompute.

mod common;

use common::*;
use kvferry_proto::v1::PolicyMode;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_engine_survives_its_daemon_restart_killed_or_stopped() {
    let mut cl = Cluster::start(Default::default());
    let (mut eng_a, mut eng_b) = (cl.engine(0).await, cl.engine(1).await);
    // Two conversations held in A before either restart (400 tokens + 4 generated: 25 full
    // blocks each), one fetched after each restart.
    let convos = [tokens(400, 21), tokens(400, 22)];
    let full = 25 * 16;
    for c in &convos {
        generate(&mut eng_a, c, true).await;
    }

    for (round, kill) in [(1usize, true), (2, false)] {
        let convo = convos[round - 1].clone();
        cl.restart_daemon(0, kill);
        let how = if kill { "SIGKILL" } else { "SIGTERM" };
        // The engine re-registers and publishes its cache again.
        cl.wait_log(0, "engine", "registered again with the daemon", round).await;
        cl.wait_log(0, "engine", "cached blocks published again", round).await;
        assert!(cl.alive("engine-a"), "engine A exited after its daemon's {how}:\n{}", cl.log(0, "engine"));

        // Its blocks are visible again: A's residency view and B's plan see the prefix.
        let mut router_a = cl.router(0).await;
        let mut router_b = cl.router(1).await;
        let session = format!("s-restart-{round}");
        let req = request(&session, &convo, PolicyMode::Fetch);
        wait_for_source(&mut router_b, &req).await;
        let res = residency(&mut router_a, TENANT, &convo, &[]).await;
        let here = res.holdings.iter().find(|h| h.region == "region-a").expect("region-a in the view");
        assert!(here.tokens >= full as u64, "after the {how}, A's view: {res:?}");

        // A migration from it succeeds, verified, and B's next turn is exact.
        let (d, r) = migrate(&mut router_b, req).await;
        assert_eq!(
            (d.action.as_str(), r.action.as_str()),
            ("fetch", "fetch"),
            "after the {how}: {d:?} {r:?}"
        );
        assert!(r.bytes_moved > 0 && r.fallback.is_empty(), "{r:?}");
        assert_eq!(r.tokens_ready, full as u64, "{r:?}");
        let mut next = convo.clone();
        next.extend(tokens(5, 90 + round as u64));
        let warm = generate(&mut eng_b, &next, true).await;
        let cold = generate(&mut eng_b, &next, false).await;
        assert!(warm.loaded_tokens >= full as u64, "only {} tokens were ready", warm.loaded_tokens);
        assert_eq!((warm.new_tokens, warm.logits_digest), (cold.new_tokens, cold.logits_digest));
        // The engine kept its own cache through the restart.
        // (Every full block but the one holding the prompt's last token, which is computed.)
        let again = generate(&mut eng_a, &convo, true).await;
        assert_eq!(again.loaded_tokens, (full - 16) as u64, "A lost its cache: {again:?}");
    }
    println!(
        "engine A survived a SIGKILL and a SIGTERM restart of its daemon; fetches from it verified after each"
    );
}
