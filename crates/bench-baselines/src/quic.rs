//! Baseline 1: quinn exactly as a user gets it out of the box.
//!
//! One connection with mutual TLS (kvferry's rustls configuration: TLS 1.3, aws-lc-rs,
//! AES-128-GCM first, region certificates from a throwaway dev CA), quinn's default
//! `TransportConfig` and `EndpointConfig` (CUBIC, 12 kB initial window, 1.25 MB stream receive
//! window, 10 MB send window, no initial-RTT hint), the kernel's default UDP socket buffers
//! (`Endpoint::server` / `Endpoint::client` bind plain sockets; quinn sets no buffer size),
//! one unidirectional stream for the payload. The receiver asks for the payload with an 8-byte
//! request on its own unidirectional stream, as a fetch would.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, anyhow};
use kvferry_wanem::Emulator;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};

use crate::pair::{Pki, SideReport, measured, parse_request, request, run_pair};
use crate::{BaselineRun, PATTERN_SEED, Pattern, thread_cpu, transfer_timeout};

/// Receive buffer of the reading loop.
const READ_BUF: usize = 1 << 20;

/// quinn with its default transport configuration, one stream, mutual TLS. See the module docs.
pub fn quinn_defaults(emu: &Emulator, bytes: u64) -> anyhow::Result<BaselineRun> {
    let pki = Pki::new()?;
    let server_tls = kvferry_peer::tls::server_crypto(&pki.a, &pki.policy_a)?;
    let client_tls = kvferry_peer::tls::client_crypto(&pki.b, pki.roots.clone(), &pki.a.id)?;
    let server = quinn::ServerConfig::with_crypto(Arc::new(
        QuicServerConfig::try_from(server_tls).context("QUIC server TLS")?,
    ));
    let client = quinn::ClientConfig::new(Arc::new(
        QuicClientConfig::try_from(client_tls).context("QUIC client TLS")?,
    ));
    // Generated before the clock starts, so it costs neither side's measured CPU.
    let mut payload = vec![0u8; usize::try_from(bytes)?];
    Pattern::new(PATTERN_SEED).fill(&mut payload);
    let (addr_a, addr_b) = (emu.addr_a(), emu.addr_b());
    let timeout = transfer_timeout(emu, bytes);

    let sender = move |port_tx: tokio::sync::oneshot::Sender<u16>| async move {
        let ep = quinn::Endpoint::server(server, SocketAddr::new(addr_a.into(), 0)).context("bind")?;
        let _ = port_tx.send(ep.local_addr()?.port());
        let incoming = ep.accept().await.ok_or_else(|| anyhow!("endpoint closed"))?;
        let c0 = thread_cpu();
        let conn = incoming.await.context("handshake")?;
        let mut req = conn.accept_uni().await.context("accept request stream")?;
        let want = parse_request(&req.read_to_end(64).await.context("read request")?)?;
        if want != bytes {
            return Err(anyhow!("receiver asked for {want} bytes, we hold {bytes}"));
        }
        let mut s = conn.open_uni().await.context("open payload stream")?;
        s.write_all(&payload).await.context("write payload")?;
        s.finish()?;
        // The receiver closes the connection once it has verified everything.
        let _ = conn.closed().await;
        let cpu_s = thread_cpu() - c0;
        let st = conn.stats();
        let detail = format!(
            "sender stats: {} lost packets, {} congestion events, cwnd {} B at the end, rtt {:?}, \
             {} STREAM_DATA_BLOCKED + {} DATA_BLOCKED frames sent, {} datagrams in {} sends",
            st.path.lost_packets,
            st.path.congestion_events,
            st.path.cwnd,
            st.path.rtt,
            st.frame_tx.stream_data_blocked,
            st.frame_tx.data_blocked,
            st.udp_tx.datagrams,
            st.udp_tx.ios,
        );
        ep.close(0u32.into(), b"");
        Ok(SideReport { cpu_s, detail, ..SideReport::default() })
    };
    let receiver = move |port: u16| async move {
        let mut ep = quinn::Endpoint::client(SocketAddr::new(addr_b.into(), 0)).context("bind")?;
        ep.set_default_client_config(client);
        let (t0, c0) = (Instant::now(), thread_cpu());
        let conn = ep.connect(SocketAddr::new(addr_a.into(), port), "source")?.await.context("handshake")?;
        let mut req = conn.open_uni().await?;
        req.write_all(&request(bytes)).await?;
        req.finish()?;
        let mut s = conn.accept_uni().await.context("accept payload stream")?;
        let mut buf = vec![0u8; READ_BUF];
        let mut check = Pattern::new(PATTERN_SEED);
        let (mut got, mut ok) = (0u64, true);
        while let Some(n) = s.read(&mut buf).await.context("read payload")? {
            ok &= check.check(&buf[..n]);
            got += n as u64;
        }
        let wall_s = t0.elapsed().as_secs_f64();
        let cpu_s = thread_cpu() - c0;
        conn.close(0u32.into(), b"done");
        ep.wait_idle().await;
        Ok(SideReport { cpu_s, wall_s, verified: ok && got == bytes, bytes: got, detail: String::new() })
    };
    let (a, b) = run_pair(emu, timeout, sender, receiver)?;
    Ok(measured(
        "quinn-defaults",
        &a,
        &b,
        format!(
            "quinn 0.11 default TransportConfig/EndpointConfig (CUBIC), default UDP socket buffers, \
             1 connection, 1 uni stream, mutual TLS 1.3 (rustls/aws-lc-rs); CPU = RUSAGE_THREAD of \
             each side's current_thread runtime; {}",
            a.detail
        ),
    ))
}
