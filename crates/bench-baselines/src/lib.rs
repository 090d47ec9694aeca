//! Baselines for `kvferry bench`: what a user of today's stacks would get on the same emulated
//! WAN link (`kvferry-wanem`), in the same run as kvferry's own transfer.
//!
//! Data always flows from side A (the source region, 198.18.0.1) to side B (the target,
//! 198.18.0.2). The payload is a deterministic xorshift64 stream ([`Pattern`]); the receiver
//! regenerates it and compares every byte as it arrives (`verified`).
//!
//! - [`quinn_defaults`]: one QUIC connection with mutual TLS (kvferry's dev PKI and rustls
//!   configuration), quinn's default `TransportConfig` and `EndpointConfig`, the kernel's
//!   default UDP socket buffers, one unidirectional stream carrying the payload.
//! - [`tcp_tls`]: one TCP connection, TLS 1.3 with mutual authentication (same rustls
//!   configuration, aws-lc-rs), no socket options at all (kernel autotuning; the emulator's
//!   namespaces allow `tcp_{r,w}mem` up to 64 MiB), tokio + tokio-rustls.
//! - [`kvferry_quic`] and [`kvferry_tcp`]: kvferry's own peer transport (two `PeerNode`s, no
//!   daemon) at the baselines' size, over QUIC and over TLS 1.3 + TCP (BBR where the kernel has
//!   it, 4 connections): the transport choice measured beside the stacks it replaces.
//! - [`nixl_ucx_tcp`]: two processes (`kvferry-nixl-baseline`, one per namespace), each with a
//!   NIXL agent and its UCX backend restricted to TCP (`UCX_TLS=tcp`,
//!   `UCX_NET_DEVICES=kvf0`); the target READs the source's DRAM buffer in one request.
//!   Metadata is relayed over the children's stdin/stdout; only the payload crosses the link.
//!
//! **Timing**: `wall_s` runs from the receiver's first action (connect for quinn/TCP, loading
//! the peer's metadata for NIXL) to its last byte verified, handshakes included.
//! **CPU**: quinn and TCP run each side on its own OS thread with a `current_thread` tokio
//! runtime (so quinn's endpoint driver, rustls and the verification all run on that thread) and
//! report `getrusage(RUSAGE_THREAD)` deltas over the transfer; NIXL's children report
//! `getrusage(RUSAGE_SELF)` deltas (every thread of the process, UCX's and NIXL's progress
//! threads included) over the transfer window, excluding agent set-up and the buffer fill.
//! Kernel network processing that runs in softirq context (for example TCP ACK-clocked
//! transmits triggered when the emulator writes an ACK into a TUN) is billed to whichever
//! thread the kernel interrupted, often the emulator's forwarders: in-kernel CPU is undercounted
//! for the socket baselines. The sender's payload is generated before the clock starts (it is
//! held in memory whole); the receiver's verification is inside its measured CPU and wall time.
//!
//! The NIXL baseline needs the `kvferry-nixl-baseline` binary of this crate (found through
//! `$KVFERRY_NIXL_BASELINE_BIN`, else next to the current executable or one directory up) and
//! NIXL at run time (`source deploy/install-nixl.sh`); without either it returns a
//! `skipped: <reason>` run. A binary that cannot ship a second executable can re-execute itself
//! and call [`nixl_peer::peer_main`], pointing `$KVFERRY_NIXL_BASELINE_BIN` at a wrapper.

use std::time::Duration;

mod kvferry;
mod nixl;
#[cfg(feature = "nixl")]
pub mod nixl_peer;
mod pair;
mod quic;
mod tcp;

pub use kvferry::{kvferry_quic, kvferry_tcp};
pub use nixl::{BIN_ENV as NIXL_BIN_ENV, OP_ENV as NIXL_OP_ENV, nixl_ucx_tcp};
pub use quic::quinn_defaults;
pub use tcp::tcp_tls;

/// One baseline measurement.
#[derive(Debug, Clone, PartialEq)]
pub struct BaselineRun {
    /// `quinn-defaults`, `tcp-tls`, `nixl-ucx-tcp`, `kvferry-quic` or `kvferry-tcp`.
    pub name: &'static str,
    /// Payload bytes moved (0 when skipped).
    pub bytes: u64,
    /// Receiver's wall time from its first request/connect to its last byte verified.
    pub wall_s: f64,
    /// `bytes * 8 / wall_s` (0 when skipped).
    pub goodput_bps: f64,
    /// CPU seconds (user + system) of the sending side over the transfer.
    pub cpu_s_sender: f64,
    /// CPU seconds (user + system) of the receiving side over the transfer.
    pub cpu_s_receiver: f64,
    /// Every byte arrived and matched the sender's pattern.
    pub verified: bool,
    /// How it was set up; `skipped: <reason>` when the baseline could not run here.
    pub note: String,
}

impl BaselineRun {
    /// A result for a baseline that could not run here (not an error: e.g. NIXL not installed).
    pub fn skipped(name: &'static str, reason: impl std::fmt::Display) -> Self {
        Self {
            name,
            bytes: 0,
            wall_s: 0.0,
            goodput_bps: 0.0,
            cpu_s_sender: 0.0,
            cpu_s_receiver: 0.0,
            verified: false,
            note: format!("skipped: {reason}"),
        }
    }

    /// Whether this run was skipped rather than measured.
    pub fn is_skipped(&self) -> bool {
        self.note.starts_with("skipped:")
    }
}

/// Seed of the payload stream (any non-zero value; both sides use the same).
pub const PATTERN_SEED: u64 = 0x9E37_79B9_7F4A_7C15;

/// A deterministic pseudo-random byte stream (xorshift64, little-endian words), produced and
/// checked incrementally in pieces of any size.
#[derive(Debug, Clone)]
pub struct Pattern {
    state: u64,
    word: [u8; 8],
    /// Bytes of `word` already used (8 = none left).
    used: usize,
}

impl Pattern {
    /// A stream starting at `seed` (0 is replaced by [`PATTERN_SEED`]: xorshift needs non-zero).
    pub fn new(seed: u64) -> Self {
        Self { state: if seed == 0 { PATTERN_SEED } else { seed }, word: [0; 8], used: 8 }
    }

    #[inline]
    fn next_word(&mut self) -> u64 {
        let mut x = self.state;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.state = x;
        x
    }

    /// Writes the next `out.len()` bytes of the stream into `out`.
    pub fn fill(&mut self, out: &mut [u8]) {
        let mut out = out;
        while self.used < 8 && !out.is_empty() {
            out[0] = self.word[self.used];
            self.used += 1;
            out = &mut out[1..];
        }
        let mut words = out.chunks_exact_mut(8);
        for w in &mut words {
            let v = self.next_word();
            w.copy_from_slice(&v.to_le_bytes());
        }
        let tail = words.into_remainder();
        if !tail.is_empty() {
            self.word = self.next_word().to_le_bytes();
            let n = tail.len();
            tail.copy_from_slice(&self.word[..n]);
            self.used = n;
        }
    }

    /// Whether `got` equals the next `got.len()` bytes of the stream (consumes them either way).
    pub fn check(&mut self, got: &[u8]) -> bool {
        let mut got = got;
        let mut ok = true;
        while self.used < 8 && !got.is_empty() {
            ok &= got[0] == self.word[self.used];
            self.used += 1;
            got = &got[1..];
        }
        let words = got.chunks_exact(8);
        let tail = words.remainder();
        let mut diff = 0u64;
        for w in words {
            let mut b = [0u8; 8];
            b.copy_from_slice(w);
            diff |= u64::from_le_bytes(b) ^ self.next_word();
        }
        ok &= diff == 0;
        if !tail.is_empty() {
            self.word = self.next_word().to_le_bytes();
            let n = tail.len();
            ok &= tail == &self.word[..n];
            self.used = n;
        }
        ok
    }
}

/// User + system CPU seconds of the calling thread (`RUSAGE_THREAD`) or process
/// (`RUSAGE_SELF`).
pub fn cpu_seconds(who: libc::c_int) -> f64 {
    // SAFETY: getrusage writes one `rusage` into memory we own and have zero-initialised
    // (an all-zero rusage is a valid value); `who` is RUSAGE_SELF or RUSAGE_THREAD.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(who, &mut ru);
        ru
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// CPU seconds of the calling thread.
pub(crate) fn thread_cpu() -> f64 {
    cpu_seconds(libc::RUSAGE_THREAD)
}

/// How long a transfer of `bytes` over `emu`'s A→B link may take before it is declared hung:
/// max(60 s, 20 × the expected time at the link rate plus a few RTTs).
pub fn transfer_timeout(emu: &kvferry_wanem::Emulator, bytes: u64) -> Duration {
    let ab = &emu.config().path.ab;
    let ba = &emu.config().path.ba;
    let rate = ab.rate_bps.unwrap_or(1_000_000_000).max(1) as f64;
    let rtt = (ab.one_way_delay + ba.one_way_delay + ab.jitter + ba.jitter).as_secs_f64();
    let expected = bytes as f64 * 8.0 / rate + 10.0 * rtt;
    Duration::from_secs_f64((20.0 * expected).clamp(60.0, 3600.0))
}

/// Fills `run`'s goodput from its bytes and wall time.
pub(crate) fn finish(mut run: BaselineRun) -> BaselineRun {
    run.goodput_bps = if run.wall_s > 0.0 { run.bytes as f64 * 8.0 / run.wall_s } else { 0.0 };
    run
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_pieces_match_whole() {
        let mut whole = vec![0u8; 1003];
        Pattern::new(7).fill(&mut whole);
        assert!(whole.iter().any(|&b| b != 0));
        let mut p = Pattern::new(7);
        let mut pieces = vec![0u8; 1003];
        let mut at = 0;
        for n in [1, 3, 8, 13, 0, 64, 5, 909] {
            p.fill(&mut pieces[at..at + n]);
            at += n;
        }
        assert_eq!(at, 1003);
        assert_eq!(whole, pieces);
        let mut c = Pattern::new(7);
        let mut at = 0;
        for n in [5, 8, 1, 700, 289] {
            assert!(c.check(&whole[at..at + n]));
            at += n;
        }
        let mut bad = whole.clone();
        bad[500] ^= 1;
        let mut c = Pattern::new(7);
        assert!(c.check(&bad[..100]));
        assert!(!c.check(&bad[100..]));
    }
}
