//! Baseline 2: one TCP stream with TLS, as a tokio + rustls user writes it.
//!
//! Mutual TLS 1.3 with kvferry's rustls configuration (aws-lc-rs, AES-128-GCM first, region
//! certificates from a throwaway dev CA) through tokio-rustls; no socket option is set (no
//! buffer sizes, no `TCP_NODELAY`, the namespace's default congestion control), so the kernel's
//! autotuning decides (the emulator's namespaces allow `tcp_{r,w}mem` up to 64 MiB). The
//! receiver connects, sends an 8-byte request and reads the payload to the end.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, anyhow};
use kvferry_wanem::Emulator;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::pair::{Pki, SideReport, measured, parse_request, request, run_pair};
use crate::{BaselineRun, PATTERN_SEED, Pattern, thread_cpu, transfer_timeout};

const READ_BUF: usize = 1 << 20;

/// One TCP stream with mutual TLS, default socket options. See the module docs.
pub fn tcp_tls(emu: &Emulator, bytes: u64) -> anyhow::Result<BaselineRun> {
    let pki = Pki::new()?;
    let acceptor = TlsAcceptor::from(Arc::new(kvferry_peer::tls::server_crypto(&pki.a, &pki.policy_a)?));
    let connector =
        TlsConnector::from(Arc::new(kvferry_peer::tls::client_crypto(&pki.b, pki.roots.clone(), &pki.a.id)?));
    let mut payload = vec![0u8; usize::try_from(bytes)?];
    Pattern::new(PATTERN_SEED).fill(&mut payload);
    let addr_a = emu.addr_a();
    let cc = emu
        .run_in(kvferry_wanem::Side::A, || {
            std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
        })
        .ok()
        .and_then(Result::ok)
        .map_or_else(|| "unknown".to_owned(), |s| s.trim().to_owned());
    let timeout = transfer_timeout(emu, bytes);

    let sender = move |port_tx: tokio::sync::oneshot::Sender<u16>| async move {
        let listener = TcpListener::bind(SocketAddr::new(addr_a.into(), 0)).await.context("listen")?;
        let _ = port_tx.send(listener.local_addr()?.port());
        let (tcp, _) = listener.accept().await.context("accept")?;
        let c0 = thread_cpu();
        let mut tls = acceptor.accept(tcp).await.context("TLS handshake")?;
        let mut req = [0u8; 8];
        tls.read_exact(&mut req).await.context("read request")?;
        let want = parse_request(&req)?;
        if want != bytes {
            return Err(anyhow!("receiver asked for {want} bytes, we hold {bytes}"));
        }
        tls.write_all(&payload).await.context("write payload")?;
        tls.shutdown().await.context("close_notify")?;
        // Wait for the receiver to hang up (it has then read and verified everything).
        let mut sink = [0u8; 64];
        while matches!(tls.read(&mut sink).await, Ok(n) if n > 0) {}
        Ok(SideReport { cpu_s: thread_cpu() - c0, ..SideReport::default() })
    };
    let receiver = move |port: u16| async move {
        let (t0, c0) = (Instant::now(), thread_cpu());
        let tcp = TcpStream::connect(SocketAddr::new(addr_a.into(), port)).await.context("connect")?;
        let name = ServerName::try_from("source").map_err(|e| anyhow!("{e}"))?;
        let mut tls = connector.connect(name, tcp).await.context("TLS handshake")?;
        tls.write_all(&request(bytes)).await?;
        tls.flush().await?;
        let mut buf = vec![0u8; READ_BUF];
        let mut check = Pattern::new(PATTERN_SEED);
        let (mut got, mut ok) = (0u64, true);
        while got < bytes {
            let n = tls.read(&mut buf).await.context("read payload")?;
            if n == 0 {
                break;
            }
            ok &= check.check(&buf[..n]);
            got += n as u64;
        }
        let wall_s = t0.elapsed().as_secs_f64();
        let cpu_s = thread_cpu() - c0;
        let _ = tls.shutdown().await;
        Ok(SideReport { cpu_s, wall_s, verified: ok && got == bytes, bytes: got, detail: String::new() })
    };
    let (a, b) = run_pair(emu, timeout, sender, receiver)?;
    Ok(measured(
        "tcp-tls",
        &a,
        &b,
        format!(
            "1 TCP connection, no socket options (kernel autotuning; congestion control {cc}, the \
             namespace default), mutual TLS 1.3 (tokio-rustls, rustls/aws-lc-rs); CPU = RUSAGE_THREAD \
             of each side's current_thread runtime"
        ),
    ))
}
