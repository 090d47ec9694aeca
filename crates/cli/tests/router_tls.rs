//! Mutual TLS on the router API (`[router_tls]`), with a real `kvferry daemon` process and the
//! `kvferry links` / `kvferry migrate` clients: the right client certificate (from the dev CA)
//! works; no certificate, or one from another CA, is refused in the handshake with a clear
//! error; the bearer token is still required on top; plaintext gets nowhere.

mod common;

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::*;

fn kvferry(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("kvferry {args:?} did not finish in 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn router_api_requires_a_client_certificate_from_the_router_ca() {
    let root = tempfile::Builder::new().prefix("kvferry-rtls-").tempdir().unwrap();
    let dev = root.path().join("dev-ca");
    let run = root.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    let grpc = free_tcp();
    let mut cfg = kvferry_daemon::Config {
        region: "region-a".into(),
        trust_domain: "kvferry.e2e".into(),
        run_dir: run.clone(),
        ..kvferry_daemon::Config::default()
    };
    cfg.listen = kvferry_daemon::config::Listen { grpc, peer: free_udp(), http: free_tcp() };
    cfg.auth.bearer_token = "s3cret".into();
    cfg.tls.dev_dir = dev.clone();
    cfg.router_tls.mode = kvferry_daemon::config::RouterTlsMode::Dev;
    let path = root.path().join("kvferry.toml");
    std::fs::write(&path, cfg.to_toml()).unwrap();
    let mut procs = vec![(
        "daemon".to_owned(),
        spawn(&root.path().join("daemon.log"), &["daemon", "--config", path.to_str().unwrap()]),
    )];
    struct Reap(Vec<(String, std::process::Child)>);
    impl Drop for Reap {
        fn drop(&mut self) {
            for (_, c) in &mut self.0 {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
    wait_file(&run.join("engine.sock"), "daemon", &mut procs);
    let _reap = Reap(procs);
    let log = || std::fs::read_to_string(root.path().join("daemon.log")).unwrap_or_default();

    let addr = format!("https://{grpc}");
    let ca = dev.join("ca.pem");
    let (cert, key) = (dev.join("router-client.pem"), dev.join("router-client.key"));
    assert!(cert.exists() && key.exists(), "dev mode writes a router client identity: {}", log());
    // A router client identity from an unrelated CA.
    let other = root.path().join("other-ca");
    let (other_cert, other_key) =
        kvferry_daemon::router_tls::ensure_dev_router_client(&other, "kvferry.e2e").unwrap();
    let s = |p: &std::path::Path| p.to_str().unwrap().to_owned();
    let base = ["links", "--daemon", &addr, "--tls-ca", &s(&ca)];

    // The right certificate and the token: served.
    let mut ok_args = base.to_vec();
    let (c, k) = (s(&cert), s(&key));
    ok_args.extend(["--tls-cert", &c, "--tls-key", &k, "--bearer", "s3cret"]);
    let out = kvferry(&ok_args);
    assert!(out.status.success(), "{}\n{}", text(&out), log());
    assert!(text(&out).contains("links of region region-a"), "{}", text(&out));

    // No client certificate: refused in the handshake.
    let mut args = base.to_vec();
    args.extend(["--bearer", "s3cret"]);
    let out = kvferry(&args);
    assert!(!out.status.success(), "served without a client certificate: {}", text(&out));
    assert!(text(&out).contains("requires a router client certificate"), "{}", text(&out));

    // A certificate from another CA: refused.
    let mut args = base.to_vec();
    let (oc, ok) = (s(&other_cert), s(&other_key));
    args.extend(["--tls-cert", &oc, "--tls-key", &ok, "--bearer", "s3cret"]);
    let out = kvferry(&args);
    assert!(!out.status.success(), "served with a foreign client certificate: {}", text(&out));
    assert!(text(&out).contains("refused the client certificate"), "{}", text(&out));

    // The right certificate without the token: the token is still required.
    let mut args = base.to_vec();
    args.extend(["--tls-cert", &c, "--tls-key", &k]);
    let out = kvferry(&args);
    assert!(!out.status.success(), "served without the bearer token: {}", text(&out));
    assert!(text(&out).contains("bearer token"), "{}", text(&out));

    // Plaintext gRPC gets nowhere.
    let plain = format!("http://{grpc}");
    let out = kvferry(&["links", "--daemon", &plain, "--bearer", "s3cret"]);
    assert!(!out.status.success(), "served over plaintext: {}", text(&out));

    // A migrate call over mutual TLS reaches the service (and is refused there: no engine).
    let out = kvferry(&[
        "migrate",
        "--daemon",
        &addr,
        "--tls-ca",
        &s(&ca),
        "--tls-cert",
        &c,
        "--tls-key",
        &k,
        "--bearer",
        "s3cret",
        "--session",
        "s",
        "--tenant",
        "t",
        "--tokens",
        "1,2,3",
        "--plan-only",
    ]);
    assert!(!out.status.success());
    assert!(text(&out).contains("no engine"), "{}", text(&out));

    // The daemon logged why it refused.
    let l = log();
    assert!(l.contains("router TLS handshake refused"), "{l}");
}
