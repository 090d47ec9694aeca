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
use quinn::{IdleTimeout, TransportConfig, VarInt};

/// Congestion controllers we can plug in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Congestion {
    /// Loss-based CUBIC (quinn's default).
    Cubic,
    /// Model-based BBR (quinn's implementation is marked experimental).
    Bbr,
    /// Loss-based NewReno.
    NewReno,
}

impl Congestion {
    /// Parses `cubic`, `bbr`, `newreno`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "cubic" => Some(Self::Cubic),
            "bbr" => Some(Self::Bbr),
            "newreno" | "new-reno" | "reno" => Some(Self::NewReno),
            _ => None,
        }
    }

    /// The canonical spelling [`Congestion::parse`] reads back.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cubic => "cubic",
            Self::Bbr => "bbr",
            Self::NewReno => "newreno",
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
    /// Parallel unidirectional streams per transfer.
    pub streams: u32,
    /// Congestion controller.
    pub congestion: Congestion,
    /// Requested UDP socket buffer size (send and receive).
    pub socket_buffer_bytes: usize,
    /// Connection idle timeout.
    pub idle_timeout: Duration,
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
            socket_buffer_bytes: 32 << 20,
            idle_timeout: Duration::from_secs(10),
            defaults_only: false,
        }
    }
}

const MIB: u64 = 1 << 20;

impl LinkTuning {
    /// quinn's defaults, unchanged (the baseline).
    pub fn quinn_defaults() -> Self {
        Self { defaults_only: true, socket_buffer_bytes: 0, ..Self::default() }
    }

    /// Bandwidth-delay product in bytes.
    pub fn bdp_bytes(&self) -> u64 {
        (self.bandwidth_bps / 8.0 * self.rtt.as_secs_f64()).ceil() as u64
    }

    /// Connection-level flow-control window: 2 × BDP, at least 16 MiB, at most 1 GiB.
    pub fn connection_window(&self) -> u64 {
        (2 * self.bdp_bytes()).clamp(16 * MIB, 1024 * MIB)
    }

    /// Per-stream receive window: the connection window shared by the streams, at least 16 MiB.
    pub fn stream_window(&self) -> u64 {
        (self.connection_window() / u64::from(self.streams.max(1)))
            .max(16 * MIB)
            .min(self.connection_window())
    }

    /// Initial congestion window: a quarter BDP, between 1 and 4 MiB (skips most of slow start
    /// on a fat pipe without bursting a thin one).
    pub fn initial_window(&self) -> u64 {
        (self.bdp_bytes() / 4).clamp(MIB, 4 * MIB)
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

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(t.initial_window(), 4 * MIB);
        // 100 Mbit/s × 20 ms: windows never below 16 MiB, initial window at least 1 MiB.
        let t = LinkTuning { bandwidth_bps: 100e6, rtt: Duration::from_millis(20), ..LinkTuning::default() };
        assert_eq!(t.connection_window(), 16 * MIB);
        assert_eq!(t.initial_window(), MIB);
    }

    #[test]
    fn sockets_get_big_buffers() {
        let (_s, r, w) = bind_udp("127.0.0.1:0".parse().unwrap(), 8 << 20).unwrap();
        // Linux reports double the requested value; without root we may be clamped.
        assert!(r > 0 && w > 0);
    }
}
