//! The owner NODE goes down in the middle of a fetch, and comes back (real processes: two
//! `kvferry daemon`s and two `kvferry engine`s). `source_killed.rs` covers the owner's daemon
//! SIGKILLed; here, one round each: the owner's daemon stopped with SIGTERM (a graceful stop),
//! the owner's engine stopped with SIGTERM, and the owner's engine SIGKILLed. Region A caps
//! its egress to B so each fetch takes seconds; the stop comes once progress events show
//! verified bytes landing in B.
//!
//! Each round, B's migration must end before its deadline plus [`GRACE`] with a receipt — the
//! fetch finished (what a stopped engine's pool still held, re-validated block by block), or
//! fell back to a recompute (the policy allows it) — or with a retryable typed error; B's
//! landing zone must hold the whole prefix or nothing of it (no reservation left), and B's
//! next turn must be bit-identical to a full recompute. Then the owner comes back (the same
//! config and flags): the daemon is started again (its engine, which stayed up, registers
//! again), or the engine is started again (empty cache; it computes a new conversation), and a
//! fetch from A succeeds again with verified bytes.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvferry_proto::v1::{PolicyMode, migration_event};

/// How late past its deadline a migration may end (a loaded CI machine).
const GRACE: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Copy, PartialEq)]
enum Down {
    DaemonTerm,
    EngineTerm,
    EngineKill,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_owner_stopped_mid_fetch_ends_the_migration_in_time_and_comes_back() {
    let a = RegionSpec { configure: Some(|c| c.peers[0].max_egress_gbps = 0.002), ..Default::default() };
    let b = RegionSpec {
        configure: Some(|c| (c.transfer.chunk_bytes, c.transfer.idle_timeout_ms) = (65_536, 1_000)),
        ..Default::default()
    };
    let mut cl = Cluster::start([a, b]);
    let mut eng_b = cl.engine(1).await;
    let mut daemon_restarts = 0;
    let mut outcomes = Vec::new();
    for (round, down) in [Down::DaemonTerm, Down::EngineTerm, Down::EngineKill].into_iter().enumerate() {
        let mut eng_a = cl.engine(0).await;
        let mut router_b = cl.router(1).await;
        // 800 tokens = 50 full blocks, 800 KiB of KV; at A's 250 kB/s egress cap, about 3 s.
        let convo = tokens(800, 60 + round as u64);
        let full = 50 * 16;
        generate(&mut eng_a, &convo, true).await;
        let mut req = request(&format!("s-down-{round}"), &convo, PolicyMode::Fetch);
        wait_for_source(&mut router_b, &req).await;
        let deadline = Duration::from_secs(20);
        req.deadline_ms = deadline.as_millis() as u64;
        let used_before = metric(&cl.metrics(1).await, "kvferry_landing_zone_bytes{state=\"used\"}");

        let t0 = Instant::now();
        let mut stream = router_b.migrate_session(req).await.unwrap().into_inner();
        let (mut receipt, mut error, mut stopper) = (None, None, None);
        loop {
            let ev = match tokio::time::timeout(deadline + GRACE, stream.message()).await {
                Err(_) => panic!("{down:?}: the migration stream stalled past its deadline + grace"),
                Ok(Err(status)) => {
                    error = Some(status);
                    break;
                }
                Ok(Ok(None)) => break,
                Ok(Ok(Some(ev))) => ev,
            };
            match ev.event {
                Some(migration_event::Event::Progress(p)) if stopper.is_none() && p.bytes_done > 0 => {
                    assert!(
                        p.bytes_done < p.bytes_total,
                        "{down:?}: the fetch finished before the stop: {p:?}"
                    );
                    // Signal now; wait for the exit off this task so the stream is read on.
                    let (pid, sig) = match down {
                        Down::DaemonTerm => (cl.pid("daemon region-a"), "-TERM"),
                        Down::EngineTerm => (cl.pid("engine-a"), "-TERM"),
                        Down::EngineKill => (cl.pid("engine-a"), "-KILL"),
                    };
                    let s =
                        std::process::Command::new("kill").args([sig, &pid.to_string()]).status().unwrap();
                    assert!(s.success(), "kill {sig} {pid}");
                    stopper = Some((Instant::now(), p.bytes_done, p.bytes_total));
                }
                Some(migration_event::Event::Receipt(r)) => receipt = Some(r),
                _ => {}
            }
        }
        let answered = Instant::now();
        let (stopped_at, done, total) =
            stopper.expect("no progress event showed bytes moving before the answer");
        assert!(answered - t0 < deadline + GRACE, "{down:?}: answered {:?} after the request", answered - t0);
        let outcome = match (&receipt, &error) {
            (Some(r), _) if r.action == "fetch" && r.fallback.is_empty() => {
                assert_eq!((r.tokens_ready, r.bytes_moved), (full, total), "{down:?}: {r:?}");
                "fetch finished"
            }
            (Some(r), _) => {
                assert_eq!(r.action, "recompute", "{down:?}: {r:?}");
                assert!(r.fallback.contains("fetch failed") && r.bytes_moved == 0, "{down:?}: {r:?}");
                assert!(r.tokens_ready >= full, "{down:?}: {r:?}");
                "fell back to recompute"
            }
            (None, Some(e)) => {
                let retryable = e.metadata().get("kvferry-retryable").is_some_and(|v| v == "true");
                assert!(retryable && e.metadata().get("kvferry-origin").is_some(), "{down:?}: {e:?}");
                "retryable error"
            }
            (None, None) => panic!("{down:?}: the stream ended without a receipt"),
        };
        // The landing zone holds the whole prefix (fetched) or nothing new; nothing reserved.
        let m = cl.metrics(1).await;
        let used = metric(&m, "kvferry_landing_zone_bytes{state=\"used\"}") - used_before;
        let want = if outcome == "fetch finished" { total as f64 } else { 0.0 };
        assert_eq!(used, want, "{down:?}: {outcome}, landing zone grew by {used}:\n{m}");
        assert_eq!(metric(&m, "kvferry_landing_zone_bytes{state=\"reserved\"}"), 0.0, "{m}");
        // B's next turn on the prefix is exact.
        let mut next = convo.clone();
        next.extend(tokens(7, 99 + round as u64));
        let warm = generate(&mut eng_b, &next, true).await;
        let cold = generate(&mut eng_b, &next, false).await;
        assert!(warm.loaded_tokens >= full, "{down:?}: only {} tokens were ready", warm.loaded_tokens);
        assert_eq!((warm.new_tokens, warm.logits_digest), (cold.new_tokens, cold.logits_digest), "{down:?}");
        println!(
            "{down:?}: stopped {:.2} s into the fetch at {done} of {total} bytes; {outcome} {:.2} s after the stop",
            (stopped_at - t0).as_secs_f64(),
            (answered - stopped_at).as_secs_f64()
        );
        outcomes.push(format!("{down:?}: {outcome}"));

        // --- the owner comes back ---
        match down {
            Down::DaemonTerm => {
                cl.stop("daemon region-a", false); // already exiting: waits for its clean exit
                cl.start_daemon(0);
                daemon_restarts += 1;
                cl.wait_log(0, "engine", "registered again with the daemon", daemon_restarts).await;
            }
            Down::EngineTerm | Down::EngineKill => {
                cl.stop("engine-a", true); // already exiting or dead: reaps it
                cl.start_engine(0);
            }
        }
        let mut eng_a = cl.engine(0).await;
        let again = tokens(400, 80 + round as u64);
        generate(&mut eng_a, &again, true).await;
        let mut router_b = cl.router(1).await;
        let req = request(&format!("s-back-{round}"), &again, PolicyMode::Fetch);
        wait_for_source(&mut router_b, &req).await;
        let (d, r) = migrate(&mut router_b, req).await;
        assert_eq!((d.action.as_str(), r.action.as_str()), ("fetch", "fetch"), "after {down:?}: {d:?} {r:?}");
        assert!(r.bytes_moved > 0 && r.fallback.is_empty() && r.tokens_ready == 25 * 16, "{r:?}");
        let mut next = again.clone();
        next.extend(tokens(5, 120 + round as u64));
        let warm = generate(&mut eng_b, &next, true).await;
        let cold = generate(&mut eng_b, &next, false).await;
        assert_eq!((warm.new_tokens, warm.logits_digest), (cold.new_tokens, cold.logits_digest));
    }
    println!("owner down mid-fetch, then back: {outcomes:?}; a fetch from it verified after each");
}
