//! The transport abstraction the drivers run on: a [`Link`] to a peer opens one control channel
//! per job (request, manifest, retransmit, done, complete) and carries a transfer's chunks on
//! several data channels. Two transports implement it:
//!
//! - QUIC (`quinn`): a link is the cached connection; a control channel is a bidirectional
//!   stream, a data channel a unidirectional stream the owner opens (routed to its transfer by
//!   [`crate::router`]);
//! - TCP + TLS 1.3 ([`crate::tcp`]): a link is one job's *session*: a control connection and N
//!   data connections the requester dials together, tied by a session id in a preamble.
//!
//! Both carry the same `kvferry-wire` frames with the same mutual-TLS identities and trust
//! policy, so the owner and requester drivers are one code path; this module owns only the
//! byte pipes and the mapping of their errors to [`WireError`]. It must not know frames beyond
//! reading and writing them, nor any transfer rule.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvferry_wire::WireError;
use quinn::{Connection, VarInt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};

use crate::io::{conn_err, from_conn_error, read_err, write_err};
use crate::node::PeerNode;
use crate::tcp::{LowWater, Session, TlsTcp};
use crate::tls::RegionId;
use crate::transport::LinkTuning;
use kvferry_pool::sync::LockExt;

/// The transport that carried a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transport {
    /// QUIC over UDP (quinn), several unidirectional streams per transfer.
    Quic,
    /// TLS 1.3 over TCP, several connections per transfer.
    Tcp,
}

impl Transport {
    /// `quic` or `tcp`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Quic => "quic",
            Self::Tcp => "tcp",
        }
    }
}

/// Which transport to use toward a peer (configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// QUIC only.
    #[default]
    Quic,
    /// TCP + TLS only.
    Tcp,
    /// QUIC first; TCP when the QUIC handshake cannot complete within the fallback bound (UDP
    /// blocked on the path). The choice is remembered for a while, then QUIC is tried again.
    Auto,
}

impl TransportChoice {
    /// Parses `quic`, `tcp`, `auto`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "quic" => Some(Self::Quic),
            "tcp" => Some(Self::Tcp),
            "auto" => Some(Self::Auto),
            _ => None,
        }
    }

    /// The canonical spelling [`TransportChoice::parse`] reads back.
    pub fn name(self) -> &'static str {
        match self {
            Self::Quic => "quic",
            Self::Tcp => "tcp",
            Self::Auto => "auto",
        }
    }
}

/// What carried a fetch: the transport and, for TCP, the kernel congestion controller the
/// data connections ran (`bbr` when the kernel has it, else the kernel default).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkInfo {
    pub transport: Transport,
    /// Congestion control in effect (QUIC: quinn's controller; TCP: the kernel's).
    pub congestion: String,
    /// Data channels (QUIC streams or TCP connections) per transfer.
    pub channels: u32,
    /// Connections the fetch was striped over (1: one transfer on one connection; each stripe
    /// has its own `channels` streams). Always 1 over TCP, which stripes over its channels.
    pub stripes: u32,
}

/// Identifies a link for the in-use counts (QUIC: the connection's `stable_id`; TCP: the
/// session's number).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum LinkId {
    Quic(usize),
    Tcp(u64),
}

/// A link to a peer, over either transport.
#[derive(Clone)]
pub(crate) enum Link {
    Quic(Connection),
    Tcp(Arc<Session>),
}

impl Link {
    pub(crate) fn id(&self) -> LinkId {
        match self {
            Self::Quic(c) => LinkId::Quic(c.stable_id()),
            Self::Tcp(s) => LinkId::Tcp(s.id),
        }
    }

    pub(crate) fn rtt(&self) -> Duration {
        match self {
            Self::Quic(c) => c.rtt(),
            Self::Tcp(s) => s.rtt(),
        }
    }

    /// Ends the link: in-flight jobs on it see a lost connection.
    pub(crate) fn close(&self, reason: &'static [u8]) {
        match self {
            Self::Quic(c) => c.close(VarInt::from_u32(2), reason),
            Self::Tcp(s) => s.shutdown(),
        }
    }

    /// Opens the control channel of one job.
    pub(crate) async fn open_control(&self) -> Result<(SendHalf, RecvHalf), WireError> {
        match self {
            Self::Quic(c) => {
                let (s, r) = c.open_bi().await.map_err(|e| from_conn_error(&e))?;
                Ok((SendHalf::Quic(s), RecvHalf::Quic(r)))
            }
            Self::Tcp(s) => {
                let stream = s.take_control().ok_or_else(|| conn_err("control channel already taken"))?;
                let (r, w) = RecvHalf::tcp(stream);
                Ok((SendHalf::Tcp(w), r))
            }
        }
    }
}

/// Under `auto`, how long a fallback to TCP holds before QUIC is tried again.
const FALLBACK_HOLD: Duration = Duration::from_secs(60);

impl Link {
    /// What this link is, for receipts and the links view.
    pub(crate) fn info(&self, tuning: &LinkTuning) -> LinkInfo {
        match self {
            Self::Quic(_) => LinkInfo {
                transport: Transport::Quic,
                congestion: if tuning.defaults_only { "cubic" } else { tuning.congestion.name() }.into(),
                channels: tuning.quic_streams(),
                stripes: 1,
            },
            Self::Tcp(s) => LinkInfo {
                transport: Transport::Tcp,
                congestion: s.congestion.clone(),
                channels: s.data_channels,
                stripes: 1,
            },
        }
    }
}

impl PeerNode {
    /// A link to `peer` over the transport chosen for it; `data` = data connections a TCP
    /// session dials (0 for a query or a probe; QUIC opens its streams per transfer).
    ///
    /// `auto`: QUIC first; when its handshake does not complete within `auto_fallback` (UDP
    /// blocked), TCP, remembered for [`FALLBACK_HOLD`]. A QUIC handshake that *fails* (a
    /// refused identity) does not fall back: TCP would present the same identities.
    pub(crate) async fn link(&self, peer: &RegionId, addr: SocketAddr, data: u32) -> Result<Link, WireError> {
        self.link_stripe(peer, addr, data, 0).await
    }

    /// The transport chosen for `peer` now.
    pub(crate) fn transport_choice(&self, peer: &RegionId) -> TransportChoice {
        self.choices.locked().get(peer).copied().unwrap_or(self.cfg.transport)
    }

    /// [`PeerNode::link`] for stripe `stripe` of a fetch: over QUIC, that stripe's own cached
    /// connection (a striped fetch runs only where the choice is plain QUIC).
    pub(crate) async fn link_stripe(
        &self,
        peer: &RegionId,
        addr: SocketAddr,
        data: u32,
        stripe: u32,
    ) -> Result<Link, WireError> {
        match self.transport_choice(peer) {
            TransportChoice::Quic => self.connect_stripe(peer, addr, stripe).await.map(Link::Quic),
            TransportChoice::Tcp => self.dial_tcp(peer, addr, data).await,
            TransportChoice::Auto => {
                let fell = self.fallen_back.locked().get(peer).is_some_and(|at| at.elapsed() < FALLBACK_HOLD);
                if !fell {
                    match tokio::time::timeout(self.cfg.auto_fallback, self.connect(peer, addr)).await {
                        Ok(r) => return r.map(Link::Quic),
                        Err(_) => {
                            tracing::warn!(peer = %peer, bound = ?self.cfg.auto_fallback,
                                "QUIC handshake did not complete (UDP blocked?); using TCP");
                            self.fallen_back.locked().insert(peer.clone(), Instant::now());
                        }
                    }
                }
                self.dial_tcp(peer, addr, data).await
            }
        }
    }

    /// Dials `peer` over its transport, mutual TLS and all, and says what carried it (a
    /// readiness check; the QUIC connection stays cached, a TCP session is closed at once).
    pub async fn handshake(&self, peer: &RegionId, addr: SocketAddr) -> Result<LinkInfo, WireError> {
        let link = self.link(peer, addr, 0).await?;
        Ok(self.record_link(peer, &link))
    }

    /// Remembers what carried a finished job to `peer` (receipts, the links view, `rtt_to`).
    pub(crate) fn record_link(&self, peer: &RegionId, link: &Link) -> LinkInfo {
        let info = link.info(&self.cfg.tuning);
        self.last_link.locked().insert(peer.clone(), (info.clone(), link.rtt(), Instant::now()));
        info
    }
}

/// The sending half of a channel.
pub(crate) enum SendHalf {
    Quic(quinn::SendStream),
    Tcp(WriteHalf<TlsTcp>),
}

impl SendHalf {
    pub(crate) async fn write_all(&mut self, bytes: &[u8]) -> Result<(), WireError> {
        match self {
            Self::Quic(s) => s.write_all(bytes).await.map_err(write_err),
            Self::Tcp(s) => s.write_all(bytes).await.map_err(|e| io_err(&e)),
        }
    }

    /// Writes an owned buffer (QUIC takes it without a copy).
    pub(crate) async fn write_chunk(&mut self, bytes: Bytes) -> Result<(), WireError> {
        match self {
            Self::Quic(s) => s.write_chunk(bytes).await.map_err(write_err),
            Self::Tcp(s) => s.write_all(&bytes).await.map_err(|e| io_err(&e)),
        }
    }

    /// Ends the channel cleanly after what was written (TCP: TLS close_notify, then FIN).
    pub(crate) async fn finish(&mut self) {
        match self {
            Self::Quic(s) => {
                let _ = s.finish();
            }
            Self::Tcp(s) => {
                let _ = s.shutdown().await;
            }
        }
    }
}

/// The receiving half of a channel.
pub(crate) enum RecvHalf {
    Quic(quinn::RecvStream),
    Tcp(ReadHalf<TlsTcp>, Option<LowWater>),
}

/// Why a read of an exact length stopped.
pub(crate) enum ReadEnd {
    /// The channel ended cleanly after this many bytes of the read.
    Finished(usize),
    Failed(WireError),
}

impl RecvHalf {
    /// A TLS-over-TCP connection's two halves, its reads batched by a receive low-water mark.
    pub(crate) fn tcp(stream: TlsTcp) -> (RecvHalf, WriteHalf<TlsTcp>) {
        let low = LowWater::of(&stream);
        let (r, w) = tokio::io::split(stream);
        (RecvHalf::Tcp(r, low), w)
    }

    /// Fills `buf`, or says how the channel ended.
    pub(crate) async fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), ReadEnd> {
        match self {
            Self::Quic(r) => match r.read_exact(buf).await {
                Ok(()) => Ok(()),
                Err(quinn::ReadExactError::FinishedEarly(n)) => Err(ReadEnd::Finished(n)),
                Err(e) => Err(ReadEnd::Failed(read_err(e))),
            },
            Self::Tcp(r, low) => read_exact_tcp(r, low.as_mut(), buf).await,
        }
    }

    /// Reads up to `buf.len()` bytes; `Ok(0)` at the end of the channel.
    pub(crate) async fn read_some(&mut self, buf: &mut [u8]) -> Result<usize, WireError> {
        match self {
            Self::Quic(r) => match r.read(buf).await {
                Ok(Some(n)) => Ok(n),
                Ok(None) => Ok(0),
                Err(quinn::ReadError::ConnectionLost(e)) => Err(from_conn_error(&e)),
                Err(e) => Err(conn_err(e)),
            },
            Self::Tcp(r, low) => {
                mark(low.as_mut(), 0);
                r.read(buf).await.map_err(|e| io_err(&e))
            }
        }
    }

    /// TCP: reads what the peer still sends until it closes (at most a second), so that
    /// closing our socket with unread bytes in it cannot reset the connection and destroy the
    /// answer we just wrote before the peer has read it. QUIC needs none of this.
    pub(crate) async fn linger(&mut self) {
        if let Self::Tcp(r, low) = self {
            mark(low.as_mut(), 0);
            let mut sink = [0u8; 4096];
            let drain = async { while matches!(r.read(&mut sink).await, Ok(n) if n > 0) {} };
            let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
        }
    }

    /// Asks the sender to stop (QUIC `STOP_SENDING`; TCP: the channel is simply dropped).
    pub(crate) fn stop(&mut self) {
        if let Self::Quic(r) = self {
            let _ = r.stop(VarInt::from_u32(0));
        }
    }
}

/// Fills `buf` from `r`, moving the socket's receive low-water mark (where there is one) with
/// what is still to come: the mark never asks for more than is certain to arrive, and is back
/// at the default when the read ends.
async fn read_exact_tcp<R: AsyncRead + Unpin>(
    r: &mut R,
    mut low: Option<&mut LowWater>,
    buf: &mut [u8],
) -> Result<(), ReadEnd> {
    let mut got = 0;
    let end = loop {
        if got >= buf.len() {
            break Ok(());
        }
        mark(low.as_deref_mut(), buf.len() - got);
        match r.read(&mut buf[got..]).await {
            Ok(0) => break Err(ReadEnd::Finished(got)),
            Ok(n) => got += n,
            Err(e) => break Err(ReadEnd::Failed(io_err(&e))),
        }
    };
    mark(low, 0);
    end
}

/// Sets the receive low-water mark, where the socket has one, for a read that still needs
/// `remaining` bytes (0: the default mark, for a read of any length).
fn mark(low: Option<&mut LowWater>, remaining: usize) {
    if let Some(low) = low {
        low.before_read(remaining);
    }
}

/// Maps an I/O error of a TLS-over-TCP channel: a refused certificate or identity (ours
/// refused by the peer's alert, or theirs refused here) is final, like a QUIC crypto error;
/// anything else is a lost connection.
pub(crate) fn io_err(e: &std::io::Error) -> WireError {
    match e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) {
        Some(t) if tls_refusal(t) => WireError::NotAuthorised(t.to_string()),
        _ => WireError::Connection(e.to_string()),
    }
}

/// Whether a TLS error means an identity was refused (retrying cannot help): a certificate
/// refused here, or any fatal alert from the peer — as for QUIC, where every TLS alert is a
/// crypto error and final (a peer that refuses our chain may say so with any alert, e.g.
/// `DecryptError` when it cannot verify our signature against the chain it distrusts).
pub(crate) fn tls_refusal(e: &rustls::Error) -> bool {
    use rustls::AlertDescription as A;
    match e {
        rustls::Error::InvalidCertificate(_)
        | rustls::Error::NoCertificatesPresented
        | rustls::Error::InvalidCertRevocationList(_)
        | rustls::Error::PeerIncompatible(_)
        | rustls::Error::NoApplicationProtocol => true,
        rustls::Error::AlertReceived(a) => !matches!(a, A::CloseNotify | A::UserCanceled),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_round_trip_and_refuse_unknown_names() {
        for c in [TransportChoice::Quic, TransportChoice::Tcp, TransportChoice::Auto] {
            assert_eq!(TransportChoice::parse(c.name()), Some(c));
        }
        assert_eq!(TransportChoice::parse("TCP"), Some(TransportChoice::Tcp));
        assert_eq!(TransportChoice::parse("sctp"), None);
    }

    #[test]
    fn certificate_alerts_are_refusals_and_resets_are_not() {
        let alert = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::AlertReceived(rustls::AlertDescription::UnknownCA),
        );
        assert!(matches!(io_err(&alert), WireError::NotAuthorised(_)));
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert!(matches!(io_err(&reset), WireError::Connection(_)));
        let decrypt = std::io::Error::new(std::io::ErrorKind::InvalidData, rustls::Error::DecryptError);
        assert!(matches!(io_err(&decrypt), WireError::Connection(_)));
    }
}
