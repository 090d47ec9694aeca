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

use std::path::Path;

use kvferry_daemon::{Config, Daemon};
use kvferry_proto::v1::engine_client::EngineClient;
use kvferry_proto::v1::{EngineEvent, LookupRequest};
use tonic::Code;
use tonic::transport::Channel;

mod common;

use common::nixl::{engine_pool, request};

async fn start(dir: &Path) -> (Daemon, Config) {
    let mut cfg = common::config(dir, "region-a");
    cfg.limits.attach_grace_ms = 3_000;
    (common::start(&cfg).await, cfg)
}

const POOLS: usize = 4;

/// An engine as its own process (`kvferry-nixl-engine`, as a real engine is its own process)
/// exporting memfd regions that this test maps too, to check bytes from the engine's side.
struct EngineProc {
    child: std::process::Child,
    maps: Vec<kvferry_pool_shm::Mapping>,
    json: Vec<u8>,
}

impl Drop for EngineProc {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

fn nixl_engine_bin() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let p = exe.parent().unwrap().parent().unwrap().join("kvferry-nixl-engine");
    assert!(p.is_file(), "{} missing: build the workspace (cargo test --workspace)", p.display());
    p
}

fn engine_proc(lens: &[u64], tag: &str) -> EngineProc {
    use std::io::BufRead;
    use std::os::fd::AsRawFd;
    let mut cmd = std::process::Command::new(nixl_engine_bin());
    cmd.arg("--name").arg(format!("kvferry-stress-{}-{tag}", std::process::id()));
    let mut maps = Vec::new();
    for (i, &len) in lens.iter().enumerate() {
        let fd = kvferry_pool_shm::create_memfd("kvferry-stress", len).unwrap();
        let m = kvferry_pool_shm::Mapping::map(fd, len).unwrap();
        m.write_at(0, &vec![i as u8 + 1; len as usize]).unwrap();
        cmd.arg("--region").arg(format!("/proc/{}/fd/{}:{len}", std::process::id(), m.fd().as_raw_fd()));
        maps.push(m);
    }
    cmd.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let out = child.stdout.take().unwrap();
    let mut json = Vec::new();
    for line in std::io::BufReader::new(out).lines() {
        let line = line.unwrap();
        if let Some(j) = line.strip_prefix(kvferry_pool_nixl::DESCRIPTOR_LINE_PREFIX) {
            json = j.as_bytes().to_vec();
            break;
        }
    }
    assert!(!json.is_empty(), "engine printed no descriptor");
    EngineProc { child, maps, json }
}

async fn stress_round(daemon: &Daemon, client: &EngineClient<Channel>, round: usize) {
    let lens = common::region_lens();
    let engines: Vec<EngineProc> =
        (0..POOLS).map(|i| engine_proc(&lens, &format!("r{round}-p{i}"))).collect();
    // Register every pool at the same time.
    let mut regs = Vec::new();
    for (i, e) in engines.iter().enumerate() {
        let json = e.json.clone();
        let mut c = client.clone();
        regs.push(tokio::spawn(async move {
            c.register_pool(request(&format!("engine-{round}-{i}"), json))
                .await
                .map(|r| r.into_inner().lease_id)
        }));
    }
    let mut leases = Vec::new();
    let mut attached = Vec::new();
    for r in regs {
        let lease = r.await.unwrap().expect("concurrent registration");
        attached.push(hold_lease(client, &lease).await);
        leases.push(lease);
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
        let mut at = 0;
        for e in &extents {
            // What was read is what the engine held before (its initial fill) ...
            assert!(
                read[at..at + e.len as usize].iter().all(|&b| b == e.region as u8 + 1),
                "pool {i}: read wrong bytes"
            );
            // ... and what was written is what it holds now.
            let mut now = vec![0u8; e.len as usize];
            engines[i].maps[e.region as usize].read_at(e.offset, &mut now).unwrap();
            assert!(now.iter().all(|&b| b == fill), "pool {i}: write did not land");
            at += e.len as usize;
        }
    }
    // Engines detach (their Attach streams end): the daemon releases the pools, and with them
    // their helper processes, before the engines exit.
    drop(attached);
    for lease in &leases {
        let t = std::time::Instant::now();
        while daemon.shared.registry.by_lease(lease).is_some() {
            assert!(t.elapsed() < std::time::Duration::from_secs(5), "lease {lease} not released on detach");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }
    drop(engines);
}

/// Opens the lease's Attach stream as an engine does; dropping the sender ends it.
async fn hold_lease(client: &EngineClient<Channel>, lease: &str) -> tokio::sync::mpsc::Sender<EngineEvent> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(EngineEvent { lease_id: lease.into(), event: None }).await.unwrap();
    let mut c = client.clone();
    let stream =
        c.attach(tokio_stream::wrappers::ReceiverStream::new(rx)).await.expect("attach").into_inner();
    // Keep the daemon's command stream alive in the background.
    tokio::spawn(async move {
        let mut stream = stream;
        while let Ok(Some(_)) = stream.message().await {}
    });
    tx
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_helpers_under_concurrency_and_failure() {
    let dir = tempfile::tempdir().unwrap();
    let (daemon, cfg) = start(dir.path()).await;
    let client = common::engine_client(&cfg).await;

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

    let lens = common::region_lens();
    let pool = engine_pool(&lens);
    let json = pool.export.as_ref().unwrap().descriptor().unwrap().to_json().into_bytes();
    let mut c = client.clone();

    // No helper program: refused, naming why.
    // SAFETY: set_var is unsound only with concurrent environment access from other threads;
    // this test binary has this one test, and the daemon reads the variable only inside the
    // registration calls this test awaits one at a time.
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
    // Never attached, its lease expires after the grace period (and its helper with it).
    let e =
        c.lookup(LookupRequest { lease_id: "no-such-lease".into(), ..Default::default() }).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    // SAFETY: as above.
    unsafe { std::env::remove_var(kvferry_daemon::engine_api::NIXL_HELPER_ENV) };
    let lease = c.register_pool(request("engine-after", json)).await.unwrap().into_inner();
    assert_eq!(lease.lease_ttl_ms, 3_000);
    assert!(daemon.shared.registry.by_lease(&lease.lease_id).is_some());
    tokio::time::sleep(std::time::Duration::from_millis(3_500)).await;
    assert!(
        daemon.shared.registry.by_lease(&lease.lease_id).is_none(),
        "an unattached lease outlived its grace"
    );
    let e = c.lookup(LookupRequest { lease_id: lease.lease_id, ..Default::default() }).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    drop(pool);
    drop(daemon);
}
