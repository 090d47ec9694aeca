//! Running a sender (side A) and a receiver (side B) on one OS thread each, inside their
//! namespaces, each with its own `current_thread` tokio runtime, bounded by a timeout, with
//! cancellation of the other side when one fails.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, anyhow};
use kvferry_wanem::{Emulator, Side};
use tokio::sync::{Notify, oneshot};

/// What one side measured.
#[derive(Debug, Clone, Default)]
pub(crate) struct SideReport {
    /// CPU seconds of this side's thread over its part of the transfer.
    pub(crate) cpu_s: f64,
    /// Wall seconds (meaningful for the receiver).
    pub(crate) wall_s: f64,
    /// Every byte matched (receiver only).
    pub(crate) verified: bool,
    /// Bytes received (receiver only).
    pub(crate) bytes: u64,
    /// Extra detail for the run's note (e.g. transport statistics).
    pub(crate) detail: String,
}

type SideResult = anyhow::Result<SideReport>;

fn run_side<F, Fut>(
    emu: &Emulator,
    side: Side,
    timeout: Duration,
    mine: Arc<Notify>,
    other: Arc<Notify>,
    f: F,
) -> anyhow::Result<std::thread::JoinHandle<kvferry_wanem::Result<SideResult>>>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = SideResult>,
{
    let h = emu.spawn_thread_in(side, move || {
        let rt =
            tokio::runtime::Builder::new_current_thread().enable_all().build().context("tokio runtime")?;
        let r = rt.block_on(async move {
            tokio::select! {
                r = tokio::time::timeout(timeout, f()) => {
                    r.unwrap_or_else(|_| Err(anyhow!("side {side:?} did not finish within {timeout:?}")))
                }
                () = mine.notified() => Err(anyhow!("side {side:?} cancelled: the other side failed")),
            }
        });
        if r.is_err() {
            other.notify_one();
        }
        rt.shutdown_timeout(Duration::from_millis(200));
        r
    })?;
    Ok(h)
}

/// Runs `sender` in namespace A and `receiver` in namespace B. The sender publishes the port
/// it listens on through the `oneshot` it is given; the receiver gets that port.
pub(crate) fn run_pair<S, SF, R, RF>(
    emu: &Emulator,
    timeout: Duration,
    sender: S,
    receiver: R,
) -> anyhow::Result<(SideReport, SideReport)>
where
    S: FnOnce(oneshot::Sender<u16>) -> SF + Send + 'static,
    SF: Future<Output = SideResult>,
    R: FnOnce(u16) -> RF + Send + 'static,
    RF: Future<Output = SideResult>,
{
    let (tx, rx) = oneshot::channel::<u16>();
    let (cancel_a, cancel_b) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let a = run_side(emu, Side::A, timeout, cancel_a.clone(), cancel_b.clone(), move || sender(tx))?;
    let b = run_side(emu, Side::B, timeout, cancel_b, cancel_a, move || async move {
        let port = rx.await.map_err(|_| anyhow!("the sender never started listening"))?;
        receiver(port).await
    })?;
    let join = |h: std::thread::JoinHandle<kvferry_wanem::Result<SideResult>>, what: &str| -> SideResult {
        match h.join() {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => Err(anyhow!("{what}: entering the namespace: {e}")),
            Err(_) => Err(anyhow!("{what} thread panicked")),
        }
    };
    let rb = join(b, "receiver");
    let ra = join(a, "sender");
    match (ra, rb) {
        (Ok(a), Ok(b)) => Ok((a, b)),
        // The receiver's own error explains more than the sender's "cancelled".
        (_, Err(eb)) if !eb.to_string().contains("cancelled") => Err(eb.context("receiver (side B)")),
        (Err(ea), _) => Err(ea.context("sender (side A)")),
        (_, Err(eb)) => Err(eb.context("receiver (side B)")),
    }
}

/// The 8-byte request the receiver sends: how many payload bytes it wants.
pub(crate) fn request(bytes: u64) -> [u8; 8] {
    bytes.to_le_bytes()
}

/// Parses [`request`].
pub(crate) fn parse_request(b: &[u8]) -> anyhow::Result<u64> {
    let a: [u8; 8] = b.try_into().map_err(|_| anyhow!("bad request length {}", b.len()))?;
    Ok(u64::from_le_bytes(a))
}

/// A dev PKI with region certificates for both sides: (A's identity and trust policy, B's).
pub(crate) struct Pki {
    pub(crate) a: kvferry_peer::TlsIdentity,
    pub(crate) b: kvferry_peer::TlsIdentity,
    pub(crate) policy_a: kvferry_peer::TrustPolicy,
    pub(crate) roots: Arc<rustls::RootCertStore>,
}

pub(crate) const TRUST_DOMAIN: &str = "kvferry.baseline";

impl Pki {
    pub(crate) fn new() -> anyhow::Result<Self> {
        let pki = kvferry_peer::DevPki::generate(TRUST_DOMAIN)?;
        let a = pki.issue("source")?;
        let b = pki.issue("target")?;
        let policy_a = kvferry_peer::TrustPolicy {
            roots: pki.roots(),
            trust_domain: TRUST_DOMAIN.into(),
            allowed_regions: vec!["target".into()],
        };
        Ok(Self { a, b, policy_a, roots: pki.roots() })
    }
}

/// The run the two sides measured: the receiver's bytes, wall time and verdict, both sides' CPU.
pub(crate) fn measured(
    name: &'static str,
    a: &SideReport,
    b: &SideReport,
    note: String,
) -> crate::BaselineRun {
    crate::finish(crate::BaselineRun {
        name,
        bytes: b.bytes,
        wall_s: b.wall_s,
        goodput_bps: 0.0,
        cpu_s_sender: a.cpu_s,
        cpu_s_receiver: b.cpu_s,
        verified: b.verified,
        note,
    })
}
