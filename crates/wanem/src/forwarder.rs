//! One direction's forwarding thread: read IP packets from the ingress TUN, run them through
//! the [`Shaper`], hold them in a delay line and write them to the egress TUN when due.
//!
//! A packet read whole from a TSO/USO send is cut into its wire segments first
//! ([`crate::gso`]); each segment is one packet for the shaper and the delay line. Packets
//! due together that continue one flow leave as one GSO packet (the NIC's GRO,
//! [`crate::gso::Coalescer`]); like a NIC's interrupt moderation, the head of the line may
//! wait a configured hold (default 50 µs) past its due time for the packets behind it.
//!
//! The thread never allocates per packet in steady state: packet buffers come from a free
//! list and go back to it after the write. It sleeps in `ppoll` (1 ns timer slack) until the
//! next delivery or the next arriving packet and never spins: a wake-up that comes late (tens
//! of µs on a virtual machine) delivers late, never early. (It used to wake 100 µs early and
//! `sched_yield` until due; at 1 Gbit/s that kept one of this 2-core host's cores spinning —
//! 40 % of the forwarder's samples were `sched_yield` — taken from the daemons it shapes for.)

use std::cmp::{Ordering as CmpOrdering, Reverse};
use std::collections::{BinaryHeap, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::gso::{Coalescer, Segments};
use crate::shaper::{Shaper, Verdict};
use crate::sys::{self, ReadOutcome};

/// Longest sleep, so that a stop request is seen promptly.
const MAX_IDLE: Duration = Duration::from_millis(20);
/// Packets read in a row before due deliveries are checked again.
const READ_BATCH: usize = 64;
/// Hard cap on bytes held per direction (queue plus delay line), against runaway memory with
/// an unlimited rate and a long delay. Packets beyond it count as queue drops.
const MAX_HELD_BYTES: usize = 512 << 20;

/// Counters of one direction, updated by its forwarding thread.
#[derive(Debug, Default)]
pub(crate) struct DirCounters {
    rx_packets: AtomicU64,
    rx_bytes: AtomicU64,
    tx_packets: AtomicU64,
    tx_bytes: AtomicU64,
    lost: AtomicU64,
    queue_drops: AtomicU64,
    reordered: AtomicU64,
    io_errors: AtomicU64,
    segmented: AtomicU64,
    coalesced: AtomicU64,
    coalesced_packets: AtomicU64,
}

/// A snapshot of one direction's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DirectionStats {
    /// Packets read from the ingress TUN.
    pub rx_packets: u64,
    /// Bytes (IP) read from the ingress TUN.
    pub rx_bytes: u64,
    /// Packets written to the egress TUN (forwarded).
    pub tx_packets: u64,
    /// Bytes (IP) written to the egress TUN.
    pub tx_bytes: u64,
    /// Packets dropped by random loss.
    pub lost: u64,
    /// Packets dropped because the bottleneck queue was full.
    pub queue_drops: u64,
    /// Packets held back for reordering.
    pub reordered: u64,
    /// Failed TUN reads or writes, or packets that could not be segmented (should stay 0).
    pub io_errors: u64,
    /// Packets read whole from a TSO/USO send and cut into segments (each segment counts in
    /// `rx_packets`).
    pub segmented: u64,
    /// GSO packets written to the egress TUN, each carrying a run of one flow's due packets
    /// (GRO; each packet counts in `tx_packets`).
    pub coalesced: u64,
    /// Packets those GSO packets carried.
    pub coalesced_packets: u64,
}

impl DirectionStats {
    /// Packets still inside the emulator (queued or in the delay line).
    pub fn in_flight(&self) -> u64 {
        self.rx_packets.saturating_sub(self.tx_packets + self.lost + self.queue_drops)
    }
}

impl DirCounters {
    pub(crate) fn snapshot(&self) -> DirectionStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DirectionStats {
            rx_packets: g(&self.rx_packets),
            rx_bytes: g(&self.rx_bytes),
            tx_packets: g(&self.tx_packets),
            tx_bytes: g(&self.tx_bytes),
            lost: g(&self.lost),
            queue_drops: g(&self.queue_drops),
            reordered: g(&self.reordered),
            io_errors: g(&self.io_errors),
            segmented: g(&self.segmented),
            coalesced: g(&self.coalesced),
            coalesced_packets: g(&self.coalesced_packets),
        }
    }
}

fn bump(a: &AtomicU64, by: u64) {
    a.fetch_add(by, Ordering::Relaxed);
}

struct Pkt {
    at: Instant,
    /// Bytes in `buf`: the virtio header and the IP packet.
    len: usize,
    buf: Box<[u8]>,
}

/// A held-back packet, ordered for a min-heap on (time, arrival sequence).
struct Held(Reverse<(Instant, u64)>, Pkt);

impl PartialEq for Held {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}
impl Eq for Held {}
impl PartialOrd for Held {
    fn partial_cmp(&self, other: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}
impl Ord for Held {
    fn cmp(&self, other: &Self) -> CmpOrdering {
        self.0.cmp(&other.0)
    }
}

/// Everything one direction's thread owns.
pub(crate) struct Forwarder {
    pub(crate) ingress: Arc<OwnedFd>,
    pub(crate) egress: Arc<OwnedFd>,
    pub(crate) shaper: Shaper,
    pub(crate) counters: Arc<DirCounters>,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) buf_size: usize,
    /// Deliver runs of due packets of one flow as one GSO packet (GRO), holding the line's
    /// head this long past its due time for more to join (a NIC's interrupt moderation);
    /// `None`: every packet on its own, on time.
    pub(crate) coalesce: Option<Duration>,
}

impl Forwarder {
    /// The thread body: forwards until `stop` is set.
    pub(crate) fn run(mut self) {
        sys::precise_timers();
        let mut line: VecDeque<Pkt> = VecDeque::with_capacity(1024);
        let mut held: BinaryHeap<Held> = BinaryHeap::new();
        let mut pool: Vec<Box<[u8]>> = Vec::with_capacity(1024);
        let mut held_bytes = 0usize;
        let mut seq = 0u64;
        let mut scratch = vec![0u8; sys::MAX_GSO_READ].into_boxed_slice();
        let mut gro = Coalescer::new();
        let c = Arc::clone(&self.counters);
        while !self.stop.load(Ordering::Relaxed) {
            // 1. Deliver what is due; runs of one flow's packets go out as one (GRO).
            let now = Instant::now();
            let mut batch_bytes = 0u64;
            let hold = self.coalesce.unwrap_or_default();
            let mut first = true;
            while let Some((due, from_line)) = next_due(&line, &held) {
                // The first of a run waits out the moderation hold; the rest go if due.
                let ready_at = if first && from_line { due + hold } else { due };
                if ready_at > now {
                    break;
                }
                first = false;
                let pkt = if from_line { line.pop_front() } else { held.pop().map(|h| h.1) };
                let Some(pkt) = pkt else { break };
                let bytes = &pkt.buf[..pkt.len];
                let ip_bytes = (pkt.len - sys::VNET_HDR_LEN) as u64;
                held_bytes -= pkt.len;
                if self.coalesce.is_some() && from_line && gro.push(bytes) {
                    batch_bytes += ip_bytes;
                } else {
                    self.flush(&mut gro, &mut batch_bytes);
                    if self.coalesce.is_some() && from_line && gro.push(bytes) {
                        batch_bytes += ip_bytes;
                    } else {
                        self.write(bytes, 1, ip_bytes);
                    }
                }
                pool.push(pkt.buf);
            }
            self.flush(&mut gro, &mut batch_bytes);
            // 2. Take in what has arrived.
            let mut got = 0;
            while got < READ_BATCH {
                match sys::read_packet(self.ingress.as_fd(), &mut scratch) {
                    Ok(ReadOutcome::Packet(0)) | Ok(ReadOutcome::WouldBlock) => break,
                    Ok(ReadOutcome::Packet(n)) if n <= sys::VNET_HDR_LEN => {
                        bump(&c.io_errors, 1);
                    }
                    Ok(ReadOutcome::Packet(n)) => {
                        got += 1;
                        // A TSO/USO send arrives whole; the wire carries (and the shaper
                        // charges) its MTU-sized segments, cut here as a NIC would.
                        let segs = match Segments::new(&scratch[..n]) {
                            Ok(s) => s,
                            Err(_) => {
                                bump(&c.io_errors, 1);
                                continue;
                            }
                        };
                        if segs.is_gso() {
                            bump(&c.segmented, 1);
                        }
                        let arrived = Instant::now();
                        for i in 0..segs.count() {
                            // `len` is the IP packet the link carries; the virtio header
                            // in front of it travels untouched (or rewritten per segment).
                            let len = segs.wire_len(i);
                            bump(&c.rx_packets, 1);
                            bump(&c.rx_bytes, len as u64);
                            let verdict = if held_bytes + len > MAX_HELD_BYTES {
                                Verdict::QueueFull
                            } else {
                                self.shaper.on_packet(arrived, len)
                            };
                            let at = match verdict {
                                Verdict::Lost => {
                                    bump(&c.lost, 1);
                                    continue;
                                }
                                Verdict::QueueFull => {
                                    bump(&c.queue_drops, 1);
                                    continue;
                                }
                                Verdict::Deliver(at) | Verdict::DeliverReordered(at) => at,
                            };
                            let mut buf =
                                pool.pop().unwrap_or_else(|| vec![0u8; self.buf_size].into_boxed_slice());
                            let Some(plen) = segs.write(i, &mut buf) else {
                                // Larger than the MTU the device was given: not a wire packet.
                                bump(&c.io_errors, 1);
                                pool.push(buf);
                                continue;
                            };
                            held_bytes += plen;
                            let pkt = Pkt { at, len: plen, buf };
                            if let Verdict::DeliverReordered(_) = verdict {
                                bump(&c.reordered, 1);
                                seq += 1;
                                held.push(Held(Reverse((at, seq)), pkt));
                            } else {
                                line.push_back(pkt);
                            }
                        }
                    }
                    Err(_) => {
                        bump(&c.io_errors, 1);
                        std::thread::sleep(Duration::from_millis(1));
                        break;
                    }
                }
            }
            if got == READ_BATCH {
                continue;
            }
            // 3. Sleep until the next delivery or the next packet.
            let next = next_due(&line, &held).map(|(t, from_line)| if from_line { t + hold } else { t });
            let now = Instant::now();
            let wait = next.map_or(MAX_IDLE, |t| t.saturating_duration_since(now)).min(MAX_IDLE);
            if wait.is_zero() {
                continue;
            }
            // A timed sleep, never a spin: on a shared host a yielding thread takes a core
            // from the daemons it is shaping for. A late wake-up (tens of µs on a VM)
            // delivers late, never early, and what is due by then leaves as one GRO run.
            sys::wait_readable(self.ingress.as_fd(), wait);
        }
    }
}

impl Forwarder {
    /// Writes one packet to the egress TUN that carries `packets` wire packets of `ip_bytes`.
    fn write(&self, bytes: &[u8], packets: u64, ip_bytes: u64) {
        let c = &self.counters;
        match sys::write_packet(self.egress.as_fd(), bytes) {
            Ok(()) => {
                bump(&c.tx_packets, packets);
                bump(&c.tx_bytes, ip_bytes);
                if packets > 1 {
                    bump(&c.coalesced, 1);
                    bump(&c.coalesced_packets, packets);
                }
            }
            Err(_) => bump(&c.io_errors, 1),
        }
    }

    /// Writes what the coalescer holds, if anything.
    fn flush(&self, gro: &mut Coalescer, batch_bytes: &mut u64) {
        if !gro.is_empty() {
            let n = gro.len() as u64;
            self.write(gro.finish(), n, std::mem::take(batch_bytes));
        }
    }
}

/// The earliest due time across the in-order line and the held-back heap, and whether it is
/// the line's.
fn next_due(line: &VecDeque<Pkt>, held: &BinaryHeap<Held>) -> Option<(Instant, bool)> {
    match (line.front().map(|p| p.at), held.peek().map(|h| h.0.0.0)) {
        (Some(a), Some(b)) => Some(if a <= b { (a, true) } else { (b, false) }),
        (Some(a), None) => Some((a, true)),
        (None, Some(b)) => Some((b, false)),
        (None, None) => None,
    }
}
