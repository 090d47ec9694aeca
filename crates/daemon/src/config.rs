//! Daemon configuration: one TOML file, overridable by environment (`KVFERRY_*`) and flags,
//! parsed and validated into typed structs before any port is bound.
//!
//! `deploy/kvferry.toml` is the commented template; a test checks that it parses and equals
//! [`Config::default`] for every field it sets.

use std::net::SocketAddr;
use std::path::PathBuf;

use kvferry_peer::{Congestion, TransportChoice};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use thiserror::Error;

/// A configuration the daemon refuses to start with.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("parsing {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid config: {field}: {rule}")]
    Invalid { field: String, rule: String },
}

fn invalid(field: impl Into<String>, rule: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field: field.into(), rule: rule.into() }
}

/// A setting with a fixed set of values, spelled in the file as one of `NAMES`. An unknown
/// value is a parse error that names the field and the values it takes.
trait Choice: Sized + Copy + PartialEq + 'static {
    /// The setting's path in the file, for error messages.
    const FIELD: &'static str;
    /// Every value with its spelling (the first spelling of a value is the one written out).
    const NAMES: &'static [(&'static str, Self)];

    fn name(self) -> &'static str {
        Self::NAMES.iter().find(|(_, v)| *v == self).map_or("?", |(n, _)| n)
    }

    fn from_name(s: &str) -> Result<Self, String> {
        Self::NAMES.iter().find(|(n, _)| *n == s).map(|(_, v)| *v).ok_or_else(|| {
            let known: Vec<String> = Self::NAMES.iter().map(|(n, _)| format!("{n:?}")).collect();
            format!("{}: must be one of {}, got {s:?}", Self::FIELD, known.join(", "))
        })
    }
}

fn ser_choice<T: Choice, S: Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(v.name())
}

fn de_choice<'de, T: Choice, D: Deserializer<'de>>(d: D) -> Result<T, D::Error> {
    let s = String::deserialize(d)?;
    T::from_name(&s).map_err(serde::de::Error::custom)
}

macro_rules! choice_serde {
    ($t:ty) => {
        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                ser_choice(self, s)
            }
        }
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                de_choice(d)
            }
        }
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

/// Where the peer TLS identity comes from (`tls.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    /// A throwaway CA in `tls.dev_dir` signs this region's certificate.
    Dev,
    /// PEM files `tls.ca`, `tls.cert`, `tls.key`.
    Files,
}

impl Choice for TlsMode {
    const FIELD: &'static str = "tls.mode";
    const NAMES: &'static [(&'static str, Self)] = &[("dev", Self::Dev), ("files", Self::Files)];
}
choice_serde!(TlsMode);

/// TLS on the router-facing API (`router_tls.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterTlsMode {
    /// Plaintext gRPC.
    Off,
    /// Mutual TLS with the dev CA in `tls.dev_dir`.
    Dev,
    /// Mutual TLS with PEM files `router_tls.cert`, `router_tls.key`, `router_tls.client_ca`.
    Files,
}

impl Choice for RouterTlsMode {
    const FIELD: &'static str = "router_tls.mode";
    const NAMES: &'static [(&'static str, Self)] =
        &[("off", Self::Off), ("dev", Self::Dev), ("files", Self::Files)];
}
choice_serde!(RouterTlsMode);

/// `transfer.congestion`: the peer crate's [`Congestion`], spelled as [`Congestion::parse`]
/// reads it (written out as [`Congestion::name`]).
mod congestion {
    use kvferry_peer::Congestion;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(c: &Congestion, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(c.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Congestion, D::Error> {
        let s = String::deserialize(d)?;
        Congestion::parse(&s).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "transfer.congestion: must be \"cubic\", \"bbr\", \"newreno\" or \"tolerant\", got {s:?}"
            ))
        })
    }
}

/// `peers[].transport`: the peer crate's [`TransportChoice`] (read and written through
/// [`Choice`]; the peer crate's own spellings are the same).
impl Choice for TransportChoice {
    const FIELD: &'static str = "peers[].transport";
    const NAMES: &'static [(&'static str, Self)] =
        &[("quic", Self::Quic), ("tcp", Self::Tcp), ("auto", Self::Auto)];
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// This daemon's region name (its identity is `spiffe://<trust_domain>/region/<region>`).
    pub region: String,
    /// SPIFFE trust domain shared by all regions.
    pub trust_domain: String,
    /// Directory for the engine sockets (`engine.sock`, `pool.sock`).
    pub run_dir: PathBuf,
    pub listen: Listen,
    pub auth: Auth,
    pub tls: Tls,
    pub router_tls: RouterTls,
    pub peers: Vec<Peer>,
    pub limits: Limits,
    pub listeners: Listeners,
    pub transfer: Transfer,
    pub runtime: Runtime,
    pub policy: PolicyDefaults,
    /// Fault injection for tests (honoured only by builds with feature `fault-injection`).
    pub faults: Faults,
}

/// Fault injection, for end-to-end tests of verification (e.g. tests/vllm). A build without
/// the `fault-injection` feature refuses any entry here at start-up.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Faults {
    /// Chunks served to peers for these tenants are corrupted after their checksum.
    pub corrupt: Vec<CorruptFault>,
    /// Engine `Load` calls for these tenants fail (UNAVAILABLE) before any byte is written, as
    /// a daemon losing its landing zone would: the engine must recompute, never use the blocks.
    pub fail_loads: Vec<String>,
}

/// Corrupt the first `chunks` chunk sends (across transfers) of `tenant`'s blocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CorruptFault {
    pub tenant: String,
    pub chunks: u64,
}

/// Listen addresses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Listen {
    /// Router-facing gRPC (Migration), TCP.
    pub grpc: SocketAddr,
    /// Peer endpoint: QUIC on this UDP port, TLS-over-TCP on the same TCP port number.
    pub peer: SocketAddr,
    /// HTTP: /metrics, /healthz, /readyz.
    pub http: SocketAddr,
}

/// Router authentication.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Auth {
    /// When non-empty, Migration calls must carry `authorization: Bearer <token>`.
    pub bearer_token: String,
}

/// Peer TLS material.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Tls {
    /// `dev`: a throwaway CA in `dev_dir` (created if missing) signs this region's certificate.
    /// `files`: PEM files below.
    pub mode: TlsMode,
    pub dev_dir: PathBuf,
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// How often the `files` of `[tls]` and `[router_tls]` are checked for a change (a
    /// certificate rotation), ms; 0 = never (SIGHUP still reloads them).
    pub reload_poll_ms: u64,
}

/// TLS on the router-facing Migration API. With `mode` other than `off`, routers must present
/// a client certificate that chains to the client CA (mutual TLS); a configured bearer token
/// is then required as well.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouterTls {
    /// `off`: plaintext gRPC. `dev`: the dev CA in `tls.dev_dir` issues this daemon's router
    /// server certificate (SANs `localhost`, `127.0.0.1`, `::1` and `listen.grpc`'s address),
    /// trusts itself as the router client CA, and writes a router client certificate
    /// (`router-client.pem`, `router-client.key`) into `tls.dev_dir`. `files`: PEM files below.
    pub mode: RouterTlsMode,
    /// Server certificate chain presented to routers (`files`).
    pub cert: PathBuf,
    /// Its private key (`files`).
    pub key: PathBuf,
    /// CA certificates router client certificates must chain to (`files`).
    pub client_ca: PathBuf,
}

impl Default for RouterTls {
    fn default() -> Self {
        Self {
            mode: RouterTlsMode::Off,
            cert: PathBuf::new(),
            key: PathBuf::new(),
            client_ca: PathBuf::new(),
        }
    }
}

/// A peer region.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Peer {
    pub region: String,
    pub addr: SocketAddr,
    /// Expected goodput until measured, Gbit/s.
    #[serde(default = "default_peer_gbps")]
    pub gbps: f64,
    /// Expected RTT until measured, ms.
    #[serde(default = "default_peer_rtt_ms")]
    pub rtt_ms: f64,
    /// Cap on the KV bytes this daemon serves to that peer, Gbit/s (all its transfers
    /// together); 0 = no cap. Keeps migrations from crowding other traffic off a shared WAN link.
    #[serde(default)]
    pub max_egress_gbps: f64,
    /// The tenants whose blocks this region exchanges with that peer, both ways: it serves
    /// that peer only these tenants' blocks, and fetches (or asks about) only these tenants'
    /// blocks from it. Anything else is refused before any KV byte (PERMISSION_DENIED). Absent:
    /// every tenant (a peer's certificate is then trusted with every tenant's prefixes; see
    /// SECURITY.md). An empty list: no tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenants: Option<Vec<String>>,
    /// How to reach that peer: `quic` (UDP), `tcp` (TLS 1.3 over TCP, for paths that block
    /// UDP), or `auto` (QUIC first, TCP when the QUIC handshake does not complete within
    /// `transfer.auto_fallback_ms`). This daemon listens on both either way.
    #[serde(default, serialize_with = "ser_choice", deserialize_with = "de_choice")]
    pub transport: TransportChoice,
}

impl Peer {
    /// Whether `tenant`'s blocks may be exchanged with this peer (`tenants`).
    pub fn allows(&self, tenant: &str) -> bool {
        self.tenants.as_ref().is_none_or(|t| t.iter().any(|x| x == tenant))
    }
}

fn default_peer_gbps() -> f64 {
    1.0
}
fn default_peer_rtt_ms() -> f64 {
    50.0
}

/// Resource bounds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Chunk bytes held in staging, per direction.
    pub staging_bytes: u64,
    /// Bytes of fetched blocks held until engines load them.
    pub landing_zone_bytes: u64,
    /// Fault in the landing zone's free capacity as block buffers when an engine registers
    /// (in the background, on a thread at `SCHED_IDLE` priority), so that fetches land in
    /// memory already mapped: the daemon's resident memory then reaches `landing_zone_bytes`
    /// at once instead of as it fills.
    pub landing_prefault: bool,
    /// Largest token list a request may carry.
    pub max_tokens: u64,
    /// Concurrent MigrateSession calls.
    pub max_concurrent_migrations: u32,
    /// Deadline when a request names none, ms.
    pub default_deadline_ms: u64,
    /// A registered pool whose engine has not opened its `Attach` stream within this many ms
    /// loses its lease (its backend, and for NIXL its helper process, is released).
    pub attach_grace_ms: u64,
    /// A `pool.sock` connection must deliver its whole offer (fd, layout, model id) within
    /// this many ms, else it is closed; offers are handled concurrently, so a silent client
    /// delays no other engine.
    pub pool_offer_timeout_ms: u64,
    /// A shm pool handed over `pool.sock` and not claimed by `RegisterPool` within this many ms
    /// expires: its fd is closed and its mapping unmapped.
    pub pool_offer_ttl_ms: u64,
    /// Unclaimed shm pool offers held at once; an offer beyond it is refused (`error: ...`).
    pub max_pending_pool_offers: u32,
    /// A `MigrateSession` stream that cannot take its next event (the router stopped reading)
    /// for this many ms is dropped: its connection is closed. Its migration slot is freed when
    /// the work ends either way, never held by the stream.
    pub stream_stall_ms: u64,
}

/// Bounds on every listener (router gRPC, plaintext or TLS; Engine API socket; HTTP).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Listeners {
    /// Open connections per listener. At the cap a new connection evicts the connection that
    /// has been idle (no request in flight) longest; when none is idle it is closed at once.
    pub max_connections: u32,
    /// A connection must complete its TLS handshake (router TLS), or send its first bytes
    /// (plaintext gRPC, HTTP), within this many ms.
    pub handshake_timeout_ms: u64,
    /// A gRPC connection with no request in flight for this many ms is closed (HTTP/2
    /// keepalive pings also close connections whose peer stopped answering).
    pub idle_timeout_ms: u64,
}

impl Default for Listeners {
    fn default() -> Self {
        Self { max_connections: 1024, handshake_timeout_ms: 10_000, idle_timeout_ms: 300_000 }
    }
}

/// Transfer tuning.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Transfer {
    pub chunk_bytes: u32,
    pub streams: u32,
    /// QUIC connections per fetch (1–8): a fetch of enough blocks (each stripe at least four
    /// chunks) is split into this many contiguous ranges, each its own transfer on its own
    /// connection, so the packet work spreads over runtime worker threads. QUIC only: the TCP
    /// transport already stripes a transfer over its `streams` data connections.
    pub stripes: u32,
    /// cubic | bbr | newreno | tolerant (also accepted: `new-reno`, `reno`, `loss-tolerant`,
    /// any letter case).
    #[serde(with = "congestion")]
    pub congestion: Congestion,
    /// `congestion = "tolerant"`: the fraction of a round trip's bytes that may be lost before
    /// the loss counts as congestion (the path's random loss must stay below it), 0–0.5.
    pub loss_tolerance: f64,
    /// QUIC idle timeout to peers, ms. A peer silent this long is taken as lost (the fetch
    /// resumes on a new connection); silent for twice this long, the fetch is abandoned and
    /// the migration falls back to recompute.
    pub idle_timeout_ms: u64,
    /// Re-fetches allowed per chunk after it failed verification; one more failure ends the
    /// fetch (and the migration recomputes, if it may).
    pub max_retries_per_chunk: u32,
    /// After the source's `Done`, how long in-flight chunks may take before the missing ones
    /// are asked for again (and again after each unanswered ask), ms.
    pub missing_grace_ms: u64,
    /// Wait before a fetch resumes on a new connection, times the reconnects so far (at most
    /// 20), ms.
    pub reconnect_backoff_ms: u64,
    /// For peers with `transport = "auto"`: how long the QUIC handshake may take before the
    /// link falls back to TCP (remembered for a minute, then QUIC is tried again), ms.
    pub auto_fallback_ms: u64,
    /// QUIC ACK frequency: how many ack-eliciting packets a peer may receive from this daemon
    /// before it must acknowledge (0 = the extension off: an ACK every second packet).
    pub ack_eliciting_threshold: u32,
    /// Receive coalescing on the QUIC socket while traffic flows, µs (0 = off; only applied
    /// when the configured round trip is at least 10 ms).
    pub recv_coalesce_us: u64,
}

impl Transfer {
    /// The peer crate's fetch policy from these settings.
    pub fn fetch_policy(&self) -> kvferry_peer::FetchPolicy {
        kvferry_peer::FetchPolicy {
            max_retries_per_chunk: self.max_retries_per_chunk,
            missing_grace: std::time::Duration::from_millis(self.missing_grace_ms),
            reconnect_backoff: std::time::Duration::from_millis(self.reconnect_backoff_ms),
        }
    }
}

/// The daemon's async runtime.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Runtime {
    /// Worker threads of the daemon's runtime; 0 = sized from the peers' links
    /// ([`Config::runtime_workers`]: one per [`GBPS_PER_WORKER`] of the fastest peer's `gbps`,
    /// at least 1, at most the host's cores).
    pub worker_threads: u32,
}

/// Link rate one runtime worker thread is given when `runtime.worker_threads` is 0 (auto).
/// The workers only move packets: the per-chunk copying and hashing runs on the runtime's
/// blocking pool (`kvferry_peer`'s `offload`). Measured (2026-12-05, `kvferry bench
/// --no-decisions --no-baselines`, this 2-core VM; `bench/results/offload-2026-12-05/`): at
/// 1 Gbit/s one worker with the chunk work offloaded costs 1.7–2.0 CPU s/GiB per side where
/// two workers (the earlier rule, chunk work inline) cost 1.9–2.5 at the same rate (2 GiB at
/// 1 Gbit/s × 150 ms: 94.9 % of the link either way); before the offload, one worker lost 1–5
/// points of 1 Gbit/s to chunk work on the thread that reads the socket. At 100 Mbit/s two
/// workers cost about twice the CPU of one (their wake-ups of each other). At ~2 CPU s/GiB a
/// worker's packet work is half a core at 2 Gbit/s, hence one worker per 2 Gbit/s; one
/// connection on direct loopback moves 2.3–3.3 Gbit/s on one core
/// (`bench/results/wire-loopback.md`), so the cores, not this rule, cap faster links.
pub const GBPS_PER_WORKER: f64 = 2.0;

/// The most worker threads `runtime.worker_threads` may ask for.
pub const MAX_WORKER_THREADS: u32 = 1024;

/// Policy defaults applied when a request leaves them unset.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyDefaults {
    /// Seconds (in ms) a real split costs beyond its slower leg: the prior of each engine's
    /// overhead, which executed splits then measure (with `calibrate`; as is without).
    pub split_overhead_ms: f64,
    pub split_min_gain: f64,
    /// Send eviction hints: after a peer fetched a whole chain of blocks out of an engine's
    /// pool (the session moved away; a verified copy now lives in the peer region), hint that
    /// engine to evict those blocks if its pool is at least `eviction_hint_pool_use` full.
    /// Hints, never commands: an engine may ignore them or evict only unreferenced blocks.
    pub eviction_hints: bool,
    /// Fraction of an engine's pool in use (blocks it reported stored) from which hints are sent.
    pub eviction_hint_pool_use: f64,
    /// Decide from calibrated costs: every executed fetch and recompute refits the link's fixed
    /// and per-byte cost and the engine's wall-time prefill cost (`kvferry_model::calibration`).
    /// `false`: the live estimator's figures and the engine's reported profile, uncorrected.
    pub calibrate: bool,
    /// Hedging (recompute and fetch at once, keep the first to finish) when the calibrated
    /// bands straddle the crossover: `off`, `on_request` (when the request's policy sets
    /// `allow_hedge`) or `always`.
    pub hedge: HedgeMode,
    /// Bands are `seconds ± hedge_band_z · sd`; a hedge is considered only where they overlap.
    pub hedge_band_z: f64,
    /// Smallest expected relative gain of a hedge over the better pure action.
    pub hedge_min_gain: f64,
    /// Smallest expected absolute gain of a hedge over the better pure action, in ms: a hedge
    /// has fixed costs its relative interference does not carry (a second leg started and
    /// cancelled, both legs' first CPU burst on shared cores); every hedge of a ~60 ms prefix
    /// in the bench of 2026-12-03 lost by 2–18 ms. At most 10 000.
    pub hedge_min_gain_ms: f64,
    /// Cost cap: the most target-compute seconds a hedge may be expected to waste on a
    /// recompute that loses, in ms (0: no cap).
    pub hedge_max_wasted_compute_ms: f64,
    /// Prior of the hedge interference: the relative slowdown of each leg of a hedge while the
    /// other races it (they share this host's cores when the engine prefills on CPU). With
    /// `calibrate`, an engine's measured split interference replaces it, and its executed
    /// hedges' own measurement (the winner's time until the engine can use the prefix — a
    /// winning fetch plus its priced load — against the race's expected time) replaces that;
    /// a hedge that cannot beat the better pure action by `hedge_min_gain` once slowed is not
    /// run. At most 4.
    pub hedge_interference: f64,
    /// Prior of the split interference: the relative slowdown of each leg of a split while the
    /// other runs (0: separate resources). With `calibrate`, each engine's executed splits
    /// replace it with the measured slowdown (median of recent splits, the prior holding the
    /// places of the first three not yet taken); a split that cannot
    /// beat the better pure action by `split_min_gain` once slowed is not chosen. At most 4.
    pub split_interference: f64,
    /// Plan each split with at least the interference this host's CPU shares predict
    /// (`(other + prefill + fetch cores) / cores − 1`, [`crate::hostcpu`]): the other work on
    /// the host, the engine's prefill and the fetch's CPU at the link's rate, measured here.
    /// Off: only the prior and the executed splits decide.
    pub split_cpu_floor: bool,
    /// A split is taken only where its time is predictable: within `split_tolerance` (a
    /// fraction of its expected time) with probability at least `split_min_confidence`. On a
    /// lossy path a short fetch leg is on time or a round trip late (the calibrated loss
    /// tail); a split whose gain rides on that coin flip is a gamble the daemon does not commit
    /// two paths to, and it says so in the decision's reason. `split_min_confidence = 0`: every
    /// split on expected time alone. Both in [0, 1].
    pub split_tolerance: f64,
    pub split_min_confidence: f64,
    /// The prior of how far a split's time scatters around the outcome it was predicted at (a
    /// relative sd, in [0, 1]), worth eight splits; each engine's executed splits refine it
    /// (`kvferry_model::calibration::SplitScatter`). An outcome predicted near the edge of
    /// `split_tolerance` lands inside only about half the time, and the confidence counts that.
    /// 0: outcomes exact until splits show otherwise.
    pub split_noise: f64,
}

/// When the daemon hedges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum HedgeMode {
    /// Never.
    Off,
    /// When the request's policy sets `allow_hedge`.
    #[default]
    OnRequest,
    /// Whenever the bands straddle, asked or not.
    Always,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            region: "region-a".into(),
            trust_domain: "kvferry.local".into(),
            run_dir: PathBuf::from("/run/kvferry"),
            listen: Listen::default(),
            auth: Auth::default(),
            tls: Tls::default(),
            router_tls: RouterTls::default(),
            peers: Vec::new(),
            limits: Limits::default(),
            listeners: Listeners::default(),
            transfer: Transfer::default(),
            runtime: Runtime::default(),
            policy: PolicyDefaults::default(),
            faults: Faults::default(),
        }
    }
}

impl Default for Listen {
    fn default() -> Self {
        Self {
            grpc: "127.0.0.1:7070".parse().unwrap_or_else(|_| unreachable_addr()),
            peer: "127.0.0.1:7071".parse().unwrap_or_else(|_| unreachable_addr()),
            http: "127.0.0.1:7072".parse().unwrap_or_else(|_| unreachable_addr()),
        }
    }
}

fn unreachable_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

impl Default for Tls {
    fn default() -> Self {
        Self {
            mode: TlsMode::Dev,
            dev_dir: PathBuf::from("/run/kvferry/dev-ca"),
            ca: PathBuf::new(),
            cert: PathBuf::new(),
            key: PathBuf::new(),
            reload_poll_ms: 10_000,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            staging_bytes: 256 << 20,
            landing_zone_bytes: 1 << 30,
            landing_prefault: false,
            max_tokens: 1 << 20,
            max_concurrent_migrations: 64,
            default_deadline_ms: 30_000,
            attach_grace_ms: 30_000,
            pool_offer_timeout_ms: 5_000,
            pool_offer_ttl_ms: 30_000,
            max_pending_pool_offers: 64,
            stream_stall_ms: 30_000,
        }
    }
}

impl Default for Transfer {
    fn default() -> Self {
        let fetch = kvferry_peer::FetchPolicy::default();
        Self {
            chunk_bytes: 4 << 20,
            streams: 4,
            stripes: 1,
            congestion: Congestion::Cubic,
            loss_tolerance: kvferry_peer::tolerant::DEFAULT_LOSS_TOLERANCE,
            idle_timeout_ms: 10_000,
            max_retries_per_chunk: fetch.max_retries_per_chunk,
            missing_grace_ms: fetch.missing_grace.as_millis() as u64,
            reconnect_backoff_ms: fetch.reconnect_backoff.as_millis() as u64,
            auto_fallback_ms: 1500,
            ack_eliciting_threshold: kvferry_peer::transport::DEFAULT_ACK_ELICITING_THRESHOLD,
            recv_coalesce_us: kvferry_peer::transport::DEFAULT_RECV_COALESCE.as_micros() as u64,
        }
    }
}

impl Default for PolicyDefaults {
    fn default() -> Self {
        Self {
            split_overhead_ms: 0.5,
            split_min_gain: 0.05,
            eviction_hints: true,
            eviction_hint_pool_use: 0.9,
            calibrate: true,
            hedge: HedgeMode::OnRequest,
            hedge_band_z: 1.0,
            hedge_min_gain: 0.02,
            hedge_min_gain_ms: 10.0,
            hedge_max_wasted_compute_ms: 0.0,
            hedge_interference: 0.0,
            split_interference: 0.0,
            split_cpu_floor: true,
            split_tolerance: 0.15,
            split_min_confidence: 0.9,
            split_noise: 0.03,
        }
    }
}

impl Config {
    /// Reads and validates a file.
    pub fn load(path: &std::path::Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        let cfg = Self::parse(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse { path: path.to_owned(), message },
            other => other,
        })?;
        Ok(cfg)
    }

    /// Parses and validates TOML text.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let cfg: Config = toml::from_str(text)
            .map_err(|e| ConfigError::Parse { path: PathBuf::new(), message: e.to_string() })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Applies `KVFERRY_*` environment overrides (region, run dir, listen addresses, token,
    /// runtime workers, the QUIC ACK frequency).
    pub fn apply_env(&mut self, get: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        let addr = |k: &str, v: String| {
            v.parse::<SocketAddr>().map_err(|_| invalid(k, format!("not an address: {v}")))
        };
        if let Some(v) = get("KVFERRY_REGION") {
            self.region = v;
        }
        if let Some(v) = get("KVFERRY_RUN_DIR") {
            self.run_dir = v.into();
        }
        if let Some(v) = get("KVFERRY_LISTEN_GRPC") {
            self.listen.grpc = addr("KVFERRY_LISTEN_GRPC", v)?;
        }
        if let Some(v) = get("KVFERRY_LISTEN_PEER") {
            self.listen.peer = addr("KVFERRY_LISTEN_PEER", v)?;
        }
        if let Some(v) = get("KVFERRY_LISTEN_HTTP") {
            self.listen.http = addr("KVFERRY_LISTEN_HTTP", v)?;
        }
        if let Some(v) = get("KVFERRY_BEARER_TOKEN") {
            self.auth.bearer_token = v;
        }
        if let Some(v) = get("KVFERRY_RUNTIME_WORKER_THREADS") {
            self.runtime.worker_threads = v
                .trim()
                .parse()
                .map_err(|_| invalid("KVFERRY_RUNTIME_WORKER_THREADS", format!("not a thread count: {v}")))?;
        }
        if let Some(v) = get("KVFERRY_TRANSFER_ACK_ELICITING_THRESHOLD") {
            self.transfer.ack_eliciting_threshold = v.trim().parse().map_err(|_| {
                invalid("KVFERRY_TRANSFER_ACK_ELICITING_THRESHOLD", format!("not a packet count: {v}"))
            })?;
        }
        self.validate()
    }

    /// Every rule, checked before anything binds.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let name_ok = |s: &str| {
            !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
        };
        if !name_ok(&self.region) {
            return Err(invalid("region", "must be non-empty: letters, digits, '-', '.', '_'"));
        }
        if !name_ok(&self.trust_domain) {
            return Err(invalid("trust_domain", "must be non-empty: letters, digits, '-', '.', '_'"));
        }
        if !self.faults.fail_loads.is_empty() && !cfg!(feature = "fault-injection") {
            return Err(invalid(
                "faults.fail_loads",
                "fault injection is for test builds: this daemon was built without feature `fault-injection`",
            ));
        }
        if !self.faults.corrupt.is_empty() && !cfg!(feature = "fault-injection") {
            return Err(invalid(
                "faults.corrupt",
                "fault injection is for test builds: this daemon was built without feature `fault-injection`",
            ));
        }
        match self.tls.mode {
            TlsMode::Dev => {}
            TlsMode::Files => {
                for (f, p) in
                    [("tls.ca", &self.tls.ca), ("tls.cert", &self.tls.cert), ("tls.key", &self.tls.key)]
                {
                    if p.as_os_str().is_empty() {
                        return Err(invalid(f, "is required with tls.mode = \"files\""));
                    }
                }
            }
        }
        if self.runtime.worker_threads > MAX_WORKER_THREADS {
            return Err(invalid(
                "runtime.worker_threads",
                format!("must be at most {MAX_WORKER_THREADS} (0 = auto)"),
            ));
        }
        if self.tls.reload_poll_ms != 0 && self.tls.reload_poll_ms < 100 {
            return Err(invalid("tls.reload_poll_ms", "must be 0 (off) or at least 100"));
        }
        match self.router_tls.mode {
            RouterTlsMode::Off | RouterTlsMode::Dev => {}
            RouterTlsMode::Files => {
                let r = &self.router_tls;
                for (f, p) in [
                    ("router_tls.cert", &r.cert),
                    ("router_tls.key", &r.key),
                    ("router_tls.client_ca", &r.client_ca),
                ] {
                    if p.as_os_str().is_empty() {
                        return Err(invalid(f, "is required with router_tls.mode = \"files\""));
                    }
                }
            }
        }
        let mut seen = std::collections::HashSet::new();
        for (i, p) in self.peers.iter().enumerate() {
            if !name_ok(&p.region) {
                return Err(invalid(format!("peers[{i}].region"), "must be a region name"));
            }
            if p.region == self.region {
                return Err(invalid(format!("peers[{i}].region"), "must differ from this daemon's region"));
            }
            if !seen.insert(&p.region) {
                return Err(invalid(format!("peers[{i}].region"), format!("{} is listed twice", p.region)));
            }
            if !(p.gbps.is_finite() && p.gbps > 0.0) {
                return Err(invalid(format!("peers[{i}].gbps"), "must be > 0"));
            }
            if !(p.rtt_ms.is_finite() && p.rtt_ms >= 0.0) {
                return Err(invalid(format!("peers[{i}].rtt_ms"), "must be >= 0"));
            }
            if !(p.max_egress_gbps.is_finite() && p.max_egress_gbps >= 0.0) {
                return Err(invalid(format!("peers[{i}].max_egress_gbps"), "must be >= 0 (0 = no cap)"));
            }
            if let Some(tenants) = &p.tenants {
                let mut names = std::collections::HashSet::new();
                for (j, t) in tenants.iter().enumerate() {
                    if t.len() > crate::plan::MAX_ID_BYTES {
                        return Err(invalid(
                            format!("peers[{i}].tenants[{j}]"),
                            format!(
                                "is {} bytes; a tenant is at most {}",
                                t.len(),
                                crate::plan::MAX_ID_BYTES
                            ),
                        ));
                    }
                    if !names.insert(t) {
                        return Err(invalid(
                            format!("peers[{i}].tenants[{j}]"),
                            format!("{t:?} is listed twice"),
                        ));
                    }
                }
            }
        }
        let l = &self.limits;
        if l.staging_bytes < (8 << 20) {
            return Err(invalid("limits.staging_bytes", "must be at least 8 MiB"));
        }
        if l.landing_zone_bytes < (16 << 20) {
            return Err(invalid("limits.landing_zone_bytes", "must be at least 16 MiB"));
        }
        if l.max_tokens == 0
            || l.max_concurrent_migrations == 0
            || l.default_deadline_ms == 0
            || l.attach_grace_ms == 0
        {
            return Err(invalid(
                "limits",
                "max_tokens, max_concurrent_migrations, default_deadline_ms and attach_grace_ms must be > 0",
            ));
        }
        if l.pool_offer_timeout_ms == 0
            || l.pool_offer_ttl_ms == 0
            || l.max_pending_pool_offers == 0
            || l.stream_stall_ms == 0
        {
            return Err(invalid(
                "limits",
                "pool_offer_timeout_ms, pool_offer_ttl_ms, max_pending_pool_offers and stream_stall_ms must be > 0 \
                 (0 would mean unbounded)",
            ));
        }
        let n = &self.listeners;
        if n.max_connections == 0 {
            return Err(invalid("listeners.max_connections", "must be > 0"));
        }
        if n.handshake_timeout_ms == 0 || n.idle_timeout_ms == 0 {
            return Err(invalid("listeners", "handshake_timeout_ms and idle_timeout_ms must be > 0"));
        }
        let t = &self.transfer;
        if !(64 << 10..=64 << 20).contains(&t.chunk_bytes) {
            return Err(invalid("transfer.chunk_bytes", "must be between 64 KiB and 64 MiB"));
        }
        if !(1..=64).contains(&t.streams) {
            return Err(invalid("transfer.streams", "must be between 1 and 64"));
        }
        if !(1..=kvferry_peer::stripe::MAX_STRIPES).contains(&t.stripes) {
            return Err(invalid("transfer.stripes", "must be between 1 and 8"));
        }
        if !(500..=600_000).contains(&t.idle_timeout_ms) {
            return Err(invalid("transfer.idle_timeout_ms", "must be between 500 and 600000"));
        }
        if t.max_retries_per_chunk > 100 {
            return Err(invalid("transfer.max_retries_per_chunk", "must be at most 100"));
        }
        if !(10..=600_000).contains(&t.missing_grace_ms) {
            return Err(invalid("transfer.missing_grace_ms", "must be between 10 and 600000"));
        }
        if t.reconnect_backoff_ms > 10_000 {
            return Err(invalid("transfer.reconnect_backoff_ms", "must be at most 10000"));
        }
        if !(50..=60_000).contains(&t.auto_fallback_ms) {
            return Err(invalid("transfer.auto_fallback_ms", "must be between 50 and 60000"));
        }
        if t.ack_eliciting_threshold > 1000 {
            return Err(invalid("transfer.ack_eliciting_threshold", "must be between 0 and 1000"));
        }
        if !(0.0..=0.5).contains(&t.loss_tolerance) {
            return Err(invalid("transfer.loss_tolerance", "must be between 0 and 0.5"));
        }
        if t.recv_coalesce_us > 20_000 {
            return Err(invalid("transfer.recv_coalesce_us", "must be between 0 and 20000"));
        }
        let p = &self.policy;
        if !(p.split_overhead_ms.is_finite() && (0.0..=60_000.0).contains(&p.split_overhead_ms)) {
            return Err(invalid("policy.split_overhead_ms", "must be between 0 and 60000"));
        }
        if !(p.hedge_band_z.is_finite() && p.hedge_band_z >= 0.0) {
            return Err(invalid("policy.hedge_band_z", "must be >= 0"));
        }
        if !(0.0..1.0).contains(&p.hedge_min_gain) {
            return Err(invalid("policy.hedge_min_gain", "must be in [0, 1)"));
        }
        if !(0.0..=10_000.0).contains(&p.hedge_min_gain_ms) {
            return Err(invalid("policy.hedge_min_gain_ms", "must be in [0, 10000]"));
        }
        if !(p.hedge_max_wasted_compute_ms.is_finite() && p.hedge_max_wasted_compute_ms >= 0.0) {
            return Err(invalid("policy.hedge_max_wasted_compute_ms", "must be >= 0"));
        }
        if !(0.0..=4.0).contains(&p.hedge_interference) {
            return Err(invalid("policy.hedge_interference", "must be in [0, 4]"));
        }
        if !(0.0..=4.0).contains(&p.split_interference) {
            return Err(invalid("policy.split_interference", "must be in [0, 4]"));
        }
        if !(0.0..=1.0).contains(&p.split_min_gain) {
            return Err(invalid("policy.split_min_gain", "must be in [0, 1]"));
        }
        if !(0.0..=1.0).contains(&p.split_tolerance) {
            return Err(invalid("policy.split_tolerance", "must be in [0, 1]"));
        }
        if !(0.0..=1.0).contains(&p.split_min_confidence) {
            return Err(invalid("policy.split_min_confidence", "must be in [0, 1]"));
        }
        if !(0.0..=1.0).contains(&p.split_noise) {
            return Err(invalid("policy.split_noise", "must be in [0, 1]"));
        }
        if !(0.0..=1.0).contains(&p.eviction_hint_pool_use) {
            return Err(invalid("policy.eviction_hint_pool_use", "must be in [0, 1]"));
        }
        Ok(())
    }

    /// The TOML text of this configuration: what [`Config::parse`] reads back as an equal
    /// value. For tools and tests that write a daemon's config file.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| unreachable!("a Config always serializes: {e}"))
    }

    /// Worker threads for the daemon's runtime on a host with `cores` cores:
    /// `runtime.worker_threads` when set (as given), else one per [`GBPS_PER_WORKER`] of the fastest peer's
    /// expected rate (no peers: one), at least 1 and at most `cores`. Every extra worker costs
    /// wake-ups (a parked worker is woken to steal each time another finds work), so a slow
    /// link runs on one.
    pub fn runtime_workers(&self, cores: usize) -> usize {
        let cores = cores.max(1);
        if self.runtime.worker_threads > 0 {
            return self.runtime.worker_threads as usize;
        }
        let fastest = self.peers.iter().map(|p| p.gbps).filter(|g| g.is_finite()).fold(0.0_f64, f64::max);
        // Finite and non-negative (validated), so the cast is exact for any sane rate and
        // saturates otherwise.
        ((fastest / GBPS_PER_WORKER).ceil() as usize).clamp(1, cores)
    }

    /// `<run_dir>/engine.sock`.
    pub fn engine_socket(&self) -> PathBuf {
        self.run_dir.join("engine.sock")
    }

    /// `<run_dir>/pool.sock`.
    pub fn pool_socket(&self) -> PathBuf {
        self.run_dir.join("pool.sock")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_template_parses_and_matches_the_defaults() {
        let text = include_str!("../../../deploy/kvferry.toml");
        let cfg = Config::parse(text).expect("deploy/kvferry.toml must parse");
        // The template documents one example peer; everything else is the default.
        let want = Config { peers: cfg.peers.clone(), ..Config::default() };
        assert_eq!(cfg, want);
        assert_eq!(cfg.peers.len(), 1);
    }

    #[test]
    fn runtime_workers_follow_the_fastest_peer_within_the_cores_unless_set() {
        let with = |gbps: &[f64], workers: u32| {
            let mut c = Config::default();
            c.runtime.worker_threads = workers;
            c.peers = gbps
                .iter()
                .enumerate()
                .map(|(i, g)| Peer {
                    region: format!("p{i}"),
                    addr: "127.0.0.1:1".parse().unwrap(),
                    gbps: *g,
                    rtt_ms: 50.0,
                    max_egress_gbps: 0.0,
                    tenants: None,
                    transport: TransportChoice::default(),
                })
                .collect();
            c
        };
        // No peers, slow peers: one worker; the fastest peer decides.
        assert_eq!(with(&[], 0).runtime_workers(16), 1);
        assert_eq!(with(&[0.1, 0.5], 0).runtime_workers(16), 1);
        assert_eq!(with(&[1.0, 0.1], 0).runtime_workers(16), 1);
        assert_eq!(with(&[2.0], 0).runtime_workers(16), 1);
        assert_eq!(with(&[0.1, 2.5], 0).runtime_workers(16), 2);
        assert_eq!(with(&[10.0], 0).runtime_workers(16), 5);
        assert_eq!(with(&[10.0], 0).runtime_workers(2), 2, "never more than the cores");
        assert_eq!(with(&[100.0], 0).runtime_workers(16), 16);
        assert_eq!(with(&[100.0], 0).runtime_workers(0), 1, "at least one");
        // Monotone in the rate and in the cores.
        let mut last = 0;
        for g in 1..400 {
            let n = with(&[f64::from(g) * 0.25], 0).runtime_workers(8);
            assert!(n >= last && (1..=8).contains(&n));
            last = n;
        }
        // Set: taken as given, whatever the peers or cores.
        assert_eq!(with(&[100.0], 3).runtime_workers(16), 3);
        assert_eq!(with(&[], 4).runtime_workers(2), 4);
        let mut c = Config::parse("[runtime]\nworker_threads = 2").unwrap();
        assert_eq!(c.runtime.worker_threads, 2);
        c.apply_env(|k| (k == "KVFERRY_RUNTIME_WORKER_THREADS").then(|| "3".to_owned())).unwrap();
        assert_eq!(c.runtime.worker_threads, 3, "the environment overrides the file");
        let e = c.apply_env(|k| (k == "KVFERRY_RUNTIME_WORKER_THREADS").then(|| "two".to_owned()));
        assert!(e.unwrap_err().to_string().contains("KVFERRY_RUNTIME_WORKER_THREADS"));
        let ack = |v: &'static str| {
            move |k: &str| (k == "KVFERRY_TRANSFER_ACK_ELICITING_THRESHOLD").then(|| v.to_owned())
        };
        c.apply_env(ack("32")).unwrap();
        assert_eq!(c.transfer.ack_eliciting_threshold, 32);
        for bad in ["many", "-1", "5000"] {
            let e = c.apply_env(ack(bad)).unwrap_err().to_string();
            assert!(e.contains("ack_eliciting_threshold") || e.contains("ACK_ELICITING"), "{bad}: {e}");
        }
        let e = Config::parse("[runtime]\nworker_threads = 5000").unwrap_err();
        assert!(e.to_string().contains("runtime.worker_threads"), "{e}");
        assert!(Config::parse("[runtime]\nworkers = 2").is_err(), "unknown keys are refused");
    }

    #[test]
    fn the_split_overhead_default_is_the_models() {
        // `kvferry plan` (the model's default) and the daemon price a split alike.
        let model = kvferry_model::Policy::default().split_overhead_s;
        assert_eq!(Config::default().policy.split_overhead_ms / 1000.0, model);
    }

    #[test]
    fn the_fetch_policy_is_settable_and_defaults_to_the_peer_crates() {
        // Unset: exactly the peer crate's defaults.
        assert_eq!(Config::default().transfer.fetch_policy(), kvferry_peer::FetchPolicy::default());
        assert_eq!(Config::parse("").unwrap().transfer.fetch_policy(), kvferry_peer::FetchPolicy::default());
        let c = Config::parse(
            "[transfer]\nmax_retries_per_chunk = 0\nmissing_grace_ms = 250\nreconnect_backoff_ms = 100",
        )
        .unwrap();
        let f = c.transfer.fetch_policy();
        assert_eq!(f.max_retries_per_chunk, 0);
        assert_eq!(f.missing_grace, std::time::Duration::from_millis(250));
        assert_eq!(f.reconnect_backoff, std::time::Duration::from_millis(100));
        // The edges of the allowed ranges parse.
        Config::parse(
            "[transfer]\nmax_retries_per_chunk = 100\nmissing_grace_ms = 10\nreconnect_backoff_ms = 10000",
        )
        .unwrap();
        // A written config reads back the same.
        let text = toml::to_string(&c).unwrap();
        assert_eq!(Config::parse(&text).unwrap(), c);
    }

    #[test]
    fn bad_configs_name_the_field() {
        let cases = [
            ("region = \"\"", "region"),
            ("[tls]\nmode = \"magic\"", "tls.mode"),
            ("[tls]\nmode = \"files\"", "tls.ca"),
            ("[router_tls]\nmode = \"on\"", "router_tls.mode"),
            ("[router_tls]\nmode = \"files\"", "router_tls.cert"),
            ("[router_tls]\nmode = \"files\"\ncert = \"c\"\nkey = \"k\"", "router_tls.client_ca"),
            ("[[peers]]\nregion = \"region-a\"\naddr = \"127.0.0.1:1\"", "peers[0].region"),
            ("[[peers]]\nregion = \"b\"\naddr = \"127.0.0.1:1\"\ngbps = 0", "peers[0].gbps"),
            ("[limits]\nstaging_bytes = 1", "limits.staging_bytes"),
            ("[limits]\npool_offer_ttl_ms = 0", "limits"),
            ("[listeners]\nmax_connections = 0", "listeners.max_connections"),
            ("[listeners]\nidle_timeout_ms = 0", "listeners"),
            ("[transfer]\ncongestion = \"vegas\"", "transfer.congestion"),
            ("[transfer]\nstreams = 0", "transfer.streams"),
            ("[transfer]\nstripes = 0", "transfer.stripes"),
            ("[transfer]\nstripes = 9", "transfer.stripes"),
            ("[transfer]\nidle_timeout_ms = 10", "transfer.idle_timeout_ms"),
            ("[transfer]\nmax_retries_per_chunk = 101", "transfer.max_retries_per_chunk"),
            ("[transfer]\nmissing_grace_ms = 0", "transfer.missing_grace_ms"),
            ("[transfer]\nmissing_grace_ms = 700000", "transfer.missing_grace_ms"),
            ("[transfer]\nreconnect_backoff_ms = 10001", "transfer.reconnect_backoff_ms"),
            ("[transfer]\nauto_fallback_ms = 10", "transfer.auto_fallback_ms"),
            ("[transfer]\nack_eliciting_threshold = 5000", "transfer.ack_eliciting_threshold"),
            ("[transfer]\nloss_tolerance = 0.9", "transfer.loss_tolerance"),
            ("[transfer]\nloss_tolerance = -0.1", "transfer.loss_tolerance"),
            ("[transfer]\nrecv_coalesce_us = 50000", "transfer.recv_coalesce_us"),
            (
                "[[peers]]\nregion = \"b\"\naddr = \"127.0.0.1:1\"\ntransport = \"sctp\"",
                "peers[].transport: must be",
            ),
            ("[transfer]\nmax_retries_per_chunk = -1", "max_retries_per_chunk"),
            ("[tls]\nreload_poll_ms = 5", "tls.reload_poll_ms"),
            (
                "[[peers]]\nregion = \"b\"\naddr = \"127.0.0.1:1\"\nmax_egress_gbps = -1",
                "peers[0].max_egress_gbps",
            ),
            (
                "[[peers]]\nregion = \"b\"\naddr = \"127.0.0.1:1\"\ntenants = [\"t\", \"u\", \"t\"]",
                "peers[0].tenants[2]",
            ),
            ("[[peers]]\nregion = \"b\"\naddr = \"127.0.0.1:1\"\ntenants = \"t\"", "tenants"),
            ("[policy]\nsplit_min_gain = 2", "policy.split_min_gain"),
            ("[policy]\nsplit_tolerance = -0.1", "policy.split_tolerance"),
            ("[policy]\nsplit_min_confidence = 1.5", "policy.split_min_confidence"),
            ("[policy]\nsplit_noise = -0.01", "policy.split_noise"),
            ("[policy]\nsplit_overhead_ms = -1", "policy.split_overhead_ms"),
            ("[policy]\nsplit_overhead_ms = 1e9", "policy.split_overhead_ms"),
            ("[policy]\nsplit_noise = nan", "policy.split_noise"),
            ("[policy]\nhedge_min_gain = 1", "policy.hedge_min_gain"),
            ("[policy]\nhedge_min_gain_ms = -1", "policy.hedge_min_gain_ms"),
            ("[policy]\nhedge_min_gain_ms = nan", "policy.hedge_min_gain_ms"),
            ("[policy]\nhedge_band_z = -1", "policy.hedge_band_z"),
            ("[policy]\nhedge_interference = -0.5", "policy.hedge_interference"),
            ("[policy]\nhedge_interference = 4.5", "policy.hedge_interference"),
            ("[policy]\nsplit_interference = 5", "policy.split_interference"),
            ("[policy]\nsplit_interference = -1", "policy.split_interference"),
            ("[policy]\neviction_hint_pool_use = 1.5", "policy.eviction_hint_pool_use"),
        ];
        for (text, field) in cases {
            let e = Config::parse(text).unwrap_err().to_string();
            assert!(e.contains(field), "{text:?}: {e}");
        }
        assert!(Config::parse("bogus = 1").unwrap_err().to_string().contains("bogus"));
    }

    #[test]
    fn peer_tenant_allow_lists_parse_validate_and_round_trip() {
        let text = "[[peers]]\nregion = \"b\"\naddr = \"127.0.0.1:1\"\ntenants = [\"t1\", \"t2\"]\n\
                    [[peers]]\nregion = \"c\"\naddr = \"127.0.0.1:2\"\n\
                    [[peers]]\nregion = \"d\"\naddr = \"127.0.0.1:3\"\ntenants = []";
        let c = Config::parse(text).unwrap();
        assert_eq!(c.peers[0].tenants, Some(vec!["t1".to_owned(), "t2".to_owned()]));
        assert_eq!((c.peers[1].tenants.clone(), c.peers[2].tenants.clone()), (None, Some(vec![])));
        assert!(c.peers[0].allows("t1") && !c.peers[0].allows("t3"));
        assert!(c.peers[1].allows("anyone"), "no list: every tenant");
        assert!(!c.peers[2].allows("t1"), "an empty list: no tenant");
        let scopes = crate::catalog::TenantScopes::new(&c.peers);
        assert!(scopes.allows("b", "t2") && !scopes.allows("b", "t3") && scopes.allows("c", "t3"));
        assert!(!scopes.allows("d", "t1") && !scopes.allows("not-a-peer", "t1"));
        assert_eq!(Config::parse(&c.to_toml()).unwrap(), c, "round trip");
        let long =
            format!("[[peers]]\nregion = \"b\"\naddr = \"127.0.0.1:1\"\ntenants = [\"{}\"]", "x".repeat(257));
        assert!(Config::parse(&long).unwrap_err().to_string().contains("peers[0].tenants[0]"));
    }

    #[test]
    fn fixed_value_settings_are_typed_and_round_trip() {
        // Every value of every fixed-value setting is written out and read back unchanged.
        for (tls, router, cc) in [
            (TlsMode::Dev, RouterTlsMode::Off, Congestion::Cubic),
            (TlsMode::Files, RouterTlsMode::Dev, Congestion::Bbr),
            (TlsMode::Dev, RouterTlsMode::Files, Congestion::NewReno),
        ] {
            let mut c = Config::default();
            (c.tls.mode, c.router_tls.mode, c.transfer.congestion) = (tls, router, cc);
            // The files modes need their paths to validate.
            (c.tls.ca, c.tls.cert, c.tls.key) = ("ca.pem".into(), "c.pem".into(), "k.pem".into());
            let r = &mut c.router_tls;
            (r.cert, r.key, r.client_ca) = ("rc.pem".into(), "rk.pem".into(), "rca.pem".into());
            let text = c.to_toml();
            let back = Config::parse(&text).unwrap();
            assert_eq!(back, c, "{text}");
        }
        // The congestion spellings the peer crate accepts are still accepted.
        let c = Config::parse("[transfer]\ncongestion = \"New-Reno\"").unwrap();
        assert_eq!(c.transfer.congestion, Congestion::NewReno);
        let c = Config::parse("[transfer]\ncongestion = \"Loss-Tolerant\"\nloss_tolerance = 0.02").unwrap();
        assert_eq!((c.transfer.congestion, c.transfer.loss_tolerance), (Congestion::Tolerant, 0.02));
        // The file's spellings of a transport are the peer crate's own.
        for (n, v) in <TransportChoice as Choice>::NAMES {
            assert_eq!((TransportChoice::parse(n), v.name()), (Some(*v), *n));
        }
        // Every transport choice of a peer entry round-trips; the default is QUIC.
        let peer = "[[peers]]\nregion = \"b\"\naddr = \"127.0.0.1:1\"";
        assert_eq!(Config::parse(peer).unwrap().peers[0].transport, TransportChoice::Quic);
        for t in [TransportChoice::Quic, TransportChoice::Tcp, TransportChoice::Auto] {
            let c = Config::parse(&format!("{peer}\ntransport = \"{}\"", t.name())).unwrap();
            assert_eq!(c.peers[0].transport, t);
            assert_eq!(Config::parse(&c.to_toml()).unwrap(), c);
        }
        // An unknown value is a parse error naming the field and the values it takes.
        for (text, want) in [
            ("[tls]\nmode = \"Dev\"", "tls.mode: must be one of \"dev\", \"files\", got \"Dev\""),
            ("[router_tls]\nmode = \"on\"", "router_tls.mode: must be one of \"off\", \"dev\", \"files\""),
            ("[transfer]\ncongestion = \"vegas\"", "transfer.congestion: must be"),
        ] {
            let e = Config::parse(text).unwrap_err();
            assert!(matches!(e, ConfigError::Parse { .. }), "{text:?}: {e:?}");
            assert!(e.to_string().contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn faults_are_honoured_only_by_fault_injection_builds() {
        let text = "[[faults.corrupt]]\ntenant = \"t\"\nchunks = 2";
        let parsed = Config::parse(text);
        #[cfg(feature = "fault-injection")]
        assert_eq!(parsed.unwrap().faults.corrupt, vec![CorruptFault { tenant: "t".into(), chunks: 2 }]);
        #[cfg(not(feature = "fault-injection"))]
        assert!(parsed.unwrap_err().to_string().contains("faults.corrupt"));
        let parsed = Config::parse("[faults]\nfail_loads = [\"t\"]");
        #[cfg(feature = "fault-injection")]
        assert_eq!(parsed.unwrap().faults.fail_loads, vec!["t".to_owned()]);
        #[cfg(not(feature = "fault-injection"))]
        assert!(parsed.unwrap_err().to_string().contains("faults.fail_loads"));
    }

    #[test]
    fn environment_overrides_apply_and_validate() {
        let mut c = Config::default();
        let env = |k: &str| match k {
            "KVFERRY_REGION" => Some("eu-west".to_owned()),
            "KVFERRY_LISTEN_GRPC" => Some("127.0.0.1:9".to_owned()),
            _ => None,
        };
        c.apply_env(env).unwrap();
        assert_eq!(c.region, "eu-west");
        assert_eq!(c.listen.grpc.port(), 9);
        let bad = |k: &str| (k == "KVFERRY_LISTEN_PEER").then(|| "nowhere".to_owned());
        assert!(c.apply_env(bad).unwrap_err().to_string().contains("KVFERRY_LISTEN_PEER"));
    }
}
