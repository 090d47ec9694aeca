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

/// Kills and reaps the daemon process when the test ends, however it ends.
struct Reap(Vec<(String, std::process::Child)>);
impl Drop for Reap {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A `kvferry daemon` process for region-a under `root` (run dir `root/run`), its config
/// adjusted by `configure`: its router address, the guard that reaps it, and its log.
fn start_daemon(
    root: &std::path::Path,
    configure: impl FnOnce(&mut kvferry_daemon::Config),
) -> (std::net::SocketAddr, Reap, impl Fn() -> String) {
    let run = root.join("run");
    std::fs::create_dir_all(&run).unwrap();
    let grpc = free_tcp();
    let mut cfg = kvferry_daemon::Config {
        region: "region-a".into(),
        trust_domain: "kvferry.e2e".into(),
        run_dir: run.clone(),
        ..kvferry_daemon::Config::default()
    };
    cfg.listen = kvferry_daemon::config::Listen { grpc, peer: free_udp(), http: free_tcp() };
    configure(&mut cfg);
    let path = root.join("kvferry.toml");
    std::fs::write(&path, cfg.to_toml()).unwrap();
    let mut procs = vec![(
        "daemon".to_owned(),
        spawn(&root.join("daemon.log"), &["daemon", "--config", path.to_str().unwrap()]),
    )];
    wait_file(&run.join("engine.sock"), "daemon", &mut procs);
    // The router API (its TLS configuration, and in dev mode the router client identity it
    // writes) comes up after the engine socket: wait until it accepts connections.
    let t = std::time::Instant::now();
    while std::net::TcpStream::connect(grpc).is_err() {
        assert!(t.elapsed() < std::time::Duration::from_secs(60), "the router API never listened on {grpc}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let log_path = root.join("daemon.log");
    (grpc, Reap(procs), move || std::fs::read_to_string(&log_path).unwrap_or_default())
}

#[test]
fn router_api_requires_a_client_certificate_from_the_router_ca() {
    let root = tempfile::Builder::new().prefix("kvferry-rtls-").tempdir().unwrap();
    let dev = root.path().join("dev-ca");
    let (grpc, _reap, log) = start_daemon(root.path(), |cfg| {
        cfg.auth.bearer_token = "s3cret".into();
        cfg.tls.dev_dir = dev.clone();
        cfg.router_tls.mode = kvferry_daemon::config::RouterTlsMode::Dev;
    });

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

/// A router CA in `dir` (from the dev CA helper: `ca.pem`, a client identity) and a router
/// server certificate it signs for 127.0.0.1, as PEM (certificate, key).
fn router_ca(dir: &std::path::Path) -> (String, String) {
    kvferry_daemon::router_tls::ensure_dev_router_client(dir, "kvferry.e2e").unwrap();
    let ca_pem = std::fs::read_to_string(dir.join("ca.pem")).unwrap();
    let signing = rcgen::KeyPair::from_pem(&std::fs::read_to_string(dir.join("ca.key")).unwrap()).unwrap();
    let issuer = rcgen::Issuer::from_ca_cert_pem(&ca_pem, signing).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.subject_alt_names = vec![rcgen::SanType::IpAddress(std::net::Ipv4Addr::LOCALHOST.into())];
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let cert = params.signed_by(&key, &issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

#[test]
fn router_certificates_rotate_without_a_restart() {
    let root = tempfile::Builder::new().prefix("kvferry-rtls-rot-").tempdir().unwrap();
    let (r1, r2) = (root.path().join("router-ca-1"), root.path().join("router-ca-2"));
    let secret = root.path().join("router-tls");
    let rotate_to = |ca_dir: &std::path::Path| {
        let (cert, key) = router_ca(ca_dir);
        let ca = std::fs::read_to_string(ca_dir.join("ca.pem")).unwrap();
        write_secret(&secret, &[("tls.crt", &cert), ("tls.key", &key), ("ca.crt", &ca)]);
    };
    rotate_to(&r1);
    let (grpc, _reap, log) = start_daemon(root.path(), |cfg| {
        cfg.tls.dev_dir = root.path().join("dev-ca");
        cfg.tls.reload_poll_ms = 100;
        cfg.router_tls.mode = kvferry_daemon::config::RouterTlsMode::Files;
        (cfg.router_tls.cert, cfg.router_tls.key, cfg.router_tls.client_ca) =
            (secret.join("tls.crt"), secret.join("tls.key"), secret.join("ca.crt"));
    });
    // Waits (at most 20 s) until the daemon's log has `line`; else fails saying `what`.
    let logged = |line: &str, what: &str| {
        let t = Instant::now();
        while !log().contains(line) {
            assert!(t.elapsed() < Duration::from_secs(20), "{what}:\n{}", log());
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let addr = format!("https://{grpc}");
    let s = |p: std::path::PathBuf| p.to_str().unwrap().to_owned();
    let links = |ca: &std::path::Path| {
        kvferry(&[
            "links",
            "--daemon",
            &addr,
            "--tls-ca",
            &s(ca.join("ca.pem")),
            "--tls-cert",
            &s(ca.join("router-client.pem")),
            "--tls-key",
            &s(ca.join("router-client.key")),
        ])
    };
    let out = links(&r1);
    assert!(out.status.success(), "{}\n{}", text(&out), log());

    // The Secret rotates to a new CA: the poll sees it, new handshakes use it.
    rotate_to(&r2);
    logged("router TLS files reloaded", "no reload logged");
    let out = links(&r2);
    assert!(out.status.success(), "a router of the new CA was refused: {}\n{}", text(&out), log());
    let out = links(&r1);
    assert!(!out.status.success(), "a router of the old CA is still served: {}", text(&out));

    // A broken key is refused; the new-CA identity keeps serving.
    let (cert, _) = router_ca(&r2);
    let ca = std::fs::read_to_string(r2.join("ca.pem")).unwrap();
    write_secret(&secret, &[("tls.crt", &cert), ("tls.key", "not a key"), ("ca.crt", &ca)]);
    logged("router: refused the new TLS files", "the broken key was not refused");
    let out = links(&r2);
    assert!(out.status.success(), "the kept identity stopped serving: {}\n{}", text(&out), log());
}
