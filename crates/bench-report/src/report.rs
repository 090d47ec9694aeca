//! The bench's results: plain data, serialised as JSON, rendered as Markdown, and checked for
//! consistency (a report that does not add up fails the bench; timings never do).

use serde::{Deserialize, Serialize};

/// The emulated link a point was measured on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinkSpec {
    /// Preset name, e.g. `1gbit-50ms`.
    pub profile: String,
    /// Bottleneck rate, bits/s (IP bytes).
    pub rate_bps: f64,
    /// Round-trip time, seconds.
    pub rtt_s: f64,
    /// Random loss per direction, fraction (0.001 = 0.1 %).
    pub loss: f64,
}

/// One kvferry fetch of a session of a given size, daemon to daemon through the emulator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransferPoint {
    pub link: LinkSpec,
    /// KV bytes of the session (what the engine pool holds for the prefix).
    pub session_bytes: u64,
    pub tokens: u64,
    /// Wall time of the fetch as the target daemon measured it (receipt), seconds.
    pub wall_s: f64,
    /// Achieved goodput, bits/s (session bytes × 8 / wall).
    pub goodput_bps: f64,
    /// The model's fetch time for these bytes on this link (RTT + bytes / rate), seconds.
    pub model_fetch_s: f64,
    /// The model's goodput (bytes × 8 / model_fetch_s), bits/s.
    pub model_goodput_bps: f64,
    /// What the daemon predicted before moving (from its live estimate), seconds.
    pub daemon_predicted_s: f64,
    /// Time until the first layer had landed, seconds.
    pub first_layer_s: f64,
    /// CPU seconds per GiB moved, source daemon and target daemon.
    pub cpu_s_per_gib_source: f64,
    pub cpu_s_per_gib_target: f64,
    /// Staging memory high-water mark, bytes, source and target.
    pub staging_bytes_source: u64,
    pub staging_bytes_target: u64,
    /// The target engine's load of the fetched blocks into its pool (Engine.Load, on the
    /// engine's next turn): seconds in the target daemon, and the target daemon's CPU seconds
    /// per GiB over that turn. 0 in reports from before 2026-12-06.
    #[serde(default)]
    pub load_s: f64,
    #[serde(default)]
    pub load_cpu_s_per_gib: f64,
    /// Packets the emulator's bottleneck queue dropped during the fetch, source to target
    /// (the congestion controller overrunning the queue); absent in reports from before
    /// 2026-12-06 evening.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_drops: Option<u64>,
    /// The target engine's pool holds byte-identical blocks after loading them.
    pub verified: bool,
}

/// One baseline transfer of `bytes` on the same emulated link.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BaselinePoint {
    pub link: LinkSpec,
    /// `quinn-defaults`, `tcp-tls`, `nixl-ucx-tcp`; kvferry's own transports at the same size:
    /// `kvferry-quic`, `kvferry-tcp`.
    pub name: String,
    pub bytes: u64,
    pub wall_s: f64,
    pub goodput_bps: f64,
    pub cpu_s_sender: f64,
    pub cpu_s_receiver: f64,
    /// The receiver checked every byte it got against what the sender sent.
    pub verified: bool,
    /// Anything the reader should know (e.g. why a baseline could not run).
    pub note: String,
}

/// One decision: the daemon decided from live estimates, then both actions were executed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecisionPoint {
    pub link: LinkSpec,
    pub prefix_tokens: u64,
    /// `fetch`, `recompute` (what the daemon chose under policy auto without split), or
    /// `hedge` (it ran both and kept the first to finish; see [`Self::measured_hedge_s`]).
    pub chosen: String,
    pub predicted_fetch_s: f64,
    pub predicted_recompute_s: f64,
    /// Until the engine can use the prefix: a fetch's migration, then the target engine's load
    /// of the fetched blocks into its pool at its next step ([`Self::fetch_load_s`] of it).
    pub measured_fetch_s: f64,
    pub measured_recompute_s: f64,
    /// The target engine's load of the pure fetch's blocks, inside `measured_fetch_s` (0 in
    /// reports from before it was measured, whose fetches end when the blocks landed).
    #[serde(default)]
    pub fetch_load_s: f64,
    /// The model's crossover on this link, tokens (None: fetch never pays).
    pub modeled_crossover_tokens: Option<f64>,
    /// Executed migrations the daemon's fetch and recompute calibrations had learnt from when
    /// it predicted (0 in reports from before calibration).
    #[serde(default)]
    pub fetch_samples: u32,
    #[serde(default)]
    pub recompute_samples: u32,
    /// The sd of one outcome the daemon gave each prediction (`Candidate.sd_s`; 0 in reports
    /// from before it was recorded, or uncalibrated): its band, judged by [`crate::stats::band_coverage`].
    #[serde(default)]
    pub predicted_fetch_sd_s: f64,
    #[serde(default)]
    pub predicted_recompute_sd_s: f64,
    /// The probability the daemon gave the fetch of coming in a round trip late (its loss
    /// tail, `Candidate.late_probability`; 0 without one, or in reports from before it).
    #[serde(default)]
    pub predicted_fetch_late_p: f64,
    /// For `chosen == "hedge"`: the hedged migration's measured wall seconds (a conversation of
    /// its own, executed after the pure fetch and recompute were measured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_hedge_s: Option<f64>,
    /// For a hedge: the action that finished first (`fetch` or `recompute`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hedge_winner: Option<String>,
}

/// The split measured against both pure actions at one prefix length.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SplitPoint {
    pub link: LinkSpec,
    pub prefix_tokens: u64,
    /// Tokens the split recomputed (the rest were fetched).
    pub split_recompute_tokens: u64,
    pub predicted_split_s: f64,
    /// Both legs, then the engine's load of the fetched part ([`Self::load_s`] of it).
    pub measured_split_s: f64,
    pub measured_fetch_s: f64,
    pub measured_recompute_s: f64,
    /// Each leg's seconds from the split's start until it ended, and what the plan predicted
    /// for it (the daemon's receipt; 0 in reports from before receipts carried them).
    #[serde(default)]
    pub compute_leg_s: f64,
    #[serde(default)]
    pub fetch_leg_s: f64,
    #[serde(default)]
    pub predicted_compute_leg_s: f64,
    #[serde(default)]
    pub predicted_fetch_leg_s: f64,
    /// CPU time the host's hypervisor took from its virtual CPUs during the split (`steal` in
    /// `/proc/stat`, summed over the CPUs); absent where it could not be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_steal_s: Option<f64>,
    /// The target engine's load of the fetched part after both legs, inside
    /// `measured_split_s` (0 in reports from before it was measured).
    #[serde(default)]
    pub load_s: f64,
    /// Packets the emulator's bottleneck queue dropped during the split, source to target;
    /// absent in reports from before 2026-12-06 evening.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_drops: Option<u64>,
}

impl SplitPoint {
    /// Measured ÷ modeled − 1.
    pub fn error(&self) -> f64 {
        self.measured_split_s / self.predicted_split_s - 1.0
    }

    /// The leg that ended last, where the legs were recorded.
    pub fn late_leg(&self) -> Option<Leg> {
        let leg = |name, measured_s: f64, predicted_s: f64| {
            (measured_s > 0.0 && predicted_s > 0.0).then_some(Leg { name, measured_s, predicted_s })
        };
        let c = leg("compute", self.compute_leg_s, self.predicted_compute_leg_s);
        let f = leg("fetch", self.fetch_leg_s, self.predicted_fetch_leg_s);
        match (c, f) {
            (Some(c), Some(f)) => Some(if c.measured_s >= f.measured_s { c } else { f }),
            (c, f) => c.or(f),
        }
    }
}

/// A split the daemon declined as unpredictable, and what it did instead.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeclinedSplit {
    pub link: LinkSpec,
    pub prefix_tokens: u64,
    /// The action taken instead (`fetch` or `recompute`) and its measured seconds.
    pub action: String,
    pub measured_s: f64,
    /// The decision's reason, which carries the declined split's numbers.
    pub reason: String,
}

/// One leg of a split: its measured and its predicted seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Leg {
    /// `compute` or `fetch`.
    pub name: &'static str,
    pub measured_s: f64,
    pub predicted_s: f64,
}

impl Leg {
    /// Measured ÷ predicted − 1.
    pub fn error(&self) -> f64 {
        self.measured_s / self.predicted_s - 1.0
    }
}

/// Decision quality over a set of points (see [`crate::stats::summarize`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecisionSummary {
    pub profile: String,
    pub n: usize,
    /// Share of decisions that picked the faster measured action.
    pub accuracy: f64,
    /// Mean of chosen ÷ best − 1.
    pub mean_regret: f64,
    pub worst_regret: f64,
}

/// Everything one `kvferry bench` run measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BenchReport {
    /// The exact command line.
    pub command: String,
    /// Unix seconds at start.
    pub started_unix: u64,
    /// CPUs, memory, kernel: where it ran.
    pub host: String,
    pub quick: bool,
    pub transfers: Vec<TransferPoint>,
    pub baselines: Vec<BaselinePoint>,
    pub decisions: Vec<DecisionPoint>,
    /// Per profile and overall (`profile == "all"`).
    pub decision_summary: Vec<DecisionSummary>,
    pub splits: Vec<SplitPoint>,
    /// Prefixes where the daemon, allowed to split, declined a split that was faster in
    /// expectation because its time was a coin flip (absent in reports from before 2026-12-06).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub declined_splits: Vec<DeclinedSplit>,
    /// Targets missed and what limits them, and anything else worth reading.
    pub notes: Vec<String>,
    /// One core's ceilings measured at the start of the run (absent in older reports).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceilings: Option<Ceilings>,
}

/// What the unavoidable per-byte work costs one core of the bench's host, CPU seconds per GiB.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Ceilings {
    /// Copying (a 64 MiB buffer, past the caches).
    pub memcpy_s_per_gib: f64,
    /// Sealing with AES-128-GCM in 16 KiB records (aws-lc-rs).
    pub aes128gcm_s_per_gib: f64,
    /// The wire's chunk checksum (XXH3-128).
    pub checksum_s_per_gib: f64,
}

impl Ceilings {
    /// The floor of one side's CPU per GiB: each byte is encrypted (or decrypted), checksummed
    /// and copied once.
    pub fn per_side_floor_s_per_gib(&self) -> f64 {
        self.memcpy_s_per_gib + self.aes128gcm_s_per_gib + self.checksum_s_per_gib
    }
}

/// The prefix of [`BaselinePoint::note`] that marks a baseline that could not run.
pub const SKIPPED_PREFIX: &str = "skipped:";

impl BaselinePoint {
    /// A baseline that could not run on this host (its tool or library is missing, …): not
    /// verified, no bytes, no time, and a note `skipped: <reason>`. [`crate::check::check`]
    /// accepts it; the Markdown shows it with its reason.
    pub fn skipped(link: LinkSpec, name: &str, reason: &str) -> Self {
        BaselinePoint {
            link,
            name: name.to_owned(),
            bytes: 0,
            wall_s: 0.0,
            goodput_bps: 0.0,
            cpu_s_sender: 0.0,
            cpu_s_receiver: 0.0,
            verified: false,
            note: format!("{SKIPPED_PREFIX} {reason}"),
        }
    }

    /// This baseline did not run: not verified, `wall_s == 0` and a note starting `skipped:`.
    pub fn is_skipped(&self) -> bool {
        !self.verified && self.wall_s == 0.0 && self.note.starts_with(SKIPPED_PREFIX)
    }
}
