//! QUIC transport tuning for long fat pipes, and endpoint construction.
//!
//! quinn's defaults cap a WAN transfer: a 1.25 MB stream receive window (≈100 Mbit/s per stream
//! at 100 ms RTT), a 10 MB send window (≈800 Mbit/s per connection at 100 ms), a 12 kB initial
//! congestion window, and the kernel's default ~208 KiB UDP socket buffers. [`LinkTuning`]
//! sizes every window from the bandwidth-delay product instead, raises the socket buffers,
//! keeps GSO on, and makes the congestion controller a choice. `LinkTuning::quinn_defaults`
//! reproduces quinn's defaults exactly, for baselines measured in the same run.

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use quinn::congestion::{BbrConfig, CubicConfig, NewRenoConfig};
use quinn::crypto::rustls::QuicServerConfig;
use quinn::{AckFrequencyConfig, IdleTimeout, TransportConfig, VarInt};

use crate::tls::{IdentityError, TlsIdentity, TrustPolicy, server_crypto};
use crate::tolerant::{DEFAULT_LOSS_TOLERANCE, TolerantConfig};

/// Congestion controllers we can plug in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Congestion {
    /// Loss-based CUBIC (quinn's default).
    Cubic,
    /// Model-based BBR (quinn's implementation is marked experimental).
    Bbr,
    /// Loss-based NewReno.
    NewReno,
    /// kvferry's loss-tolerant controller ([`crate::tolerant`]): cuts only when a round trip
    /// loses more than the configured fraction, so random loss does not cap the rate.
    Tolerant,
}

impl Congestion {
    /// Parses `cubic`, `bbr`, `newreno`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "cubic" => Some(Self::Cubic),
            "bbr" => Some(Self::Bbr),
            "newreno" | "new-reno" | "reno" => Some(Self::NewReno),
            "tolerant" | "loss-tolerant" => Some(Self::Tolerant),
            _ => None,
        }
    }

    /// The canonical spelling [`Congestion::parse`] reads back.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cubic => "cubic",
            Self::Bbr => "bbr",
            Self::NewReno => "newreno",
            Self::Tolerant => "tolerant",
        }
    }
}

/// Transport parameters for one peer link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkTuning {
    /// Expected bottleneck rate, bits/s.
    pub bandwidth_bps: f64,
    /// Expected round-trip time.
    pub rtt: Duration,
    /// Parallel unidirectional streams per transfer, at most (QUIC uses
    /// [`LinkTuning::quic_streams`] of them; TCP this many data connections).
    pub streams: u32,
    /// Congestion controller.
    pub congestion: Congestion,
    /// [`Congestion::Tolerant`]'s loss tolerance: the fraction of a round trip's bytes that may
    /// be lost before the loss counts as congestion.
    pub loss_tolerance: f64,
    /// Requested UDP socket buffer size (send and receive).
    pub socket_buffer_bytes: usize,
    /// Connection idle timeout.
    pub idle_timeout: Duration,
    /// ACK frequency (draft-ietf-quic-ack-frequency, which quinn implements): how many
    /// ack-eliciting packets the peer may receive before it must acknowledge. 0 leaves the
    /// extension off (an ACK every second packet, quinn's default). Each ACK is a packet the
    /// receiver encrypts and sends and the sender decrypts and processes: at the default,
    /// 1 GiB costs some 385,000 of them.
    pub ack_eliciting_threshold: u32,
    /// Receive coalescing (see `coalesce`): after a drained batch, how long the QUIC socket
    /// waits before it is read again while traffic flows. Zero reads every datagram as it
    /// comes. [`LinkTuning::recv_hold`] applies it only where the round trip is long enough.
    pub recv_coalesce: Duration,
    /// Connections per fetch over QUIC (1..=[`crate::stripe::MAX_STRIPES`]): a fetch of enough
    /// blocks is split into this many contiguous ranges, each its own transfer on its own
    /// connection, so that quinn processes them on separate worker threads (one connection's
    /// packets are one task's work). TCP ignores it: it already stripes a transfer over its
    /// `streams` data connections.
    pub stripes: u32,
    /// `None` = use quinn's untouched defaults for windows, initial RTT and congestion control.
    pub defaults_only: bool,
}

impl Default for LinkTuning {
    fn default() -> Self {
        Self {
            bandwidth_bps: 10e9,
            rtt: Duration::from_millis(50),
            streams: 4,
            congestion: Congestion::Cubic,
            loss_tolerance: DEFAULT_LOSS_TOLERANCE,
            socket_buffer_bytes: 32 << 20,
            idle_timeout: Duration::from_secs(10),
            ack_eliciting_threshold: DEFAULT_ACK_ELICITING_THRESHOLD,
            recv_coalesce: DEFAULT_RECV_COALESCE,
            stripes: 1,
            defaults_only: false,
        }
    }
}

const MIB: u64 = 1 << 20;

/// [`LinkTuning::ack_eliciting_threshold`]'s default: an ACK per 16 ack-eliciting packets
/// (about 23 KB of payload, 190 µs at 1 Gbit/s), within the 8–32 that keeps the sender's
/// congestion controller fed while cutting ACK traffic eightfold.
pub const DEFAULT_ACK_ELICITING_THRESHOLD: u32 = 16;

/// [`LinkTuning::recv_coalesce`]'s default: 1 ms (the runtime timer's granularity), about 2 %
/// of a 50 ms round trip, in exchange for reading ~85 datagrams per wake-up at 1 Gbit/s.
pub const DEFAULT_RECV_COALESCE: Duration = Duration::from_millis(1);

/// The payload rate one QUIC data stream is given: a transfer uses one stream per this much
/// of the link's expected rate, up to `streams`. Measured (`kvferry bench --no-baselines
/// --no-decisions --streams N`, 256 MiB, 2026-12-03): at 100 Mbit/s × 20 ms one or two
/// streams reach 94.5 % of the link (three runs) and four 91.0–92.0 % (four runs; every full
/// bench since 2026-12-01: 90–91 %), with 25–35 % more CPU per GiB on each side; at 1 Gbit/s
/// one, two and four are within a point of each other (50 ms: 90.0 / 91.3 / 90.2 %; 150 ms:
/// 88.8 / 88.9 / 88.8 %; 1 GiB × 50 ms: 93.2 % with one, 92.9 % with four) and eight is
/// worse (85.9 % at 150 ms).
pub const QUIC_STREAM_BPS: f64 = 250e6;

/// The payload rate one TCP data connection is given: a TCP session dials one data connection
/// per this much of the link's expected rate, up to `streams` — the QUIC streams' rule.
/// Measured (`bench/results/tcp-connections-2026-12-07/`, the bench's `kvferry-tcp` at 256 MiB,
/// alternated twice): at 100 Mbit/s × 20 ms four BBR connections reached 87.4–87.7 % of the
/// link (86.1–86.3 % with 0.1 % loss) where one reaches 93.9 % (94.6–94.7 %), the receiver
/// spending 1.5–1.6 CPU s/GiB against 1.1–1.4. At 1 Gbit/s four stay (the full benches: four
/// connections 76.6 / 53.1 / 77.5 % of the 50 ms, 150 ms and lossy profiles, one TCP+TLS
/// stream 75.9 / 46.1 / 71.5 %).
pub const TCP_CONNECTION_BPS: f64 = 250e6;

/// Channels for a link of `bps`: one per `per_channel` of it, at least 1, at most `most`.
fn channels_for(bps: f64, per_channel: f64, most: u32) -> u32 {
    // NaN and negatives cast to 0 and are lifted to 1; the cast saturates above u32::MAX.
    (((bps / per_channel).ceil()) as u32).clamp(1, most.max(1))
}

/// Datagrams a receive hold is sized to gather at the link's expected rate (see
/// [`LinkTuning::recv_hold`]): each batch costs a wake-up, a timer and a `recvmmsg` round
/// whatever its size.
pub const RECV_BATCH_PACKETS: f64 = 32.0;

/// A full QUIC datagram's bytes on a 1500-byte-MTU path, for sizing holds.
const RECV_PACKET_BYTES: f64 = 1452.0;

/// Below this round trip receive coalescing is off: a millisecond would be a visible share.
pub const MIN_RTT_FOR_COALESCING: Duration = Duration::from_millis(10);

impl LinkTuning {
    /// quinn's defaults, unchanged (the baseline).
    pub fn quinn_defaults() -> Self {
        Self { defaults_only: true, socket_buffer_bytes: 0, ..Self::default() }
    }

    /// Bandwidth-delay product in bytes.
    pub fn bdp_bytes(&self) -> u64 {
        (self.bandwidth_bps / 8.0 * self.rtt.as_secs_f64()).ceil() as u64
    }

    /// Connection-level flow-control window, at least 16 MiB, at most 1 GiB: 2 × BDP under a
    /// loss-based controller (CUBIC, NewReno), 4 × BDP under one that keeps its rate through
    /// random loss (the loss-tolerant controller, BBR).
    ///
    /// A stream with a lost packet cannot be read past the hole for one to two round trips,
    /// so on a lossy path the window must hold what is in flight (the BDP plus a bottleneck
    /// queue of about one BDP) and up to two BDPs waiting behind holes: at 0.1 % loss and
    /// 1 Gbit/s × 50 ms the 16 MiB window stalled the sender (`kvferry bench --profiles
    /// 1gbit-50ms-loss0.1 --sizes-mib 256,1024 --no-decisions --no-baselines`, 2026-12-05,
    /// `bench/results/lossy-2026-12-05/`: the loss-tolerant controller 85 % / 90 % of the link
    /// at 256 MiB / 1 GiB with 2 × BDP, 90 % / 95 % with 4 ×; BBR 66 % / 77 % → 75 % / 83 %).
    /// A loss-based controller halves on any loss, so it never has holes' worth of room to
    /// use, and there the 2 × BDP window is what stops its slow start from overrunning the
    /// queue: CUBIC with 4 × BDP fell from ~72 % to 58–59 % at 64 MiB on 1 Gbit/s × 150 ms.
    pub fn connection_window(&self) -> u64 {
        let bdps = match self.congestion {
            Congestion::Tolerant | Congestion::Bbr => 4,
            Congestion::Cubic | Congestion::NewReno => 2,
        };
        (bdps * self.bdp_bytes()).clamp(16 * MIB, 1024 * MIB)
    }

    /// QUIC data streams per transfer: one per [`QUIC_STREAM_BPS`] of the expected rate, at
    /// least 1, at most `streams` (100 Mbit/s: 1; 1 Gbit/s: 4).
    pub fn quic_streams(&self) -> u32 {
        channels_for(self.bandwidth_bps, QUIC_STREAM_BPS, self.streams)
    }

    /// TCP data connections per fetch session: one per [`TCP_CONNECTION_BPS`] of the expected
    /// rate, at least 1, at most `streams` (100 Mbit/s: 1; 1 Gbit/s: 4).
    pub fn tcp_connections(&self) -> u32 {
        channels_for(self.bandwidth_bps, TCP_CONNECTION_BPS, self.streams)
    }

    /// Per-stream receive window: the connection window shared by the QUIC streams, at least
    /// 16 MiB.
    pub fn stream_window(&self) -> u64 {
        (self.connection_window() / u64::from(self.quic_streams()))
            .max(16 * MIB)
            .min(self.connection_window())
    }

    /// Initial congestion window: the link's BDP, between 64 KiB and 32 MiB. The daemon knows the
    /// path it dials (configured, then measured), so a new connection starts at the rate the
    /// path carries instead of re-learning it in slow start (the idea of the IETF's Careful
    /// Resume); quinn paces the window over the RTT, so it leaves as a paced flight, not a
    /// burst. Measured (256 MiB, 1 Gbit/s × 50 ms, CUBIC): a quarter BDP capped at 4 MiB
    /// took 0.30 s for the first 16 MiB and reached 86 % of the link; the whole BDP, 0.18 s
    /// and 91 % (`bench/results/transport-start-2026-12-03/`).
    pub fn initial_window(&self) -> u64 {
        self.bdp_bytes().clamp(64 << 10, 32 * MIB)
    }

    /// The receive hold this link's socket uses, on round trips of at least
    /// [`MIN_RTT_FOR_COALESCING`] (nothing on shorter ones, when `recv_coalesce` is zero, or for
    /// quinn's defaults): long enough for [`RECV_BATCH_PACKETS`] at the expected rate, at least
    /// [`LinkTuning::recv_coalesce`], at most an eighth of the round trip. 1 Gbit/s: the 1 ms
    /// floor (~85 packets); 100 Mbit/s × 20 ms: 2.5 ms (~21 packets) instead of the 1 ms that
    /// woke the receiver for 8.
    pub fn recv_hold(&self) -> Duration {
        if self.defaults_only || self.rtt < MIN_RTT_FOR_COALESCING || self.recv_coalesce.is_zero() {
            return Duration::ZERO;
        }
        let batch_s = RECV_BATCH_PACKETS * RECV_PACKET_BYTES * 8.0 / self.bandwidth_bps;
        let batch = if batch_s.is_finite() && batch_s > 0.0 {
            Duration::from_secs_f64(batch_s.min(1.0))
        } else {
            Duration::ZERO
        };
        batch.min(self.rtt / 8).max(self.recv_coalesce)
    }

    /// The ACK frequency this side asks its peer for, `None` when the extension is off: the
    /// threshold, a maximum ACK delay of a quarter RTT (1–25 ms, so that a flight's tail is
    /// acknowledged well within the RTT), and a reordering threshold of 2 (quinn's packet
    /// threshold minus one, so a loss is still reported at once).
    pub fn ack_frequency(&self) -> Option<AckFrequencyConfig> {
        if self.defaults_only || self.ack_eliciting_threshold == 0 {
            return None;
        }
        let mut af = AckFrequencyConfig::default();
        af.ack_eliciting_threshold(VarInt::from_u32(self.ack_eliciting_threshold));
        af.max_ack_delay(Some((self.rtt / 4).clamp(Duration::from_millis(1), Duration::from_millis(25))));
        af.reordering_threshold(VarInt::from_u32(2));
        Some(af)
    }

    /// The quinn transport configuration.
    pub fn transport(&self) -> TransportConfig {
        let mut t = TransportConfig::default();
        let idle =
            IdleTimeout::try_from(self.idle_timeout).unwrap_or(IdleTimeout::from(VarInt::from_u32(10_000)));
        t.max_idle_timeout(Some(idle));
        t.keep_alive_interval(Some(self.idle_timeout / 3));
        t.max_concurrent_uni_streams(VarInt::from_u32((self.streams * 4).max(64)));
        if self.defaults_only {
            return t;
        }
        let conn = self.connection_window();
        t.receive_window(VarInt::from_u64(conn).unwrap_or(VarInt::MAX));
        t.send_window(conn);
        t.stream_receive_window(VarInt::from_u64(self.stream_window()).unwrap_or(VarInt::MAX));
        t.initial_rtt(self.rtt.max(Duration::from_micros(100)));
        t.enable_segmentation_offload(true);
        if let Some(af) = self.ack_frequency() {
            t.ack_frequency_config(Some(af));
        }
        let iw = self.initial_window();
        match self.congestion {
            Congestion::Cubic => {
                let mut c = CubicConfig::default();
                c.initial_window(iw);
                t.congestion_controller_factory(Arc::new(c));
            }
            Congestion::Bbr => {
                let mut c = BbrConfig::default();
                c.initial_window(iw);
                t.congestion_controller_factory(Arc::new(c));
            }
            Congestion::NewReno => {
                let mut c = NewRenoConfig::default();
                c.initial_window(iw);
                t.congestion_controller_factory(Arc::new(c));
            }
            Congestion::Tolerant => {
                let c = TolerantConfig {
                    initial_window: iw,
                    loss_tolerance: self.loss_tolerance,
                    ..TolerantConfig::default()
                };
                t.congestion_controller_factory(Arc::new(c));
            }
        }
        t
    }
}

/// Binds a UDP socket with large buffers. As root, `SO_*BUFFORCE` lifts the `rmem_max` /
/// `wmem_max` caps; otherwise the kernel clamps and the achieved sizes are returned.
pub fn bind_udp(addr: SocketAddr, buffer_bytes: usize) -> std::io::Result<(UdpSocket, usize, usize)> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    if buffer_bytes > 0 {
        let _ = s.set_recv_buffer_size(buffer_bytes);
        let _ = s.set_send_buffer_size(buffer_bytes);
        force_buffer(&s, buffer_bytes);
    }
    s.bind(&addr.into())?;
    let (r, w) = (s.recv_buffer_size()?, s.send_buffer_size()?);
    Ok((s.into(), r, w))
}

pub(crate) fn force_buffer(s: &socket2::Socket, bytes: usize) {
    use std::os::fd::AsRawFd;
    let v: libc::c_int = bytes.min(i32::MAX as usize / 2) as libc::c_int;
    for opt in [libc::SO_RCVBUFFORCE, libc::SO_SNDBUFFORCE] {
        // SAFETY: `s` is a live socket owned by the caller for the duration of the call; we
        // pass a pointer to a local c_int and its exact size, as setsockopt(2) requires. Failure
        // (not root) is harmless: the plain SO_*BUF setting above stays in effect.
        let _ = unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
    }
}

/// The QUIC server configuration for `identity` under `policy`, tuned by `tuning` (the owner
/// driver's at start, the node's on a TLS reload).
pub(crate) fn quic_server_config(
    identity: &TlsIdentity,
    policy: &TrustPolicy,
    tuning: &LinkTuning,
) -> Result<quinn::ServerConfig, IdentityError> {
    let tls = server_crypto(identity, policy)?;
    let quic = QuicServerConfig::try_from(tls).map_err(|e| IdentityError::Config(e.to_string()))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(quic));
    server.transport_config(Arc::new(tuning.transport()));
    Ok(server)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_controller_reads_back_its_name_and_builds_a_transport() {
        for c in [Congestion::Cubic, Congestion::Bbr, Congestion::NewReno, Congestion::Tolerant] {
            assert_eq!(Congestion::parse(c.name()), Some(c));
            assert_eq!(Congestion::parse(&c.name().to_ascii_uppercase()), Some(c));
            let _ = LinkTuning { congestion: c, ..LinkTuning::default() }.transport();
        }
        assert_eq!(Congestion::parse("loss-tolerant"), Some(Congestion::Tolerant));
        assert_eq!(Congestion::parse("vegas"), None);
    }

    #[test]
    fn windows_follow_the_bdp() {
        // 1 Gbit/s × 150 ms = 18.75 MB BDP.
        let t = LinkTuning {
            bandwidth_bps: 1e9,
            rtt: Duration::from_millis(150),
            streams: 4,
            ..LinkTuning::default()
        };
        assert_eq!(t.bdp_bytes(), 18_750_000);
        assert_eq!(t.connection_window(), 37_500_000);
        assert_eq!(t.stream_window(), 16 * MIB);
        // Controllers that ride through random loss get room for the data behind loss holes.
        for c in [Congestion::Tolerant, Congestion::Bbr] {
            let t = LinkTuning { congestion: c, ..t };
            assert_eq!((t.connection_window(), t.stream_window()), (75_000_000, 18_750_000));
        }
        assert_eq!(t.initial_window(), 18_750_000);
        // A 100 Gbit/s path: the initial window stops at 32 MiB.
        assert_eq!(LinkTuning { bandwidth_bps: 100e9, ..t }.initial_window(), 32 * MIB);
        // 100 Mbit/s × 20 ms: windows never below 16 MiB, the initial window is the BDP.
        let t = LinkTuning { bandwidth_bps: 100e6, rtt: Duration::from_millis(20), ..LinkTuning::default() };
        assert_eq!(t.connection_window(), 16 * MIB);
        assert_eq!(t.initial_window(), 250_000);
        // A thin, short path: never below 64 KiB.
        assert_eq!(LinkTuning { rtt: Duration::from_millis(1), ..t }.initial_window(), 64 << 10);
    }

    #[test]
    fn quic_streams_and_tcp_connections_follow_the_rate_up_to_the_setting() {
        let tuning = |gbps: f64, streams: u32| LinkTuning {
            bandwidth_bps: gbps * 1e9,
            streams,
            ..LinkTuning::default()
        };
        for channels in [LinkTuning::quic_streams, LinkTuning::tcp_connections] {
            let at = |gbps: f64, streams: u32| channels(&tuning(gbps, streams));
            assert_eq!(at(0.1, 4), 1);
            assert_eq!(at(0.25, 4), 1);
            assert_eq!(at(0.3, 4), 2);
            assert_eq!(at(1.0, 4), 4);
            assert_eq!(at(10.0, 4), 4);
            assert_eq!(at(10.0, 64), 40);
            assert_eq!(at(1.0, 1), 1);
            assert_eq!(at(1.0, 0), 1);
            for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
                let n = at(bad, 4);
                assert!((1..=4).contains(&n), "{bad}: {n}");
            }
            // Monotone in the rate, never above the setting.
            let mut last = 0;
            for mbps in (0..20_000).step_by(50) {
                let n = at(f64::from(mbps) / 1e3, 8);
                assert!(n >= last && n <= 8, "{mbps}: {n}");
                last = n;
            }
        }
    }

    #[test]
    fn ack_frequency_and_coalescing_follow_the_settings() {
        let t = LinkTuning { rtt: Duration::from_millis(50), ..LinkTuning::default() };
        assert!(t.ack_frequency().is_some());
        assert_eq!(t.recv_hold(), DEFAULT_RECV_COALESCE);
        // Off when asked, on short round trips, and never for quinn's defaults.
        assert!(LinkTuning { ack_eliciting_threshold: 0, ..t }.ack_frequency().is_none());
        assert_eq!(LinkTuning { rtt: Duration::from_millis(2), ..t }.recv_hold(), Duration::ZERO);
        assert_eq!(LinkTuning { recv_coalesce: Duration::ZERO, ..t }.recv_hold(), Duration::ZERO);
        // Slow links hold longer, up to an eighth of the round trip; never below the setting.
        let slow = LinkTuning { bandwidth_bps: 100e6, rtt: Duration::from_millis(20), ..t };
        assert_eq!(slow.recv_hold(), Duration::from_micros(2500));
        let slow_far = LinkTuning { rtt: Duration::from_millis(200), ..slow };
        let want = 32.0 * 1452.0 * 8.0 / 100e6;
        assert!((slow_far.recv_hold().as_secs_f64() - want).abs() < 1e-6, "{:?}", slow_far.recv_hold());
        let fast = LinkTuning { bandwidth_bps: 1e9, rtt: Duration::from_millis(50), ..t };
        assert_eq!(fast.recv_hold(), DEFAULT_RECV_COALESCE);
        assert_eq!(LinkTuning { bandwidth_bps: 0.0, ..fast }.recv_hold(), DEFAULT_RECV_COALESCE);
        // Monotone: a slower link never holds shorter.
        let mut last = Duration::MAX;
        for mbps in (10..20_000).step_by(10) {
            let h = LinkTuning { bandwidth_bps: f64::from(mbps) * 1e6, ..slow }.recv_hold();
            assert!(h <= last && h >= DEFAULT_RECV_COALESCE && h <= slow.rtt / 8, "{mbps}: {h:?}");
            last = h;
        }
        let d = LinkTuning::quinn_defaults();
        assert!(d.ack_frequency().is_none());
        assert_eq!(d.recv_hold(), Duration::ZERO);
    }

    #[test]
    fn sockets_get_big_buffers() {
        let (_s, r, w) = bind_udp("127.0.0.1:0".parse().unwrap(), 8 << 20).unwrap();
        // Linux reports double the requested value; without root we may be clamped.
        assert!(r > 0 && w > 0);
    }
}
