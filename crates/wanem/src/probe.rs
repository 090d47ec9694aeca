//! Measurements across an emulated path, for the fidelity tests, the ceiling example and a
//! future `kvferry wan --selftest`: UDP echo RTT, one bulk TCP stream, UDP datagram loss.
//!
//! All sockets live inside the emulator's namespaces and use only its addresses; every wait
//! is bounded.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::emulator::{Emulator, Side};
use crate::error::{Result, WanemError};

fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> WanemError {
    move |source| WanemError::Sys { what, source }
}

fn join<T>(h: std::thread::JoinHandle<Result<T>>) -> Result<T> {
    h.join().map_err(|_| WanemError::Thread("probe thread panicked".into()))?
}

/// Round-trip times of UDP echoes.
#[derive(Debug, Clone)]
pub struct RttReport {
    /// One sample per answered probe, in order.
    pub samples: Vec<Duration>,
    /// Probes that got no answer in time.
    pub unanswered: usize,
}

impl RttReport {
    fn sorted(&self) -> Vec<Duration> {
        let mut v = self.samples.clone();
        v.sort();
        v
    }
    /// Median sample (zero if none).
    pub fn median(&self) -> Duration {
        self.sorted().get(self.samples.len() / 2).copied().unwrap_or_default()
    }
    /// Mean sample (zero if none).
    pub fn mean(&self) -> Duration {
        let n = self.samples.len().max(1) as u32;
        self.samples.iter().sum::<Duration>() / n
    }
    /// Smallest sample.
    pub fn min(&self) -> Duration {
        self.samples.iter().min().copied().unwrap_or_default()
    }
    /// Largest sample.
    pub fn max(&self) -> Duration {
        self.samples.iter().max().copied().unwrap_or_default()
    }
}

/// Sends `count` UDP probes from `from` to an echo server on the other side, one every `gap`
/// (after the previous answer), and times the answers. The first probe is a warm-up and is
/// not counted.
pub fn udp_rtt(emu: &Emulator, from: Side, count: usize, gap: Duration) -> Result<RttReport> {
    let to = from.peer();
    let server = emu.run_in(to, || UdpSocket::bind((emu.addr(to), 0)))?.map_err(io("bind"))?;
    let server_addr = server.local_addr().map_err(io("local_addr"))?;
    server.set_read_timeout(Some(Duration::from_millis(50))).map_err(io("timeout"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    let echo = std::thread::spawn(move || -> Result<()> {
        let mut buf = [0u8; 64];
        while !stop2.load(Ordering::Relaxed) {
            if let Ok((n, peer)) = server.recv_from(&mut buf) {
                let _ = server.send_to(&buf[..n], peer);
            }
        }
        Ok(())
    });
    let client = emu.run_in(from, || UdpSocket::bind((emu.addr(from), 0)))?.map_err(io("bind"))?;
    let result = rtt_client(&client, server_addr, count, gap);
    stop.store(true, Ordering::Relaxed);
    join(echo)?;
    result
}

fn rtt_client(sock: &UdpSocket, to: SocketAddr, count: usize, gap: Duration) -> Result<RttReport> {
    let mut report = RttReport { samples: Vec::with_capacity(count), unanswered: 0 };
    let mut buf = [0u8; 64];
    for seq in 0..=count as u64 {
        let sent = Instant::now();
        sock.send_to(&seq.to_le_bytes(), to).map_err(io("send"))?;
        let deadline = sent + Duration::from_secs(2);
        let answered = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break false;
            }
            sock.set_read_timeout(Some(left)).map_err(io("timeout"))?;
            match sock.recv_from(&mut buf) {
                Ok((8, _)) if buf[..8] == seq.to_le_bytes() => break true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break false,
            }
        };
        let rtt = sent.elapsed();
        match (answered, seq) {
            (_, 0) => {}
            (true, _) => report.samples.push(rtt),
            (false, _) => report.unanswered += 1,
        }
        std::thread::sleep(gap);
    }
    Ok(report)
}

/// One bulk TCP stream's result.
#[derive(Debug, Clone, Copy)]
pub struct TcpReport {
    /// Application bytes received in the measured window.
    pub bytes: u64,
    /// The measured window (after warm-up), seconds.
    pub secs: f64,
    /// Application goodput over the window, bit/s.
    pub goodput_bps: f64,
    /// IP bytes the emulator forwarded in the sending direction over the window, bit/s.
    pub ip_bps: f64,
}

/// Sends one TCP stream from `from` to the other side for `duration`, measuring over the
/// part after `warmup` (slow start excluded).
pub fn tcp_bulk(emu: &Emulator, from: Side, duration: Duration, warmup: Duration) -> Result<TcpReport> {
    let to = from.peer();
    let listener = emu.run_in(to, || TcpListener::bind((emu.addr(to), 0)))?.map_err(io("listen"))?;
    let addr = listener.local_addr().map_err(io("local_addr"))?;
    let mut client = emu
        .run_in(from, || TcpStream::connect_timeout(&addr, Duration::from_secs(5)))?
        .map_err(io("connect"))?;
    let (mut server, _) = listener.accept().map_err(io("accept"))?;
    server.set_read_timeout(Some(Duration::from_secs(2))).map_err(io("timeout"))?;
    client.set_write_timeout(Some(Duration::from_secs(2))).map_err(io("timeout"))?;
    let start = Instant::now();
    let end = start + duration;
    let sender = std::thread::spawn(move || -> Result<()> {
        let chunk = vec![0x5au8; 128 * 1024];
        while Instant::now() < end {
            if client.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = client.shutdown(std::net::Shutdown::Both);
        Ok(())
    });
    let pick = |s: crate::Stats| match from {
        Side::A => s.ab.tx_bytes,
        Side::B => s.ba.tx_bytes,
    };
    let mut buf = vec![0u8; 256 * 1024];
    let (mut total, mut at_warm) = (0u64, None);
    let (mut last_t, mut last_total) = (start, 0u64);
    let mut ip_warm = 0;
    loop {
        let now = Instant::now();
        if at_warm.is_none() && now >= start + warmup {
            at_warm = Some((now, total));
            ip_warm = pick(emu.stats());
        }
        if now >= end {
            break;
        }
        match server.read(&mut buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Ok(0) | Err(_) => break,
            Ok(n) => {
                total += n as u64;
                (last_t, last_total) = (Instant::now(), total);
            }
        }
    }
    let ip_end = pick(emu.stats());
    drop(server);
    join(sender)?;
    let (t0, b0) = at_warm.ok_or_else(|| WanemError::Thread("stream ended in warm-up".into()))?;
    let secs = (last_t - t0).as_secs_f64().max(1e-9);
    let bytes = last_total - b0;
    Ok(TcpReport {
        bytes,
        secs,
        goodput_bps: bytes as f64 * 8.0 / secs,
        ip_bps: (ip_end - ip_warm) as f64 * 8.0 / secs,
    })
}

/// UDP loss across the path.
#[derive(Debug, Clone, Copy)]
pub struct LossReport {
    /// Datagrams sent.
    pub sent: u64,
    /// Distinct datagrams received.
    pub received: u64,
    /// The emulator's count of packets it dropped by random loss in that direction.
    pub emulator_lost: u64,
    /// The emulator's count of queue drops in that direction.
    pub emulator_queue_drops: u64,
    /// Datagrams that arrived after one with a higher sequence number.
    pub out_of_order: u64,
    /// Kernel drops outside the model during the run: TUN transmit drops at the sender's end
    /// plus TUN receive drops and UDP receive-buffer overflows at the receiver's end.
    pub kernel_drops: u64,
}

impl LossReport {
    /// Measured loss fraction.
    pub fn loss(&self) -> f64 {
        (self.sent - self.received) as f64 / self.sent.max(1) as f64
    }
}

/// Sends `count` numbered datagrams from `from`, paced in small bursts so that neither the
/// emulator's queue nor the receiving socket overflows, and counts what arrives.
pub fn udp_loss(emu: &Emulator, from: Side, count: u64) -> Result<LossReport> {
    let to = from.peer();
    let before = emu.stats();
    let kernel = |emu: &Emulator| -> Result<u64> {
        let (f, t) = (emu.kernel_counters(from)?, emu.kernel_counters(to)?);
        Ok(f.tun_tx_dropped + t.tun_rx_dropped + t.udp_rcvbuf_errors)
    };
    let kernel_before = kernel(emu)?;
    let rx = emu.run_in(to, || UdpSocket::bind((emu.addr(to), 0)))?.map_err(io("bind"))?;
    crate::sys::force_rcvbuf(&rx, 16 << 20);
    let rx_addr = rx.local_addr().map_err(io("local_addr"))?;
    rx.set_read_timeout(Some(Duration::from_millis(50))).map_err(io("timeout"))?;
    let done = Arc::new(AtomicBool::new(false));
    let done2 = Arc::clone(&done);
    let receiver = std::thread::spawn(move || -> Result<(u64, u64)> {
        let mut seen = vec![false; count as usize];
        let (mut received, mut out_of_order, mut highest) = (0u64, 0u64, None);
        let mut buf = [0u8; 64];
        let hard_stop = Instant::now() + Duration::from_secs(30);
        let mut quiet_since: Option<Instant> = None;
        while Instant::now() < hard_stop {
            match rx.recv(&mut buf) {
                Ok(n) if n >= 8 => {
                    quiet_since = None;
                    let seq = u64::from_le_bytes(buf[..8].try_into().unwrap_or([0xff; 8]));
                    if let Some(s) = seen.get_mut(seq as usize)
                        && !*s
                    {
                        *s = true;
                        received += 1;
                        if highest.is_some_and(|h| seq < h) {
                            out_of_order += 1;
                        }
                        highest = highest.max(Some(seq));
                    }
                }
                _ => {
                    if done2.load(Ordering::Relaxed) {
                        let q = *quiet_since.get_or_insert_with(Instant::now);
                        if q.elapsed() > Duration::from_millis(300) {
                            break;
                        }
                    }
                }
            }
        }
        Ok((received, out_of_order))
    });
    let tx = emu.run_in(from, || UdpSocket::bind((emu.addr(from), 0)))?.map_err(io("bind"))?;
    let mut payload = [0u8; 32];
    for seq in 0..count {
        payload[..8].copy_from_slice(&seq.to_le_bytes());
        tx.send_to(&payload, rx_addr).map_err(io("send"))?;
        // About 20 000 datagrams/s: gentle enough for a busy two-core machine.
        if seq % 20 == 19 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    done.store(true, Ordering::Relaxed);
    let (received, out_of_order) = join(receiver)?;
    let after = emu.stats();
    let (b, a) = match from {
        Side::A => (before.ab, after.ab),
        Side::B => (before.ba, after.ba),
    };
    Ok(LossReport {
        sent: count,
        received,
        emulator_lost: a.lost - b.lost,
        emulator_queue_drops: a.queue_drops - b.queue_drops,
        out_of_order,
        kernel_drops: kernel(emu)? - kernel_before,
    })
}

/// An unpaced UDP flood's result.
#[derive(Debug, Clone, Copy)]
pub struct FloodReport {
    /// Datagrams the sender handed to its kernel.
    pub sent: u64,
    /// Datagrams the receiver got.
    pub received: u64,
    /// Receiving window, seconds (first to last datagram).
    pub secs: f64,
    /// Received IP bit rate (payload + 28 header bytes).
    pub ip_bps: f64,
}

/// Sends `size`-byte UDP datagrams from `from` as fast as one thread can for `duration` and
/// counts what arrives: the emulator's forwarding ceiling for QUIC-like traffic (drops at
/// the TUN show up in [`Emulator::kernel_counters`]).
pub fn udp_flood(emu: &Emulator, from: Side, duration: Duration, size: usize) -> Result<FloodReport> {
    let to = from.peer();
    let rx = emu.run_in(to, || UdpSocket::bind((emu.addr(to), 0)))?.map_err(io("bind"))?;
    crate::sys::force_rcvbuf(&rx, 32 << 20);
    rx.set_read_timeout(Some(Duration::from_millis(300))).map_err(io("timeout"))?;
    let rx_addr = rx.local_addr().map_err(io("local_addr"))?;
    let receiver = std::thread::spawn(move || -> Result<(u64, Option<(Instant, Instant)>)> {
        let mut buf = vec![0u8; 65536];
        let (mut n, mut span) = (0u64, None::<(Instant, Instant)>);
        let hard_stop = Instant::now() + duration + Duration::from_secs(5);
        while Instant::now() < hard_stop {
            match rx.recv(&mut buf) {
                Ok(_) => {
                    n += 1;
                    let now = Instant::now();
                    span = Some(span.map_or((now, now), |(a, _)| (a, now)));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        Ok((n, span))
    });
    let tx = emu.run_in(from, || UdpSocket::bind((emu.addr(from), 0)))?.map_err(io("bind"))?;
    let payload = vec![0u8; size];
    let (mut sent, end) = (0u64, Instant::now() + duration);
    while Instant::now() < end {
        for _ in 0..64 {
            if tx.send_to(&payload, rx_addr).is_ok() {
                sent += 1;
            }
        }
    }
    let (received, span) = join(receiver)?;
    let secs = span.map_or(0.0, |(a, b)| (b - a).as_secs_f64()).max(1e-9);
    Ok(FloodReport { sent, received, secs, ip_bps: received as f64 * (size as f64 + 28.0) * 8.0 / secs })
}
