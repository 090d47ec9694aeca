//! Measures what the emulator forwards on this machine: one bulk TCP stream A→B for a few
//! seconds through a profile (default `clean`: no delay, no rate limit), plus the UDP echo
//! RTT through it.
//!
//! ```text
//! cargo run --release -p kvferry-wanem --example ceiling -- [profile] [seconds]
//! ```

use std::time::Duration;

use kvferry_wanem::probe::{tcp_bulk, udp_flood, udp_rtt};
use kvferry_wanem::{Emulator, PathProfile, Side};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let profile = args.next().unwrap_or_else(|| "clean".into());
    let secs: f64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(5.0);
    let emu = Emulator::start_path(PathProfile::parse(&profile)?)?;
    let rtt = udp_rtt(&emu, Side::A, 20, Duration::from_millis(2))?;
    println!(
        "{profile}: UDP echo RTT min {:.3} median {:.3} max {:.3} ms",
        rtt.min().as_secs_f64() * 1e3,
        rtt.median().as_secs_f64() * 1e3,
        rtt.max().as_secs_f64() * 1e3
    );
    let warm = Duration::from_secs_f64((secs / 5.0).max(0.5));
    let before = emu.stats();
    let cpu0 = cpu_seconds();
    let t0 = std::time::Instant::now();
    let r = tcp_bulk(&emu, Side::A, Duration::from_secs_f64(secs), warm)?;
    let wall = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    let s = emu.stats();
    let pkts = s.ab.tx_packets - before.ab.tx_packets;
    println!(
        "{profile}: TCP goodput {:.1} Mbit/s, IP {:.1} Mbit/s ({:.0} pkt/s A->B, {:.0} pkt/s B->A), \
         queue drops {}, process CPU {:.2} cores",
        r.goodput_bps / 1e6,
        r.ip_bps / 1e6,
        pkts as f64 / wall,
        (s.ba.tx_packets - before.ba.tx_packets) as f64 / wall,
        s.ab.queue_drops,
        cpu / wall
    );
    println!("kernel A {:?}\nkernel B {:?}", emu.kernel_counters(Side::A)?, emu.kernel_counters(Side::B)?);
    let k0 = emu.kernel_counters(Side::A)?.tun_tx_dropped;
    let before = emu.stats();
    let cpu0 = cpu_seconds();
    let t0 = std::time::Instant::now();
    let f = udp_flood(&emu, Side::A, Duration::from_secs_f64(secs.min(3.0)), 1400)?;
    let cpu = (cpu_seconds() - cpu0) / t0.elapsed().as_secs_f64();
    let s = emu.stats();
    println!(
        "{profile}: UDP flood 1400 B: sent {} received {} ({:.1}%), {:.1} Mbit/s IP, {:.0} pkt/s; \
         emulator queue drops {}, TUN drops before the emulator {}, process CPU {cpu:.2} cores",
        f.sent,
        f.received,
        f.received as f64 * 100.0 / f.sent.max(1) as f64,
        f.ip_bps / 1e6,
        f.received as f64 / f.secs,
        s.ab.queue_drops - before.ab.queue_drops,
        emu.kernel_counters(Side::A)?.tun_tx_dropped - k0,
    );
    Ok(())
}

/// User + system CPU time of this process, from /proc/self/stat (clock ticks of 10 ms).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // Fields 14 and 15 (utime, stime) are at 11 and 12 after the command name.
    (tick(11) + tick(12)) / 100.0
}
