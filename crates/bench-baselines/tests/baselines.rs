//! Each baseline over the emulated WAN: the payload arrives verified, at a plausible rate.
//!
//! Needs root and `/dev/net/tun` (the emulator) and, for the NIXL baseline, NIXL at run time
//! (`source deploy/install-nixl.sh`) and the `kvferry-nixl-baseline` binary; without them the
//! tests fail rather than pass vacuously. Tests take turns (a process-wide lock): they share two cores and measure throughput.
//!
//! The `*_1gbit_50ms_64mib` tests (`--ignored`) run each baseline once on `1gbit-50ms` with
//! 64 MiB and print the goodput (informational, not asserted).

use std::sync::{Mutex, MutexGuard};

use kvferry_baselines::{BaselineRun, nixl_ucx_tcp, quinn_defaults, tcp_tls};
use kvferry_wanem::{Emulator, PathProfile, check_support};

static TURN: Mutex<()> = Mutex::new(());

const MIB: u64 = 1 << 20;

fn supported(test: &str) -> MutexGuard<'static, ()> {
    if let Err(e) = check_support() {
        panic!("{test} needs root and /dev/net/tun (this machine kind and CI have both): {e}");
    }
    TURN.lock().unwrap_or_else(|p| p.into_inner())
}

fn show(profile: &str, r: &BaselineRun) {
    eprintln!(
        "{profile} {}: {} bytes in {:.3} s = {:.1} Mbit/s, cpu sender {:.3} s receiver {:.3} s, verified {} ({})",
        r.name,
        r.bytes,
        r.wall_s,
        r.goodput_bps / 1e6,
        r.cpu_s_sender,
        r.cpu_s_receiver,
        r.verified,
        r.note
    );
}

type Baseline = fn(&Emulator, u64) -> anyhow::Result<BaselineRun>;

/// Runs `f` over 100 Mbit/s, 20 ms RTT with 8 MiB and checks it.
fn check(test: &str, f: Baseline, name: &str) -> BaselineRun {
    let _turn = supported(test);
    let profile = PathProfile::preset("100mbit-20ms").expect("preset");
    let link_bps = profile.ab.rate_bps.expect("rate") as f64;
    let emu = Emulator::start_path(profile).expect("emulator");
    let r = f(&emu, 8 * MIB).expect("baseline");
    show("100mbit-20ms", &r);
    assert_eq!(r.name, name);
    assert!(!r.is_skipped(), "{test}: the baseline did not run: {}", r.note);
    assert_eq!(r.bytes, 8 * MIB);
    assert!(r.verified, "payload not verified: {r:?}");
    assert!(r.wall_s > 0.0 && r.goodput_bps > 0.0, "{r:?}");
    assert!(r.goodput_bps < link_bps * 1.1, "faster than the link: {r:?}");
    assert!(r.cpu_s_sender >= 0.0 && r.cpu_s_receiver > 0.0, "{r:?}");
    // The payload crossed the emulated link (A→B), not some other path.
    let ab = emu.stats().ab.tx_bytes;
    assert!(ab >= 8 * MIB, "only {ab} bytes went A→B through the emulator");
    r
}

#[test]
fn quinn_defaults_over_100mbit_20ms() {
    check("quinn_defaults_over_100mbit_20ms", quinn_defaults, "quinn-defaults");
}

#[test]
fn tcp_tls_over_100mbit_20ms() {
    check("tcp_tls_over_100mbit_20ms", tcp_tls, "tcp-tls");
}

#[test]
fn nixl_ucx_tcp_over_100mbit_20ms() {
    check("nixl_ucx_tcp_over_100mbit_20ms", nixl_ucx_tcp, "nixl-ucx-tcp");
}

fn informational(test: &str, f: Baseline) {
    let _turn = supported(test);
    let emu = Emulator::start_path(PathProfile::preset("1gbit-50ms").expect("preset")).expect("emulator");
    let r = f(&emu, 64 * MIB).expect("baseline");
    show("1gbit-50ms", &r);
    let ca = emu.kernel_counters(kvferry_wanem::Side::A).ok();
    let cb = emu.kernel_counters(kvferry_wanem::Side::B).ok();
    eprintln!("  emulator: {:?}\n  kernel counters A: {ca:?}\n  kernel counters B: {cb:?}", emu.stats());
    assert!(r.verified, "{r:?}");
}

#[test]
#[ignore = "informational (1 Gbit/s, 64 MiB, prints goodput): run with --ignored"]
fn quinn_defaults_1gbit_50ms_64mib() {
    informational("quinn_defaults_1gbit_50ms_64mib", quinn_defaults);
}

#[test]
#[ignore = "informational (1 Gbit/s, 64 MiB, prints goodput): run with --ignored"]
fn tcp_tls_1gbit_50ms_64mib() {
    informational("tcp_tls_1gbit_50ms_64mib", tcp_tls);
}

#[test]
#[ignore = "informational (1 Gbit/s, 64 MiB, prints goodput): run with --ignored"]
fn nixl_ucx_tcp_1gbit_50ms_64mib() {
    informational("nixl_ucx_tcp_1gbit_50ms_64mib", nixl_ucx_tcp);
}
