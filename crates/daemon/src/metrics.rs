//! Prometheus metrics, rendered by hand in the text exposition format (no registry crate: a
//! few counters and gauges, all lock-free on the hot path).

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// A monotonically increasing counter.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.add(1);
    }
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A float gauge stored as bits.
#[derive(Debug, Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    pub fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Ordering::Relaxed);
    }
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

/// Every metric the daemon exports.
#[derive(Debug, Default)]
pub struct Metrics {
    pub decisions_fetch: Counter,
    pub decisions_recompute: Counter,
    pub decisions_split: Counter,
    pub decisions_local: Counter,
    pub fallbacks: Counter,
    pub migrations_failed: Counter,
    pub bytes_fetched: Counter,
    pub served_requests: Counter,
    /// Transfers ended because the engine withdrew a block while it was being read.
    pub served_reused: Counter,
    pub lookups: Counter,
    pub lookup_hit_tokens: Counter,
    pub lookup_tokens: Counter,
    pub eviction_hint_blocks: Counter,
    /// Hedged migrations by the leg that finished first.
    pub hedges_fetch_won: Counter,
    pub hedges_recompute_won: Counter,
    /// Milliseconds a losing hedged recompute had run when the fetch won.
    pub hedge_wasted_ms: Counter,
    /// Recomputes the daemon gave up on at their deadline and told the engine to cancel...
    pub recompute_cancels: Counter,
    /// ...and the engines' acknowledgements (RecomputeDone with `cancelled`).
    pub recompute_cancels_acked: Counter,
    /// Fetches that joined another migration's in-flight fetch of the same blocks.
    pub fetches_joined: Counter,
    /// KV payload bytes read for peers (pools and landing zone), before checksumming.
    pub served_bytes: Counter,
    /// Requests refused by `peers[].tenants`, as the owner (serve) and as the requester (fetch).
    pub tenant_denied_serve: Counter,
    pub tenant_denied_fetch: Counter,
    /// TLS reloads by listener (peer, router) and result.
    pub tls_reloads_peer: Counter,
    pub tls_refused_peer: Counter,
    pub tls_reloads_router: Counter,
    pub tls_refused_router: Counter,
    /// Engine `Load` calls (landed blocks written into an engine's pool) by result, the bytes
    /// the successful ones wrote and the microseconds all of them took.
    pub engine_loads_ok: Counter,
    pub engine_loads_failed: Counter,
    pub engine_loaded_bytes: Counter,
    pub engine_load_us: Counter,
    pub last_goodput_gbps: Gauge,
    pub last_prediction_error: Gauge,
    /// The last split plan's CPU-share floor and what it was made of, in cores
    /// ([`crate::hostcpu::Floor`]).
    pub split_cpu_cores: Gauge,
    pub split_cpu_other: Gauge,
    pub split_cpu_prefill: Gauge,
    pub split_cpu_fetch: Gauge,
    pub split_cpu_floor: Gauge,
}

impl Metrics {
    /// Counts a reload of `which` that took effect.
    pub fn tls_reloaded(&self, which: crate::reload::Listener) {
        match which {
            crate::reload::Listener::Peer => self.tls_reloads_peer.inc(),
            crate::reload::Listener::Router => self.tls_reloads_router.inc(),
        }
    }

    /// Counts a reload of `which` whose files were refused.
    pub fn tls_refused(&self, which: crate::reload::Listener) {
        match which {
            crate::reload::Listener::Peer => self.tls_refused_peer.inc(),
            crate::reload::Listener::Router => self.tls_refused_router.inc(),
        }
    }

    /// Records one engine `Load`: its duration, and the bytes it wrote when it succeeded.
    pub fn engine_load(&self, took: std::time::Duration, written: Option<usize>) {
        self.engine_load_us.add(u64::try_from(took.as_micros()).unwrap_or(u64::MAX));
        match written {
            Some(bytes) => {
                self.engine_loads_ok.inc();
                self.engine_loaded_bytes.add(bytes as u64);
            }
            None => self.engine_loads_failed.inc(),
        }
    }

    /// Records the floor a plan was made with.
    pub fn split_floor(&self, f: &crate::hostcpu::Floor) {
        self.split_cpu_cores.set(f.cores);
        self.split_cpu_other.set(f.other);
        self.split_cpu_prefill.set(f.compute);
        self.split_cpu_fetch.set(f.fetch);
        self.split_cpu_floor.set(f.interference);
    }

    /// Renders the exposition text; `extra` appends per-peer and landing-zone gauges.
    pub fn render(&self, links: &[(String, f64, f64, f64)], landing: (u64, u64, u64, u64)) -> String {
        let mut o = String::new();
        let mut counter = |name: &str, help: &str, labels: &[(&str, u64)]| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter");
            for (l, v) in labels {
                if l.is_empty() {
                    let _ = writeln!(o, "{name} {v}");
                } else {
                    let _ = writeln!(o, "{name}{{{l}}} {v}");
                }
            }
        };
        counter(
            "kvferry_decisions_total",
            "Migration decisions by action.",
            &[
                ("action=\"fetch\"", self.decisions_fetch.get()),
                ("action=\"recompute\"", self.decisions_recompute.get()),
                ("action=\"split\"", self.decisions_split.get()),
                ("action=\"already_local\"", self.decisions_local.get()),
            ],
        );
        counter(
            "kvferry_fallbacks_total",
            "Migrations whose executed action differs from the decision.",
            &[("", self.fallbacks.get())],
        );
        counter(
            "kvferry_recompute_cancels_total",
            "Recomputes given up at their deadline: sent (CancelRecompute) and acknowledged by the engine.",
            &[
                ("state=\"sent\"", self.recompute_cancels.get()),
                ("state=\"acknowledged\"", self.recompute_cancels_acked.get()),
            ],
        );
        counter(
            "kvferry_migrations_failed_total",
            "Migrations that ended in an error.",
            &[("", self.migrations_failed.get())],
        );
        counter(
            "kvferry_fetched_bytes_total",
            "KV bytes fetched from peers and verified.",
            &[("", self.bytes_fetched.get())],
        );
        counter(
            "kvferry_served_requests_total",
            "Fetch requests served to peers.",
            &[("", self.served_requests.get())],
        );
        counter(
            "kvferry_served_bytes_total",
            "KV payload bytes read from this region's pools and landing zone for peers.",
            &[("", self.served_bytes.get())],
        );
        counter(
            "kvferry_fetches_joined_total",
            "Fetches that joined another migration's in-flight fetch of the same blocks instead of moving them again.",
            &[("", self.fetches_joined.get())],
        );
        counter(
            "kvferry_tenant_denied_total",
            "Requests refused before any KV byte because the peer's tenant allow-list (peers[].tenants) does not name the tenant; serve: a peer asked this region, fetch: this region would have asked the peer.",
            &[
                ("side=\"serve\"", self.tenant_denied_serve.get()),
                ("side=\"fetch\"", self.tenant_denied_fetch.get()),
            ],
        );
        counter(
            "kvferry_served_reused_total",
            "Transfers to peers ended because the engine reused a block during the read.",
            &[("", self.served_reused.get())],
        );
        counter(
            "kvferry_eviction_hint_blocks_total",
            "Blocks engines were hinted to evict (served in full to a peer, pool under pressure).",
            &[("", self.eviction_hint_blocks.get())],
        );
        counter(
            "kvferry_hedges_total",
            "Hedged migrations (fetch and recompute started together) by the leg that finished first.",
            &[
                ("winner=\"fetch\"", self.hedges_fetch_won.get()),
                ("winner=\"recompute\"", self.hedges_recompute_won.get()),
            ],
        );
        counter(
            "kvferry_hedge_wasted_milliseconds_total",
            "Milliseconds losing hedged recomputes had run when the fetch won.",
            &[("", self.hedge_wasted_ms.get())],
        );
        counter(
            "kvferry_engine_loads_total",
            "Engine Load calls (verified landed blocks written into an engine's pool) by result.",
            &[
                ("result=\"ok\"", self.engine_loads_ok.get()),
                ("result=\"failed\"", self.engine_loads_failed.get()),
            ],
        );
        counter(
            "kvferry_engine_loaded_bytes_total",
            "KV bytes successful engine Load calls wrote into engines' pools.",
            &[("", self.engine_loaded_bytes.get())],
        );
        counter(
            "kvferry_engine_load_microseconds_total",
            "Microseconds engine Load calls took in the daemon (all results).",
            &[("", self.engine_load_us.get())],
        );
        counter(
            "kvferry_lookup_tokens_total",
            "Tokens engines asked about in Lookup.",
            &[("", self.lookup_tokens.get())],
        );
        counter(
            "kvferry_lookup_hit_tokens_total",
            "Tokens Lookup found ready (prefix hit rate = hit / asked).",
            &[("", self.lookup_hit_tokens.get())],
        );
        counter(
            "kvferry_tls_reloads_total",
            "TLS file reloads (certificate rotation) by listener and result; refused: the old identity stayed.",
            &[
                ("listener=\"peer\",result=\"ok\"", self.tls_reloads_peer.get()),
                ("listener=\"peer\",result=\"refused\"", self.tls_refused_peer.get()),
                ("listener=\"router\",result=\"ok\"", self.tls_reloads_router.get()),
                ("listener=\"router\",result=\"refused\"", self.tls_refused_router.get()),
            ],
        );
        let _ = writeln!(
            o,
            "# HELP kvferry_goodput_gbps Goodput of the last fetch.\n# TYPE kvferry_goodput_gbps gauge\nkvferry_goodput_gbps {}",
            self.last_goodput_gbps.get()
        );
        let _ = writeln!(
            o,
            "# HELP kvferry_prediction_error Relative error of the last predicted vs measured migration time.\n# TYPE kvferry_prediction_error gauge\nkvferry_prediction_error {}",
            self.last_prediction_error.get()
        );
        let _ = writeln!(
            o,
            "# HELP kvferry_split_cpu_share The last split plan's CPU shares, in cores (host cores, other work, the engine's prefill, the fetch at the link's rate) and the interference floor they predict.\n# TYPE kvferry_split_cpu_share gauge"
        );
        for (part, g) in [
            ("cores", &self.split_cpu_cores),
            ("other", &self.split_cpu_other),
            ("prefill", &self.split_cpu_prefill),
            ("fetch", &self.split_cpu_fetch),
            ("floor", &self.split_cpu_floor),
        ] {
            let _ = writeln!(o, "kvferry_split_cpu_share{{part=\"{part}\"}} {}", g.get());
        }
        let _ =
            writeln!(o, "# HELP kvferry_peer_rtt_ms Live RTT per peer.\n# TYPE kvferry_peer_rtt_ms gauge");
        for (p, rtt, _, _) in links {
            let _ = writeln!(o, "kvferry_peer_rtt_ms{{peer=\"{p}\"}} {rtt}");
        }
        let _ = writeln!(
            o,
            "# HELP kvferry_peer_goodput_gbps Goodput estimate per peer.\n# TYPE kvferry_peer_goodput_gbps gauge"
        );
        for (p, _, g, _) in links {
            let _ = writeln!(o, "kvferry_peer_goodput_gbps{{peer=\"{p}\"}} {g}");
        }
        let _ = writeln!(
            o,
            "# HELP kvferry_peer_prediction_error Recent prediction error per peer.\n# TYPE kvferry_peer_prediction_error gauge"
        );
        for (p, _, _, e) in links {
            let _ = writeln!(o, "kvferry_peer_prediction_error{{peer=\"{p}\"}} {e}");
        }
        let (used, reserved, cap, spare) = landing;
        let _ = writeln!(
            o,
            "# HELP kvferry_landing_zone_bytes Landing zone occupancy (spare: idle buffers kept for the next fetches).\n# TYPE kvferry_landing_zone_bytes gauge\nkvferry_landing_zone_bytes{{state=\"used\"}} {used}\nkvferry_landing_zone_bytes{{state=\"reserved\"}} {reserved}\nkvferry_landing_zone_bytes{{state=\"capacity\"}} {cap}\nkvferry_landing_zone_bytes{{state=\"spare\"}} {spare}"
        );
        o
    }
}
