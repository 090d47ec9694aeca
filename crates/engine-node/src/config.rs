//! Configuration of the engine process: [`NodeConfig`] (what [`crate::EngineNode::start`]
//! takes) and [`EngineArgs`] (the clap flags of `kvferry engine`, converted with
//! [`EngineArgs::into_config`]). Validation only; nothing here starts anything.

use std::path::PathBuf;
use std::time::Duration;

use kvferry_engine::{BLOCK_SIZE, KvDtype, ModelConfig, ProfileOptions};

use crate::error::NodeError;

/// Everything the engine process needs.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The daemon's run directory (`pool.sock`, `engine.sock`).
    pub run_dir: PathBuf,
    /// This engine's id (unique per daemon).
    pub engine_id: String,
    /// Model id sent to the daemon (part of the layout fingerprint). `None`: derived from the
    /// model fingerprint ([`NodeConfig::model_id`]), so engines with equal configs and seeds
    /// agree and others never exchange blocks.
    pub model_id: Option<String>,
    /// The model (shape, seed, KV dtype).
    pub model: ModelConfig,
    /// Blocks in the shared pool (16 tokens each).
    pub num_blocks: u32,
    /// Where to serve `kvferry.v1.ReferenceEngine`.
    pub control: PathBuf,
    /// How the prefill profile is calibrated at start (contexts that do not fit the pool are
    /// dropped).
    pub profile: ProfileOptions,
    /// Period of `LoadReport` events.
    pub load_report_interval: Duration,
    /// Factor on the prefill profile the engine reports (1.0: as measured). A profile known to
    /// be off (measured on an idle host, served on a busy one) can be corrected here; tests use
    /// it to hand the daemon a deliberately wrong prior, which its calibration must correct.
    pub profile_scale: f64,
    /// Deadline of each daemon RPC (Lookup, Load, Release) and of registration.
    pub rpc_timeout: Duration,
    /// How the daemon reaches the pool's memory.
    pub pool: PoolAccess,
    /// What the node does when its daemon goes away (restart, crash): register again.
    pub reconnect: ReconnectPolicy,
}

/// How an engine whose daemon went away registers again: attempts after
/// [`ReconnectPolicy::backoff`], until one succeeds or `give_up_after` has passed since the
/// daemon went away (then the node stops with `NodeError::DaemonGone`). A zero
/// `give_up_after` stops at once, as engines did before they could reconnect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReconnectPolicy {
    /// Wait before the first attempt.
    pub initial_backoff: Duration,
    /// Longest wait between attempts (the wait doubles up to it).
    pub max_backoff: Duration,
    /// How long to keep trying.
    pub give_up_after: Duration,
}

impl Default for ReconnectPolicy {
    /// 100 ms, doubling to 2 s, for 5 minutes.
    fn default() -> Self {
        ReconnectPolicy {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
            give_up_after: Duration::from_secs(300),
        }
    }
}

impl ReconnectPolicy {
    /// Never reconnect: the node stops when its daemon goes away.
    pub const NEVER: ReconnectPolicy = ReconnectPolicy {
        initial_backoff: Duration::ZERO,
        max_backoff: Duration::ZERO,
        give_up_after: Duration::ZERO,
    };

    /// The wait before attempt `attempt` (0-based): `initial_backoff × 2^attempt`, at most
    /// `max_backoff`.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
        self.initial_backoff.saturating_mul(factor).min(self.max_backoff)
    }
}

/// How the engine hands its pool to the daemon (`--pool`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum PoolAccess {
    /// The pool's memfd goes to the daemon over `pool.sock`; the daemon maps it.
    #[default]
    Shm,
    /// The pool's regions are registered with the engine's own NIXL agent (plain DRAM); the
    /// daemon gets a NIXL descriptor and moves blocks with NIXL READ/WRITE, never mapping it.
    Nixl,
}

/// The default model: 4 layers, hidden 256, 8 heads, 2 KV heads, head dim 32, FFN 512,
/// vocabulary 1024, RoPE base 10 000, f32 KV.
pub fn default_model(seed: u64) -> ModelConfig {
    ModelConfig {
        layers: 4,
        hidden: 256,
        heads: 8,
        kv_heads: 2,
        head_dim: 32,
        ffn: 512,
        vocab: 1024,
        rope_theta: 10_000.0,
        seed,
        kv_dtype: KvDtype::F32,
    }
}

impl NodeConfig {
    /// A config with the default model (seed 0), 1024 blocks, default profile options, a
    /// load report every second and 30 s RPC deadlines.
    pub fn new(
        run_dir: impl Into<PathBuf>,
        engine_id: impl Into<String>,
        control: impl Into<PathBuf>,
    ) -> Self {
        NodeConfig {
            run_dir: run_dir.into(),
            engine_id: engine_id.into(),
            model_id: None,
            model: default_model(0),
            num_blocks: 1024,
            control: control.into(),
            profile: ProfileOptions::default(),
            load_report_interval: Duration::from_secs(1),
            profile_scale: 1.0,
            rpc_timeout: Duration::from_secs(30),
            pool: PoolAccess::Shm,
            reconnect: ReconnectPolicy::default(),
        }
    }

    /// The model id registered with the daemon.
    pub fn model_id(&self) -> String {
        match &self.model_id {
            Some(m) => m.clone(),
            None => {
                let fp = self.model.model_fingerprint();
                format!("kvferry-ref-{}", kvferry_layout::hex(&fp[..8]))
            }
        }
    }

    /// Profile options trimmed to what a pool of `num_blocks` can hold.
    pub fn fitted_profile(&self) -> ProfileOptions {
        let cap = self.num_blocks as usize * BLOCK_SIZE;
        let mut p = self.profile.clone();
        p.chunk = p.chunk.min(cap).max(1);
        p.contexts.retain(|&c| c + p.chunk <= cap);
        if p.contexts.is_empty() {
            p.contexts.push(0);
        }
        p
    }

    /// Checks everything that does not need the daemon.
    pub fn validate(&self) -> Result<(), NodeError> {
        self.model.validate().map_err(|e| NodeError::Config(e.to_string()))?;
        if self.num_blocks == 0 {
            return Err(NodeError::Config("--num-blocks must be positive".into()));
        }
        if self.engine_id.is_empty() {
            return Err(NodeError::Config("--engine-id must not be empty".into()));
        }
        if self.model.vocab > u32::MAX as usize {
            return Err(NodeError::Config("--vocab must fit u32 token ids".into()));
        }
        if !(self.profile_scale.is_finite() && self.profile_scale > 0.0) {
            return Err(NodeError::Config("profile_scale must be a positive number".into()));
        }
        if self.load_report_interval.is_zero() || self.rpc_timeout.is_zero() {
            return Err(NodeError::Config("intervals must be positive".into()));
        }
        let r = &self.reconnect;
        if !r.give_up_after.is_zero() && (r.initial_backoff.is_zero() || r.max_backoff < r.initial_backoff) {
            return Err(NodeError::Config(
                "reconnect backoff must be positive and at most its maximum".into(),
            ));
        }
        if self.profile.repeats == 0 || self.profile.chunk == 0 {
            return Err(NodeError::Config("profile needs repeats > 0 and chunk > 0".into()));
        }
        Ok(())
    }
}

/// KV dtype flag values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvDtypeArg {
    /// 4-byte IEEE floats.
    F32,
    /// bfloat16 (round to nearest even).
    Bf16,
}

impl From<KvDtypeArg> for KvDtype {
    fn from(d: KvDtypeArg) -> Self {
        match d {
            KvDtypeArg::F32 => KvDtype::F32,
            KvDtypeArg::Bf16 => KvDtype::Bf16,
        }
    }
}

/// `kvferry engine`: run the reference engine next to a region's daemon.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// The daemon's run directory (holds pool.sock and engine.sock).
    #[arg(long)]
    pub run_dir: PathBuf,
    /// This engine's id.
    #[arg(long, default_value = "engine-0")]
    pub engine_id: String,
    /// Unix socket to serve the ReferenceEngine control API on [default: RUN_DIR/ENGINE_ID.sock].
    #[arg(long)]
    pub control: Option<PathBuf>,
    /// Model id to register [default: derived from the model fingerprint].
    #[arg(long)]
    pub model_id: Option<String>,
    /// Transformer layers.
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// Residual width.
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    /// Query heads.
    #[arg(long, default_value_t = 8)]
    pub heads: usize,
    /// KV heads (GQA; divides --heads).
    #[arg(long, default_value_t = 2)]
    pub kv_heads: usize,
    /// Head dimension (even).
    #[arg(long, default_value_t = 32)]
    pub head_dim: usize,
    /// SwiGLU width.
    #[arg(long, default_value_t = 512)]
    pub ffn: usize,
    /// Vocabulary size.
    #[arg(long, default_value_t = 1024)]
    pub vocab: usize,
    /// Weight seed (engines exchange blocks only with equal seeds).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Blocks in the KV pool (16 tokens each).
    #[arg(long, default_value_t = 1024)]
    pub num_blocks: u32,
    /// KV cache element type.
    #[arg(long, value_enum, default_value_t = KvDtypeArg::F32)]
    pub kv_dtype: KvDtypeArg,
    /// Seconds between load reports to the daemon.
    #[arg(long, default_value_t = 1.0)]
    pub load_report_s: f64,
    /// Factor on the prefill profile reported to the daemon (1.0: as measured).
    #[arg(long, default_value_t = 1.0)]
    pub profile_scale: f64,
    /// How the daemon reaches the KV pool: `shm` (memfd over pool.sock) or `nixl` (regions
    /// registered with the engine's NIXL agent; needs NIXL, see deploy/install-nixl.sh).
    #[arg(long, value_enum, default_value_t = PoolAccess::Shm)]
    pub pool: PoolAccess,
    /// Seconds the engine keeps trying to register again after its daemon went away (restart,
    /// crash), with backoff from 100 ms to 2 s; its cache is published again once it is back.
    /// 0: exit when the daemon goes away.
    #[arg(long, default_value_t = 300.0)]
    pub daemon_reconnect_s: f64,
}

impl EngineArgs {
    /// The node configuration these flags describe (validated).
    pub fn into_config(self) -> Result<NodeConfig, NodeError> {
        if !(self.load_report_s.is_finite() && self.load_report_s > 0.0) {
            return Err(NodeError::Config("--load-report-s must be a positive number".into()));
        }
        if !(self.daemon_reconnect_s.is_finite() && (0.0..=1e9).contains(&self.daemon_reconnect_s)) {
            return Err(NodeError::Config("--daemon-reconnect-s must be a number of seconds >= 0".into()));
        }
        let control = self.control.unwrap_or_else(|| self.run_dir.join(format!("{}.sock", self.engine_id)));
        let mut cfg = NodeConfig::new(self.run_dir, self.engine_id, control);
        cfg.model_id = self.model_id;
        cfg.model = ModelConfig {
            layers: self.layers,
            hidden: self.hidden,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            ffn: self.ffn,
            vocab: self.vocab,
            rope_theta: 10_000.0,
            seed: self.seed,
            kv_dtype: self.kv_dtype.into(),
        };
        cfg.num_blocks = self.num_blocks;
        cfg.load_report_interval = Duration::from_secs_f64(self.load_report_s);
        cfg.pool = self.pool;
        cfg.profile_scale = self.profile_scale;
        cfg.reconnect = if self.daemon_reconnect_s == 0.0 {
            ReconnectPolicy::NEVER
        } else {
            ReconnectPolicy {
                give_up_after: Duration::from_secs_f64(self.daemon_reconnect_s),
                ..Default::default()
            }
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineArgs,
    }

    #[test]
    fn flags_build_a_validated_config() {
        let cli =
            Cli::try_parse_from(["x", "--run-dir", "/tmp/r", "--kv-dtype", "bf16", "--seed", "5"]).unwrap();
        let cfg = cli.engine.into_config().unwrap();
        assert_eq!(cfg.model, ModelConfig { seed: 5, kv_dtype: KvDtype::Bf16, ..default_model(0) });
        assert_eq!(cfg.control, PathBuf::from("/tmp/r/engine-0.sock"));
        assert!(cfg.model_id().starts_with("kvferry-ref-"));
        assert_eq!(cfg.pool, PoolAccess::Shm);
        let nixl = Cli::try_parse_from(["x", "--run-dir", "/r", "--pool", "nixl"]).unwrap();
        assert_eq!(nixl.engine.into_config().unwrap().pool, PoolAccess::Nixl);
        assert!(Cli::try_parse_from(["x", "--run-dir", "/r", "--pool", "cuda"]).is_err());
        let scaled = Cli::try_parse_from(["x", "--run-dir", "/r", "--profile-scale", "0.1"]).unwrap();
        assert_eq!(scaled.engine.into_config().unwrap().profile_scale, 0.1);
        let zero = Cli::try_parse_from(["x", "--run-dir", "/r", "--profile-scale", "0"]).unwrap();
        assert!(matches!(zero.engine.into_config(), Err(NodeError::Config(_))));
        let bad = Cli::try_parse_from(["x", "--run-dir", "/r", "--kv-heads", "3"]).unwrap();
        assert!(matches!(bad.engine.into_config(), Err(NodeError::Config(_))));
        let zero = Cli::try_parse_from(["x", "--run-dir", "/r", "--num-blocks", "0"]).unwrap();
        assert!(matches!(zero.engine.into_config(), Err(NodeError::Config(_))));
    }

    #[test]
    fn reconnect_backoff_doubles_to_its_cap_and_the_flag_sets_the_bound() {
        let p = ReconnectPolicy::default();
        let ms = |a| p.backoff(a).as_millis();
        assert_eq!(
            (ms(0), ms(1), ms(2), ms(4), ms(5), ms(40), ms(u32::MAX)),
            (100, 200, 400, 1600, 2000, 2000, 2000)
        );
        let cfg = |v: &str| Cli::try_parse_from(["x", "--run-dir", "/r", "--daemon-reconnect-s", v]).unwrap();
        assert_eq!(cfg("0").engine.into_config().unwrap().reconnect, ReconnectPolicy::NEVER);
        assert_eq!(
            cfg("7.5").engine.into_config().unwrap().reconnect.give_up_after,
            Duration::from_millis(7500)
        );
        let default = Cli::try_parse_from(["x", "--run-dir", "/r"]).unwrap().engine.into_config().unwrap();
        assert_eq!(default.reconnect, ReconnectPolicy::default());
        for bad in ["-1", "nan", "inf"] {
            let c = Cli::try_parse_from(["x", "--run-dir", "/r", "--daemon-reconnect-s", bad]);
            assert!(
                c.is_err() || matches!(c.unwrap().engine.into_config(), Err(NodeError::Config(_))),
                "{bad}"
            );
        }
        let mut zero_wait = NodeConfig::new("/r", "e", "/r/e.sock");
        zero_wait.reconnect.initial_backoff = Duration::ZERO;
        assert!(matches!(zero_wait.validate(), Err(NodeError::Config(_))));
    }

    #[test]
    fn profile_is_trimmed_to_the_pool() {
        let mut cfg = NodeConfig::new("/r", "e", "/r/e.sock");
        cfg.num_blocks = 40; // 640 tokens
        assert_eq!(cfg.fitted_profile().contexts, vec![0, 256, 512]);
        cfg.num_blocks = 2;
        let p = cfg.fitted_profile();
        assert_eq!((p.contexts, p.chunk), (vec![0], 32));
    }
}
