//! `kvferry plan`: turns flags (or presets) into a [`Scenario`] and [`Policy`], asks the model,
//! and prints the decision and the crossover analysis (human-readable, or `--json`).
//!
//! Owns flag validation: every bad input becomes one line naming the flag and the rule, and a
//! non-zero exit; nothing here panics on input. With only the plain flags
//! (`--layers --kv-heads --head-dim --dtype-bytes --params --tflops --mfu --gbps --rtt-ms
//! --prefix-tokens`), the numbers are exactly the seed's linear model.

use std::fmt;

use clap::Args;
use kvferry_model::presets::{self, ModelPreset};
use kvferry_model::{
    Action, AttentionShape, ComputeModel, Decision, KvDtype, KvFootprint, KvShape, LinkModel, Mode, Policy,
    QueueState, Queues, Scenario, decide,
};
use serde_json::json;

use crate::sweep;

/// Flags of `kvferry plan`. Numbers are taken as text and validated here, so that every error
/// is one line that names the flag.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Model preset (llama-3.1-8b, llama-3.1-70b, llama-3.1-405b, qwen2.5-72b, mixtral-8x7b, deepseek-v3).
    #[arg(long, value_name = "NAME")]
    model: Option<String>,
    /// Accelerator preset for the dense BF16 peak (h100-sxm, h200, a100, l40s, b200).
    #[arg(long, value_name = "NAME")]
    gpu: Option<String>,
    /// Transformer layers that cache KV.
    #[arg(long, allow_hyphen_values = true)]
    layers: Option<String>,
    /// KV heads per layer (GQA).
    #[arg(long, allow_hyphen_values = true)]
    kv_heads: Option<String>,
    /// Head dimension.
    #[arg(long, allow_hyphen_values = true)]
    head_dim: Option<String>,
    /// Bytes per KV element (default 2: bf16).
    #[arg(long, allow_hyphen_values = true)]
    dtype_bytes: Option<String>,
    /// KV dtype by name instead of --dtype-bytes: fp32, bf16, fp16, fp8.
    #[arg(long, value_name = "NAME", conflicts_with = "dtype_bytes")]
    dtype: Option<String>,
    /// Model parameters (e.g. 70e9 or 70B).
    #[arg(long, allow_hyphen_values = true)]
    params: Option<String>,
    /// Parameters active per token (MoE); defaults to --params.
    #[arg(long, allow_hyphen_values = true)]
    active_params: Option<String>,
    /// Query heads: turns on the attention FLOPs term (with --attention auto).
    #[arg(long, allow_hyphen_values = true)]
    q_heads: Option<String>,
    /// Attention FLOPs in recompute: auto (on when the model shape is known), on, off.
    #[arg(long, default_value = "auto")]
    attention: String,
    /// Accelerator peak in TFLOP/s (dense).
    #[arg(long, allow_hyphen_values = true)]
    tflops: Option<String>,
    /// Prefill model-FLOPs utilization, in (0, 1].
    #[arg(long, allow_hyphen_values = true)]
    mfu: Option<String>,
    /// Link goodput in Gbit/s.
    #[arg(long, allow_hyphen_values = true)]
    gbps: Option<String>,
    /// Round-trip time in milliseconds.
    #[arg(long, allow_hyphen_values = true)]
    rtt_ms: Option<String>,
    /// Bytes on the wire per byte of KV (codec ratio; default 1).
    #[arg(long, allow_hyphen_values = true)]
    wire_ratio: Option<String>,
    /// Cached prefix length in tokens.
    #[arg(long, allow_hyphen_values = true)]
    prefix_tokens: Option<String>,
    /// Utilization of the fetch path, in [0, 1) (M/M/1 term).
    #[arg(long, allow_hyphen_values = true)]
    fetch_util: Option<String>,
    /// Utilization of the target's compute queue, in [0, 1) (M/M/1 term).
    #[arg(long, allow_hyphen_values = true)]
    compute_util: Option<String>,
    /// Service rate of both queues, requests/s (M/M/1 term).
    #[arg(long, allow_hyphen_values = true)]
    service_rate: Option<String>,
    /// Let the split be the decision.
    #[arg(long)]
    allow_split: bool,
    /// Fixed cost of a real split, ms (default 0.5, as the daemon's).
    #[arg(long, allow_hyphen_values = true)]
    split_overhead_ms: Option<String>,
    /// Minimum gain of a split over the better pure action, in [0, 1] (default 0.05).
    #[arg(long, allow_hyphen_values = true)]
    split_min_gain: Option<String>,
    /// Engine block size in tokens: split points are multiples of it (default 16).
    #[arg(long, allow_hyphen_values = true)]
    block_size: Option<String>,
    /// Hard cap on WAN bytes for this migration.
    #[arg(long, allow_hyphen_values = true)]
    max_egress_bytes: Option<String>,
    /// auto, fetch or recompute.
    #[arg(long, default_value = "auto")]
    mode: String,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Sweep prefix lengths x bandwidths on this RTT and model.
    #[arg(long)]
    sweep: bool,
    /// With --sweep: CSV instead of a table.
    #[arg(long, requires = "sweep")]
    csv: bool,
}

/// A rejected flag: which one and the rule it broke.
#[derive(Debug)]
pub struct FlagError {
    flag: &'static str,
    rule: String,
}

impl fmt::Display for FlagError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "--{} {}", self.flag, self.rule)
    }
}

impl std::error::Error for FlagError {}

fn bad(flag: &'static str, rule: impl Into<String>) -> FlagError {
    FlagError { flag, rule: rule.into() }
}

type R<T> = Result<T, FlagError>;

fn number(flag: &'static str, raw: &Option<String>) -> R<Option<f64>> {
    let Some(text) = raw else { return Ok(None) };
    let v: f64 = parse_scaled(text).ok_or_else(|| bad(flag, format!("must be a number, got {text:?}")))?;
    if !v.is_finite() {
        return Err(bad(flag, format!("must be a finite number, got {text:?}")));
    }
    Ok(Some(v))
}

/// Accepts plain floats and a B/M/K suffix for parameter counts (70B, 12.9b).
fn parse_scaled(text: &str) -> Option<f64> {
    let t = text.trim();
    let (num, scale) = match t.chars().last()? {
        'B' | 'b' => (&t[..t.len() - 1], 1e9),
        'M' | 'm' => (&t[..t.len() - 1], 1e6),
        'K' | 'k' => (&t[..t.len() - 1], 1e3),
        _ => (t, 1.0),
    };
    num.parse::<f64>().ok().map(|v| v * scale)
}

fn positive(flag: &'static str, raw: &Option<String>) -> R<Option<f64>> {
    match number(flag, raw)? {
        Some(v) if v <= 0.0 => Err(bad(flag, format!("must be > 0, got {v}"))),
        v => Ok(v),
    }
}

fn non_negative(flag: &'static str, raw: &Option<String>) -> R<Option<f64>> {
    match number(flag, raw)? {
        Some(v) if v < 0.0 => Err(bad(flag, format!("must be >= 0, got {v}"))),
        v => Ok(v),
    }
}

fn count(flag: &'static str, raw: &Option<String>) -> R<Option<u64>> {
    let Some(text) = raw else { return Ok(None) };
    let v: u64 =
        text.trim().parse().map_err(|_| bad(flag, format!("must be a whole number >= 1, got {text:?}")))?;
    if v == 0 {
        return Err(bad(flag, "must be >= 1, got 0"));
    }
    Ok(Some(v))
}

fn count_u32(flag: &'static str, raw: &Option<String>) -> R<Option<u32>> {
    match count(flag, raw)? {
        Some(v) => {
            u32::try_from(v).map(Some).map_err(|_| bad(flag, format!("must be <= {}, got {v}", u32::MAX)))
        }
        None => Ok(None),
    }
}

fn utilization(flag: &'static str, raw: &Option<String>) -> R<Option<f64>> {
    match number(flag, raw)? {
        Some(v) if !(0.0..1.0).contains(&v) => Err(bad(
            flag,
            format!("must be in [0, 1) (an M/M/1 queue at utilization >= 1 never drains), got {v}"),
        )),
        v => Ok(v),
    }
}

fn required<T>(flag: &'static str, v: Option<T>, why: &str) -> R<T> {
    v.ok_or_else(|| bad(flag, format!("is required ({why})")))
}

/// What the flags resolve to, plus what the printout needs to explain itself.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub scenario: Scenario,
    pub policy: Policy,
    /// Where the model shape came from.
    pub model_name: Option<&'static str>,
    /// Whether --prefix-tokens was given (a sweep may omit it).
    pub prefix_given: bool,
    /// Whether --gbps was given (a sweep may omit it).
    pub gbps_given: bool,
}

impl PlanArgs {
    /// Validates every flag and builds the model inputs.
    pub fn resolve(&self) -> R<Resolved> {
        let preset: Option<&'static ModelPreset> = match &self.model {
            Some(name) => Some(presets::model(name).map_err(|e| bad("model", e.to_string()))?),
            None => None,
        };
        let gpu_tflops = match &self.gpu {
            Some(name) => Some(presets::gpu(name).map_err(|e| bad("gpu", e.to_string()))?.tflops),
            None => None,
        };

        // KV shape.
        let layers = count_u32("layers", &self.layers)?;
        let kv_heads = count_u32("kv-heads", &self.kv_heads)?;
        let head_dim = count_u32("head-dim", &self.head_dim)?;
        let shape = match preset.map(|p| p.kv) {
            Some(KvShape::Mla { layers: pl, latent_dim, rope_dim }) => {
                if kv_heads.is_some() || head_dim.is_some() {
                    let flag = if kv_heads.is_some() { "kv-heads" } else { "head-dim" };
                    return Err(bad(flag, "does not apply to an MLA model (it caches one latent per layer)"));
                }
                KvShape::Mla { layers: layers.unwrap_or(pl), latent_dim, rope_dim }
            }
            Some(KvShape::Gqa { layers: pl, kv_heads: ph, head_dim: pd }) => KvShape::Gqa {
                layers: layers.unwrap_or(pl),
                kv_heads: kv_heads.unwrap_or(ph),
                head_dim: head_dim.unwrap_or(pd),
            },
            None => KvShape::Gqa {
                layers: required("layers", layers, "or pass --model")?,
                kv_heads: required("kv-heads", kv_heads, "or pass --model")?,
                head_dim: required("head-dim", head_dim, "or pass --model")?,
            },
        };
        let element_bytes = match (&self.dtype, positive("dtype-bytes", &self.dtype_bytes)?) {
            (Some(name), _) => KvDtype::parse(name)
                .ok_or_else(|| bad("dtype", format!("must be one of fp32, bf16, fp16, fp8, got {name:?}")))?
                .bytes(),
            (None, Some(b)) => b,
            (None, None) => KvDtype::Bf16.bytes(),
        };
        let kv = KvFootprint::new(shape, element_bytes).map_err(|e| bad("dtype-bytes", e.to_string()))?;

        // Compute.
        let params = positive("params", &self.params)?.or(preset.map(|p| p.params));
        let params = required("params", params, "model parameters, e.g. 70e9, or pass --model")?;
        let active = positive("active-params", &self.active_params)?
            .or(if self.params.is_none() { preset.map(|p| p.active_params) } else { None })
            .unwrap_or(params);
        if active > params {
            return Err(bad("active-params", format!("must be <= --params ({params}), got {active}")));
        }
        let tflops = positive("tflops", &self.tflops)?.or(gpu_tflops);
        let tflops = required("tflops", tflops, "accelerator TFLOP/s, or pass --gpu")?;
        let mfu = required("mfu", number("mfu", &self.mfu)?, "prefill MFU in (0, 1]")?;
        if !(mfu > 0.0 && mfu <= 1.0) {
            return Err(bad("mfu", format!("must be in (0, 1], got {mfu}")));
        }
        let q_heads = count_u32("q-heads", &self.q_heads)?;
        let attention_shape = match (q_heads, preset) {
            (Some(h), _) => {
                let d = match shape {
                    KvShape::Gqa { head_dim, .. } => head_dim,
                    KvShape::Mla { .. } => preset.map_or(128, |p| p.attention.qk_head_dim),
                };
                Some(AttentionShape { layers: shape.layers(), q_heads: h, qk_head_dim: d, v_head_dim: d })
            }
            (None, Some(p)) => Some(AttentionShape { layers: shape.layers(), ..p.attention }),
            (None, None) => None,
        };
        let attention = match self.attention.as_str() {
            "auto" => attention_shape,
            "off" => None,
            "on" => Some(attention_shape.ok_or_else(|| bad("attention", "on needs --q-heads or --model"))?),
            other => return Err(bad("attention", format!("must be auto, on or off, got {other:?}"))),
        };
        let compute = ComputeModel::new(active, tflops * 1e12, mfu, attention)
            .map_err(|e| bad("params", e.to_string()))?;

        // Link.
        let gbps_given = self.gbps.is_some();
        let gbps = positive("gbps", &self.gbps)?;
        let gbps =
            if self.sweep { gbps.unwrap_or(10.0) } else { required("gbps", gbps, "link goodput in Gbit/s")? };
        let rtt_ms = required("rtt-ms", non_negative("rtt-ms", &self.rtt_ms)?, "round-trip time in ms")?;
        let wire_ratio = positive("wire-ratio", &self.wire_ratio)?.unwrap_or(1.0);
        let link =
            LinkModel::new(gbps, rtt_ms / 1000.0, wire_ratio).map_err(|e| bad("gbps", e.to_string()))?;

        let prefix_given = self.prefix_tokens.is_some();
        let prefix = count("prefix-tokens", &self.prefix_tokens)?;
        let prefix_tokens = if self.sweep {
            prefix.unwrap_or(8192)
        } else {
            required("prefix-tokens", prefix, "cached tokens")?
        };

        // Queues.
        let fetch_util = utilization("fetch-util", &self.fetch_util)?;
        let compute_util = utilization("compute-util", &self.compute_util)?;
        let service_rate = positive("service-rate", &self.service_rate)?;
        let queues = match (fetch_util, compute_util, service_rate) {
            (None, None, None) => None,
            (f, c, Some(mu)) => Some(Queues {
                fetch: QueueState { utilization: f.unwrap_or(0.0), service_rate: mu },
                compute: QueueState { utilization: c.unwrap_or(0.0), service_rate: mu },
            }),
            (_, _, None) => {
                return Err(bad(
                    "service-rate",
                    "is required with --fetch-util or --compute-util (requests/s)",
                ));
            }
        };

        // Policy.
        let mode = match self.mode.as_str() {
            "auto" => Mode::Auto,
            "fetch" => Mode::Fetch,
            "recompute" => Mode::Recompute,
            other => return Err(bad("mode", format!("must be auto, fetch or recompute, got {other:?}"))),
        };
        let defaults = Policy::default();
        let split_min_gain =
            non_negative("split-min-gain", &self.split_min_gain)?.unwrap_or(defaults.split_min_gain);
        if split_min_gain > 1.0 {
            return Err(bad("split-min-gain", format!("must be in [0, 1], got {split_min_gain}")));
        }
        let policy = Policy {
            mode,
            allow_split: self.allow_split,
            max_wire_bytes: non_negative("max-egress-bytes", &self.max_egress_bytes)?,
            split_overhead_s: non_negative("split-overhead-ms", &self.split_overhead_ms)?
                .map_or(defaults.split_overhead_s, |ms| ms / 1000.0),
            split_min_gain,
            split_granularity: count("block-size", &self.block_size)?.unwrap_or(defaults.split_granularity),
            split_interference: defaults.split_interference,
            ..defaults
        };

        let scenario = Scenario { kv, compute, link, prefix_tokens, queues, load_s_per_byte: 0.0 };
        Ok(Resolved { scenario, policy, model_name: preset.map(|p| p.name), prefix_given, gbps_given })
    }
}

/// Entry point of `kvferry plan`.
pub fn run(args: &PlanArgs) -> anyhow::Result<()> {
    let resolved = args.resolve()?;
    if args.sweep {
        let inputs = sweep::SweepInputs {
            scenario: resolved.scenario,
            policy: resolved.policy,
            prefix_given: resolved.prefix_given,
            gbps_given: resolved.gbps_given,
        };
        let out = sweep::run(&inputs, args.csv)?;
        print!("{out}");
        return Ok(());
    }
    let d = decide(&resolved.scenario, &resolved.policy)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&to_json(&resolved, &d))?);
    } else {
        print!("{}", human(&resolved, &d));
    }
    Ok(())
}

/// The `--json` object. Stable keys other tools read: `bytes_per_token`, `recompute_seconds`,
/// `fetch_seconds`, `crossover_tokens`, `decision`, `split`, `crossover_utilization`.
pub fn to_json(r: &Resolved, d: &Decision) -> serde_json::Value {
    let s = &r.scenario;
    json!({
        "bytes_per_token": d.bytes_per_token,
        "recompute_seconds": d.recompute.seconds,
        "fetch_seconds": d.fetch.seconds,
        "crossover_tokens": d.crossover_tokens,
        "decision": d.action,
        "reason": d.reason.to_string(),
        "split": {
            "recompute_tokens": d.split.point.recompute_tokens,
            "fetch_tokens": d.split.point.fetch_tokens,
            "seconds": d.split.point.seconds,
            "gain_over_best_pure": d.split.gain,
            "gpu_seconds": d.split.gpu_seconds,
            "wire_bytes": d.split.wire_bytes,
            "allowed": r.policy.allow_split,
        },
        "crossover_utilization": d.crossover_utilization,
        "recompute_seconds_per_token": d.recompute_seconds_per_token,
        "transfer_seconds_per_token": d.transfer_seconds_per_token,
        "candidates": { "fetch": d.fetch, "recompute": d.recompute },
        "reason_detail": d.reason,
        "inputs": { "model": r.model_name, "scenario": s, "policy": r.policy },
    })
}

fn fmt_bytes(b: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 { format!("{v:.0} {}", UNITS[i]) } else { format!("{v:.2} {}", UNITS[i]) }
}

fn ms(s: f64) -> String {
    format!("{:.2} ms", s * 1e3)
}

/// The human-readable report.
pub fn human(r: &Resolved, d: &Decision) -> String {
    let s = &r.scenario;
    let c = &s.compute;
    let mut o = String::new();
    let p = s.prefix_tokens;
    o += &format!("kvferry plan: fetch or recompute a {p}-token prefix\n\n");
    let shape = match s.kv.shape {
        KvShape::Gqa { layers, kv_heads, head_dim } => {
            format!("2 x {layers} layers x {kv_heads} KV heads x {head_dim} dim x {} B", s.kv.element_bytes)
        }
        KvShape::Mla { layers, latent_dim, rope_dim } => {
            format!(
                "MLA {layers} layers x ({latent_dim} latent + {rope_dim} rope) x {} B",
                s.kv.element_bytes
            )
        }
    };
    let name = r.model_name.map(|n| format!(" [{n}]")).unwrap_or_default();
    o += &format!(
        "  kv        {shape} = {:.1} KiB/token ({} B){name}\n",
        d.bytes_per_token / 1024.0,
        d.bytes_per_token
    );
    o += &format!(
        "  compute   2 x {:.4e} active params / ({:.2} TFLOP/s x {:.2} MFU) = {:.2} us/token; attention term {}\n",
        c.active_params,
        c.peak_flops / 1e12,
        c.mfu,
        d.recompute_seconds_per_token * 1e6,
        match c.attention {
            Some(a) => format!(
                "on ({} q heads, +{:.3} us/token per 1k tokens of context)",
                a.q_heads,
                c.attention_seconds_per_pair() * 1e9
            ),
            None => "off (seed's linear model)".to_owned(),
        }
    );
    o += &format!(
        "  link      {} Gbit/s goodput, {:.2} ms RTT, wire ratio {:.2} = {:.2} us/token\n",
        s.link.goodput_gbps,
        s.link.rtt_s * 1e3,
        s.link.wire_ratio,
        d.transfer_seconds_per_token * 1e6
    );
    if let Some(q) = &s.queues {
        o += &format!(
            "  load      fetch path rho {:.3} (+{}), compute rho {:.3} (+{}), mu {} req/s\n",
            q.fetch.utilization,
            ms(q.fetch.wait_seconds()),
            q.compute.utilization,
            ms(q.compute.wait_seconds()),
            q.fetch.service_rate
        );
    }
    o += "\n";
    o += &format!(
        "  fetch      {:>12}   WAN {:>10}   target GPU {:.3} s{}\n",
        ms(d.fetch.seconds),
        fmt_bytes(d.fetch.wire_bytes),
        d.fetch.gpu_seconds,
        if d.fetch.feasible { "" } else { "   (over the egress cap)" }
    );
    o += &format!(
        "  recompute  {:>12}   WAN {:>10}   target GPU {:.3} s\n",
        ms(d.recompute.seconds),
        fmt_bytes(0.0),
        d.recompute.gpu_seconds
    );
    let sp = &d.split.point;
    let split_note = if !sp.is_real_split() {
        "no real split helps".to_owned()
    } else if r.policy.allow_split {
        format!("gain {:.1}% over the better pure action", d.split.gain * 100.0)
    } else {
        format!(
            "gain {:.1}% over the better pure action; not allowed (pass --allow-split)",
            d.split.gain * 100.0
        )
    };
    o += &format!(
        "  split      {:>12}   WAN {:>10}   target GPU {:.3} s   recompute [0, {}) + fetch [{}, {p}): {split_note}\n",
        ms(sp.seconds),
        fmt_bytes(d.split.wire_bytes),
        d.split.gpu_seconds,
        sp.recompute_tokens,
        sp.recompute_tokens
    );
    o += "\n";
    o += &match d.crossover_tokens {
        Some(x) => format!("  crossover  {x:.0} tokens: fetch wins above, recompute below (idle paths)\n"),
        None => "  crossover  none: transfer per token >= recompute per token, fetch never wins\n".to_owned(),
    };
    if let Some(u) = d.crossover_utilization {
        o += &format!("  crossover  fetch-path utilization {u:.4}: above it, recompute wins\n");
    } else if s.queues.is_some() {
        o += "  crossover  no fetch-path utilization threshold: recompute wins even on an idle fetch path\n";
    }
    let verb = match d.action {
        Action::Fetch => "FETCH",
        Action::Recompute => "RECOMPUTE",
        Action::Split => "SPLIT",
    };
    o += &format!("\n  decision   {verb}: {}\n", d.reason);
    o
}
