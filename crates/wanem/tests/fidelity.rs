//! Fidelity and clean-up tests of the emulator against its own configuration.
//!
//! They need root and `/dev/net/tun` (this machine kind and CI have both); without them they
//! fail rather than pass vacuously. Each test creates its own uniquely named
//! namespaces; they still take turns (a process-wide lock) so that one test's traffic does not
//! perturb another's timing on a small machine. Every wait is bounded; the file runs in ~10 s.

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use kvferry_wanem::probe::{tcp_bulk, udp_loss, udp_rtt};
use kvferry_wanem::{Emulator, EmulatorConfig, LinkProfile, PathProfile, Side, check_support};

static TURN: Mutex<()> = Mutex::new(());

/// The turn (hold the guard for the whole test); fails the test where the emulator cannot run.
fn supported(test: &str) -> MutexGuard<'static, ()> {
    if let Err(e) = check_support() {
        panic!("{test} needs root and /dev/net/tun (this machine kind and CI have both): {e}");
    }
    TURN.lock().unwrap_or_else(|p| p.into_inner())
}

fn listed_namespaces() -> String {
    let out = std::process::Command::new("ip").args(["netns", "list"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn check_rtt(rtt_ms: u64, probes: usize) {
    let profile = PathProfile::symmetric(LinkProfile::with_rtt(100_000_000, Duration::from_millis(rtt_ms)));
    let emu = Emulator::start_path(profile).unwrap();
    let r = udp_rtt(&emu, Side::A, probes, Duration::from_millis(5)).unwrap();
    let target = Duration::from_millis(rtt_ms).as_secs_f64();
    let (median, mean) = (r.median().as_secs_f64(), r.mean().as_secs_f64());
    // Mean without the slowest and fastest 10 %: a shared CI machine can deschedule a thread
    // for tens of milliseconds, which says nothing about the emulator's delay line.
    let mut sorted = r.samples.clone();
    sorted.sort();
    let cut = sorted.len() / 10;
    let kept = &sorted[cut..sorted.len() - cut];
    let trimmed = kept.iter().sum::<Duration>().as_secs_f64() / kept.len() as f64;
    eprintln!(
        "RTT {rtt_ms} ms: n={} min {:.3} median {:.3} mean {:.3} (trimmed {:.3}) max {:.3} ms ({:+.2}% median)",
        r.samples.len(),
        r.min().as_secs_f64() * 1e3,
        median * 1e3,
        mean * 1e3,
        trimmed * 1e3,
        r.max().as_secs_f64() * 1e3,
        (median / target - 1.0) * 100.0
    );
    assert_eq!(r.unanswered, 0);
    assert!((median / target - 1.0).abs() <= 0.05, "median {median} vs {target}");
    assert!((trimmed / target - 1.0).abs() <= 0.05, "trimmed mean {trimmed} vs {target}");
    // Never faster than the configured propagation delay.
    assert!(r.min().as_secs_f64() >= target);
}

#[test]
fn rtt_20ms_within_5_percent() {
    let _turn = supported("rtt_20ms_within_5_percent");
    check_rtt(20, 40);
}

#[test]
fn rtt_100ms_within_5_percent() {
    let _turn = supported("rtt_100ms_within_5_percent");
    check_rtt(100, 15);
}

#[test]
fn tcp_single_stream_100mbit_within_10_percent() {
    let _turn = supported("tcp_single_stream_100mbit_within_10_percent");
    // The best of up to three 3-second measurements: one TCP flow's goodput also depends on
    // the host scheduling its sender, and a CI run (2026-12-03) once measured 73 % with the IP
    // rate at 76 Mbit/s — the flow, not the shaper, fell short — where this test otherwise
    // measures 96–98 %. Every attempt must keep the shaper's own bounds.
    let mut best = 0.0f64;
    for attempt in 1..=3 {
        let emu = Emulator::start_path(PathProfile::preset("100mbit-20ms").unwrap()).unwrap();
        let r = tcp_bulk(&emu, Side::A, Duration::from_secs(4), Duration::from_secs(1)).unwrap();
        let s = emu.stats();
        eprintln!(
            "TCP 100mbit-20ms, attempt {attempt}: goodput {:.2} Mbit/s, IP {:.2} Mbit/s over {:.2} s; queue drops {}",
            r.goodput_bps / 1e6,
            r.ip_bps / 1e6,
            r.secs,
            s.ab.queue_drops
        );
        // The shaper itself must not exceed the configured rate at the IP layer.
        assert!(r.ip_bps <= 100e6 * 1.02, "IP rate {}", r.ip_bps);
        assert!(r.goodput_bps <= 100e6 * 1.10, "goodput {} over the link rate", r.goodput_bps);
        assert_eq!(s.ab.io_errors + s.ba.io_errors, 0);
        // The sender's TSO sends reached the emulator whole and were cut there, as a NIC cuts them.
        assert!(s.ab.segmented > 0, "no TSO send reached the emulator: {:?}", s.ab);
        best = best.max(r.goodput_bps);
        if (best / 100e6 - 1.0).abs() <= 0.10 {
            return;
        }
    }
    panic!("goodput: best of three {best}, not within 10 % of 100 Mbit/s");
}

fn set_udp_opt(sock: &std::net::UdpSocket, opt: libc::c_int, val: libc::c_int) {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid socket and a pointer to a c_int that outlives the call.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_UDP,
            opt,
            (&val as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "setsockopt({opt}): {}", std::io::Error::last_os_error());
}

/// One `UDP_SEGMENT` send of ten datagrams (what quinn's GSO does) reaches the emulator as one
/// packet and is cut into ten wire packets; they are due together, so the emulator hands them
/// on as one GSO packet (GRO). A socket without `UDP_GRO` still reads ten datagrams, intact
/// and in order (its kernel cuts them); one with `UDP_GRO` (quinn's) reads them in one call.
#[test]
fn a_udp_gso_send_arrives_as_its_datagrams() {
    let _turn = supported("a_udp_gso_send_arrives_as_its_datagrams");
    let emu = Emulator::start(LinkProfile::clean(), LinkProfile::clean()).unwrap();
    let (seg, n) = (1200usize, 10usize);
    let tx = emu.run_in(Side::A, || std::net::UdpSocket::bind((emu.addr_a(), 0))).unwrap().unwrap();
    set_udp_opt(&tx, libc::UDP_SEGMENT, seg as libc::c_int);
    let data: Vec<u8> = (0..seg * n).map(|i| (i * 7 % 253) as u8).collect();
    let mut buf = vec![0u8; 65536];
    for gro in [false, true] {
        let rx = emu.run_in(Side::B, || std::net::UdpSocket::bind((emu.addr_b(), 0))).unwrap().unwrap();
        rx.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        if gro {
            set_udp_opt(&rx, libc::UDP_GRO, 1);
        }
        let before = emu.stats().ab;
        assert_eq!(tx.send_to(&data, rx.local_addr().unwrap()).unwrap(), data.len());
        let mut got = Vec::new();
        while got.len() < data.len() {
            let (len, _) = rx.recv_from(&mut buf).expect("a segment did not arrive");
            assert_eq!(len, if gro { seg * n } else { seg }, "UDP_GRO {gro}: bytes per read");
            got.extend_from_slice(&buf[..len]);
        }
        assert_eq!(got, data, "the segments carry the send's bytes in order");
        // The forwarder counts a write after it returns, which may be after the read above.
        let t = std::time::Instant::now();
        while emu.stats().ab.tx_packets < before.tx_packets + n as u64 && t.elapsed() < Duration::from_secs(1)
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let s = emu.stats().ab;
        // (At least: the stack may send a packet of its own on a fresh device.)
        assert!(s.segmented > before.segmented, "the send was not cut: {s:?}");
        assert!(s.coalesced > before.coalesced, "the due run was not coalesced: {s:?}");
        assert!(s.tx_packets - before.tx_packets >= n as u64 && s.io_errors == 0, "{s:?}");
    }
}

#[test]
fn loss_1_percent_within_binomial_tolerance() {
    let _turn = supported("loss_1_percent_within_binomial_tolerance");
    let lossy = LinkProfile { loss: 0.01, ..LinkProfile::clean() };
    let emu = Emulator::start(lossy, LinkProfile::clean()).unwrap();
    let n = 20_000u64;
    let r = udp_loss(&emu, Side::A, n).unwrap();
    let lost = (r.sent - r.received) as f64;
    // Binomial(n, p): mean n p = 200, sd = sqrt(n p (1 - p)) ~ 14.1. A 4.5 sd band fails
    // a correct emulator about once in 150 000 runs: [137, 263] lost, i.e. 0.69 %..1.31 %.
    let (mean, sd) = (n as f64 * 0.01, (n as f64 * 0.01 * 0.99).sqrt());
    eprintln!(
        "loss 1%: sent {} received {} lost {} ({:.3}%), emulator lost {}, kernel drops {}, seed {}",
        r.sent,
        r.received,
        lost,
        r.loss() * 100.0,
        r.emulator_lost,
        r.kernel_drops,
        emu.seed()
    );
    assert_eq!(r.kernel_drops, 0, "drops outside the emulator's model");
    assert!((lost - mean).abs() <= 4.5 * sd, "lost {lost}, expected {mean} ± {}", 4.5 * sd);
    // Every missing datagram was dropped by the loss model, nothing elsewhere.
    assert_eq!(r.sent - r.received, r.emulator_lost);
    assert_eq!(r.emulator_queue_drops, 0);
}

#[test]
fn reverse_direction_is_independent() {
    let _turn = supported("reverse_direction_is_independent");
    // 30 ms one way A->B, 0 ms back: RTT 30 ms from either side.
    let ab = LinkProfile { one_way_delay: Duration::from_millis(30), ..LinkProfile::clean() };
    let emu = Emulator::start(ab, LinkProfile::clean()).unwrap();
    let r = udp_rtt(&emu, Side::B, 10, Duration::from_millis(2)).unwrap();
    let med = r.median().as_secs_f64();
    assert!((med / 0.030 - 1.0).abs() <= 0.05, "median {med}");
}

#[test]
fn drop_removes_namespaces_and_processes() {
    let _turn = supported("drop_removes_namespaces_and_processes");
    let mut cfg = EmulatorConfig::new(PathProfile::preset("clean").unwrap());
    cfg.seed = Some(1);
    let emu = Emulator::with_config(cfg).unwrap();
    let (a, b) = (emu.ns_a().to_owned(), emu.ns_b().to_owned());
    let listed = listed_namespaces();
    assert!(listed.contains(&a) && listed.contains(&b), "{listed}");
    let mut child = emu.command(Side::A, "sleep").arg("30").spawn().unwrap();
    drop(emu);
    let listed = listed_namespaces();
    assert!(!listed.contains(&a) && !listed.contains(&b), "{listed}");
    // The process left inside was killed.
    let status = child.wait().unwrap();
    assert!(!status.success());
}

#[test]
fn jitter_stays_within_its_bounds() {
    let _turn = supported("jitter_stays_within_its_bounds");
    // One-way 10 ms + uniform [0, 4] ms each way: RTT in [20, 28] ms, mean ~24 ms.
    let link = LinkProfile {
        one_way_delay: Duration::from_millis(10),
        jitter: Duration::from_millis(4),
        ..LinkProfile::clean()
    };
    let emu = Emulator::start(link.clone(), link).unwrap();
    let r = udp_rtt(&emu, Side::A, 40, Duration::from_millis(2)).unwrap();
    let mut v: Vec<f64> = r.samples.iter().map(Duration::as_secs_f64).collect();
    v.sort_by(f64::total_cmp);
    // Percentiles rather than extremes: a descheduled thread on a shared machine makes
    // late outliers that are not the emulator's jitter.
    let pct = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    let (min, p10, p50, p90) = (v[0], pct(0.1), pct(0.5), pct(0.9));
    eprintln!("jitter: min {min:.4} p10 {p10:.4} p50 {p50:.4} p90 {p90:.4} s");
    assert!(min >= 0.020, "faster than the propagation delay: {min}");
    assert!(p90 <= 0.0285, "p90 {p90}");
    assert!(p90 - p10 > 0.0015, "no spread: {p10}..{p90}");
    // The sum of two uniform [0, 4] ms draws has median 4 ms.
    assert!((p50 - 0.024).abs() < 0.0025, "median {p50}");
}

#[test]
fn reordering_is_applied_and_nothing_else_is_lost() {
    let _turn = supported("reordering_is_applied_and_nothing_else_is_lost");
    let link = LinkProfile {
        one_way_delay: Duration::from_millis(2),
        reorder: 0.05,
        reorder_extra: Duration::from_millis(2),
        ..LinkProfile::clean()
    };
    let emu = Emulator::start(link, LinkProfile::clean()).unwrap();
    let r = udp_loss(&emu, Side::A, 4000).unwrap();
    let held = emu.stats().ab.reordered;
    eprintln!("reorder 5%: held back {held}, out of order at receiver {}", r.out_of_order);
    assert_eq!(r.received, r.sent);
    // Binomial(4000, 0.05): mean 200, sd ~13.8.
    assert!((130..=270).contains(&held), "held {held}");
    // A held packet arrives after the ones sent in the next 2 ms (~40 at 20k/s), so nearly
    // every one of them is seen out of order.
    assert!(r.out_of_order as f64 >= 0.8 * held as f64, "{} vs {held}", r.out_of_order);
}
