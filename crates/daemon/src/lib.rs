//! kvferry's per-region daemon.
//!
//! Codemap: [`config`] (TOML, env, validation), [`registry`] (engines, pools, block index),
//! [`landing`] (fetched blocks until engines load them), [`inflight`] (a fetch of blocks
//! already being fetched joins that fetch), [`catalog`] (what peers may fetch;
//! where fetches land), [`blockbuf`] (chunk ↔ block byte permutations), [`links`] (per-peer
//! live figures), [`plan`] (validate + decide), [`execute`] (fetch / recompute / split with
//! deadlines and fallback), [`service`] (router gRPC), [`engine_api`] (engine gRPC + fd
//! socket), [`conn`] (connection caps and timeouts on every gRPC listener), [`http`] +
//! [`metrics`] (observability), [`error`] (the one mapping to gRPC status), [`reload`] (certificate rotation: TLS files re-read on change and on SIGHUP), [`residency`]
//! (which regions hold how much of a prefix, for routers).
//!
//! [`Daemon::start`] validates the [`Config`] again (a caller may have built it by hand) before
//! it binds anything, and every listener is bound before it returns; `/readyz` reports them
//! serving, and separately whether an engine is attached and the peers are reachable
//! ([`http`]).

pub mod blockbuf;
pub mod calib;
pub mod catalog;
pub mod config;
pub mod conn;
pub mod engine_api;
pub mod error;
pub mod execute;
pub mod hostcpu;
pub mod http;
pub mod inflight;
pub mod landing;
pub mod links;
pub mod metrics;
pub mod plan;
pub mod registry;
pub mod reload;
pub mod residency;
pub mod router_tls;
pub mod service;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kvferry_peer::{DevPki, LinkTuning, PeerConfig, PeerNode, RegionId, TransportChoice, TrustPolicy};
use kvferry_proto::v1::engine_server::EngineServer;
use kvferry_proto::v1::migration_server::MigrationServer;
use tokio::sync::Semaphore;

pub use config::Config;

/// State shared by every service of one daemon.
pub struct Shared {
    pub config: Config,
    pub registry: Arc<registry::Registry>,
    pub landing: Arc<landing::LandingZone>,
    pub links: links::LinkTable,
    pub metrics: Arc<metrics::Metrics>,
    pub node: Arc<PeerNode>,
    pub migrations: Arc<Semaphore>,
    /// Fetch and recompute calibrations learnt from executed migrations.
    pub calib: calib::Calibrations,
    /// The host's CPU: other work, the fetch's CPU per byte, the engines' prefill cores
    /// ([`hostcpu`], for `[policy] split_cpu_floor`).
    pub host_cpu: Arc<hostcpu::HostCpu>,
    /// Fetches in flight, which a fetch of the same blocks joins ([`inflight`]).
    pub flights: inflight::Flights,
    /// The router API's and the Engine API's connections ([`conn`]).
    pub router_conns: Arc<conn::ConnTable>,
    pub engine_conns: Arc<conn::ConnTable>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("region", &self.config.region).finish_non_exhaustive()
    }
}

/// A running daemon: where it listens, and its state (for tests and the demo).
#[derive(Debug)]
pub struct Daemon {
    pub shared: Arc<Shared>,
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    pub peer_addr: SocketAddr,
    /// Reloads the TLS files (the watch task calls it; tests may too).
    pub reloader: Arc<reload::Reloader>,
    tasks: Vec<tokio::task::AbortHandle>,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// How long `/readyz/peers` waits for a peer that is not connected.
const READY_DIAL_TIMEOUT: Duration = Duration::from_secs(2);

struct HttpRoutes {
    shared: Arc<Shared>,
    /// The Engine API and router API server tasks, and the fd-passing socket's thread: the
    /// daemon is serving while none of them has ended.
    servers: Vec<tokio::task::AbortHandle>,
    pool_socket: std::thread::JoinHandle<()>,
}

impl HttpRoutes {
    /// Whether `region` is reachable: connected now, or (with `dial`) a handshake succeeds
    /// within [`READY_DIAL_TIMEOUT`].
    async fn reachable(shared: Arc<Shared>, region: String, dial: bool) -> bool {
        let (Some(peer), Ok(id)) = (
            shared.links.peer(&region).cloned(),
            kvferry_peer::RegionId::new(&shared.config.trust_domain, &region),
        ) else {
            return false;
        };
        if shared.node.rtt_to(&id).is_some() {
            return true;
        }
        dial && matches!(
            tokio::time::timeout(READY_DIAL_TIMEOUT, shared.node.handshake(&id, peer.addr)).await,
            Ok(Ok(_))
        )
    }
}

impl http::Routes for HttpRoutes {
    fn readiness(&self, dial_peers: bool) -> http::BoxFuture<'_, http::Readiness> {
        Box::pin(async move {
            let s = &self.shared;
            let listening = !self.pool_socket.is_finished() && self.servers.iter().all(|t| !t.is_finished());
            let engines = s.registry.all();
            let mut dials = tokio::task::JoinSet::new();
            for (i, region) in s.links.regions().into_iter().enumerate() {
                let shared = s.clone();
                dials.spawn(
                    async move { (i, region.clone(), Self::reachable(shared, region, dial_peers).await) },
                );
            }
            let mut peers: Vec<(usize, String, bool)> = dials.join_all().await;
            peers.sort_by_key(|p| p.0);
            http::Readiness {
                listening,
                engines_registered: engines.len(),
                engines_attached: engines.iter().filter(|e| e.attached()).count(),
                peers: peers.into_iter().map(|(_, r, up)| (r, up)).collect(),
            }
        })
    }

    fn metrics(&self) -> String {
        let s = &self.shared;
        let links: Vec<(String, f64, f64, f64)> = s
            .links
            .regions()
            .into_iter()
            .filter_map(|r| {
                let f = s.links.figures(&r)?;
                Some((r, f.rtt_s * 1e3, f.goodput_bps / 1e9, f.prediction_error))
            })
            .collect();
        let (serve, fetch) = s.node.staging_high_water();
        let (used, reserved, cap) = s.landing.occupancy();
        let mut out = s.metrics.render(&links, (used, reserved, cap, s.landing.spare_bytes()));
        out.push_str(&format!(
            "# HELP kvferry_staging_high_water_bytes Most staging memory in use at once, per direction.\n# TYPE kvferry_staging_high_water_bytes gauge\nkvferry_staging_high_water_bytes{{direction=\"serve\"}} {serve}\nkvferry_staging_high_water_bytes{{direction=\"fetch\"}} {fetch}\nkvferry_staging_bound_bytes {}\n",
            s.node.staging_bound()
        ));
        out.push_str("# HELP kvferry_connections_open Open connections per listener.\n# TYPE kvferry_connections_open gauge\n# HELP kvferry_connections_closed_total Connections the listener's bounds closed, by reason.\n# TYPE kvferry_connections_closed_total counter\n");
        out.push_str(&s.router_conns.render());
        out.push_str(&s.engine_conns.render());
        // The TCP peer listener's cap on connections still in their TLS handshake.
        out.push_str(&format!(
            "kvferry_connections_closed_total{{listener=\"peer-tcp\",reason=\"evicted\"}} {}\n",
            s.node.tcp_pending_evicted()
        ));
        out.push_str(&format!(
            "# HELP kvferry_shm_pool_offers_pending Shm pools handed over pool.sock, not yet claimed by RegisterPool.\n# TYPE kvferry_shm_pool_offers_pending gauge\nkvferry_shm_pool_offers_pending {}\n",
            s.registry.pending_pools()
        ));
        out.push_str(&format!(
            "# HELP kvferry_chunks_failed_verification_total Chunks fetched from peers whose checksum did not match (refetched or fatal; never landed).\n# TYPE kvferry_chunks_failed_verification_total counter\nkvferry_chunks_failed_verification_total {}\n",
            s.node.verify_failures()
        ));
        out
    }
}

fn tls_material(cfg: &Config) -> anyhow::Result<(kvferry_peer::TlsIdentity, Arc<rustls::RootCertStore>)> {
    match cfg.tls.mode {
        config::TlsMode::Dev => {
            let pki = DevPki::load_or_create(&cfg.tls.dev_dir, &cfg.trust_domain)?;
            Ok((pki.issue(&cfg.region)?, pki.roots()))
        }
        config::TlsMode::Files => {
            Ok(kvferry_peer::tls::load_identity_files(&cfg.tls.ca, &cfg.tls.cert, &cfg.tls.key)?)
        }
    }
}

/// Accepted router connections with Nagle off: gRPC writes headers, data and trailers
/// separately, and Nagle plus the client's delayed ACK would add ~40 ms to some replies.
fn nodelay(
    l: tokio::net::TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt;
    tokio_stream::wrappers::TcpListenerStream::new(l).map(|s| {
        if let Ok(s) = &s {
            let _ = s.set_nodelay(true);
        }
        s
    })
}

impl Daemon {
    /// Binds every listener and starts serving.
    pub async fn start(config: Config) -> anyhow::Result<Self> {
        config.validate()?;
        std::fs::create_dir_all(&config.run_dir)
            .with_context(|| format!("creating {}", config.run_dir.display()))?;
        // Stamped before the load: a rotation between the load and the first poll still counts.
        let watched = reload::Reloader::watch_files(&config);
        let (identity, roots) = tls_material(&config)?;
        if identity.id.region != config.region || identity.id.trust_domain != config.trust_domain {
            anyhow::bail!(
                "the certificate names {}, but this daemon is region {} in {}",
                identity.id,
                config.region,
                config.trust_domain
            );
        }
        let registry = Arc::new(registry::Registry::default());
        let landing = landing::LandingZone::new(config.limits.landing_zone_bytes);
        let metrics = Arc::new(metrics::Metrics::default());
        let catalog = Arc::new(catalog::RegionCatalog {
            registry: registry.clone(),
            landing: landing.clone(),
            metrics: metrics.clone(),
            egress: catalog::EgressCaps::new(&config.peers),
            scopes: catalog::TenantScopes::new(&config.peers),
            hint_threshold: config.policy.eviction_hints.then_some(config.policy.eviction_hint_pool_use),
            faults: catalog::InjectedFaults::new(&config.faults),
        });
        let (bw, rtt) = config
            .peers
            .iter()
            .fold((0.0f64, 0.0f64), |(b, r), p| (b.max(p.gbps * 1e9), r.max(p.rtt_ms / 1000.0)));
        let tuning = LinkTuning {
            bandwidth_bps: if bw > 0.0 { bw } else { 10e9 },
            rtt: Duration::from_secs_f64(if rtt > 0.0 { rtt } else { 0.05 }),
            streams: config.transfer.streams,
            congestion: config.transfer.congestion,
            loss_tolerance: config.transfer.loss_tolerance,
            idle_timeout: Duration::from_millis(config.transfer.idle_timeout_ms),
            ack_eliciting_threshold: config.transfer.ack_eliciting_threshold,
            recv_coalesce: Duration::from_micros(config.transfer.recv_coalesce_us),
            stripes: config.transfer.stripes,
            ..LinkTuning::default()
        };
        let node = PeerNode::start(
            PeerConfig {
                identity,
                policy: TrustPolicy {
                    roots,
                    trust_domain: config.trust_domain.clone(),
                    allowed_regions: config.peers.iter().map(|p| p.region.clone()).collect(),
                },
                listen: config.listen.peer,
                tuning,
                staging_bytes: config.limits.staging_bytes as usize,
                chunk_target_bytes: config.transfer.chunk_bytes,
                fetch: config.transfer.fetch_policy(),
                transport: TransportChoice::Quic,
                tcp_listen: None,
                auto_fallback: Duration::from_millis(config.transfer.auto_fallback_ms),
            },
            catalog,
        )
        .map_err(|e| anyhow::anyhow!("peer endpoint on {}: {e}", config.listen.peer))?;
        for p in &config.peers {
            if let Ok(id) = RegionId::new(&config.trust_domain, &p.region) {
                node.set_transport(&id, p.transport);
            }
        }
        let peer_addr = node.local_addr();
        let limits = conn::ConnLimits::of(&config);
        let shared = Arc::new(Shared {
            router_conns: conn::ConnTable::new("router", limits),
            engine_conns: conn::ConnTable::new("engine", limits),
            links: links::LinkTable::new(&config.peers),
            migrations: Arc::new(Semaphore::new(config.limits.max_concurrent_migrations as usize)),
            calib: calib::Calibrations::default(),
            host_cpu: Arc::new(hostcpu::HostCpu::new()),
            flights: inflight::Flights::default(),
            config,
            registry,
            landing,
            metrics,
            node,
        });
        let mut tasks = Vec::new();
        if shared.config.policy.split_cpu_floor {
            tasks.push(tokio::spawn(hostcpu::sampler(shared.host_cpu.clone())).abort_handle());
        }
        tasks.push(
            tokio::spawn(conn::sweeper(vec![shared.router_conns.clone(), shared.engine_conns.clone()]))
                .abort_handle(),
        );

        // Engine API on a Unix socket; the fd-passing socket beside it.
        let engine_sock = shared.config.engine_socket();
        let pool_sock = shared.config.pool_socket();
        for p in [&engine_sock, &pool_sock] {
            let _ = std::fs::remove_file(p);
        }
        let uds = tokio::net::UnixListener::bind(&engine_sock)
            .with_context(|| format!("binding {}", engine_sock.display()))?;
        let pool_listener = std::os::unix::net::UnixListener::bind(&pool_sock)
            .with_context(|| format!("binding {}", pool_sock.display()))?;
        let pool_socket = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("kvferry-pool-sock".into())
                .spawn(move || engine_api::serve_pool_socket(pool_listener, shared))?
        };
        tasks.push(tokio::spawn(engine_api::expire_pool_offers(shared.clone())).abort_handle());
        let engine_svc = EngineServer::new(engine_api::EngineService { shared: shared.clone() });
        tasks.push(
            tokio::spawn(
                tonic::transport::Server::builder()
                    .http2_keepalive_interval(Some(conn::KEEPALIVE_INTERVAL))
                    .http2_keepalive_timeout(Some(conn::KEEPALIVE_TIMEOUT))
                    .layer(conn::EdgeLayer)
                    .add_service(engine_svc)
                    .serve_with_incoming(conn::guard(
                        tokio_stream::wrappers::UnixListenerStream::new(uds),
                        shared.engine_conns.clone(),
                    )),
            )
            .abort_handle(),
        );

        // Router API on TCP (mutual TLS when configured), with reflection.
        let router_tls = router_tls::server_config(&shared.config)?.map(router_tls::RouterTlsConfig::new);
        let grpc = tokio::net::TcpListener::bind(shared.config.listen.grpc)
            .await
            .with_context(|| format!("binding {}", shared.config.listen.grpc))?;
        let grpc_addr = grpc.local_addr()?;
        let reflection = service::reflection(shared.config.auth.bearer_token.clone())?;
        let router = tonic::transport::Server::builder()
            .concurrency_limit_per_connection(256)
            .timeout(Duration::from_secs(600))
            .http2_keepalive_interval(Some(conn::KEEPALIVE_INTERVAL))
            .http2_keepalive_timeout(Some(conn::KEEPALIVE_TIMEOUT))
            .layer(conn::EdgeLayer)
            .add_service(MigrationServer::new(service::MigrationService { shared: shared.clone() }))
            .add_service(reflection);
        match &router_tls {
            Some(tls) => {
                let (incoming, acceptor) =
                    router_tls::incoming(grpc, tls.clone(), shared.router_conns.clone());
                tasks.push(acceptor);
                tasks.push(tokio::spawn(router.serve_with_incoming(incoming)).abort_handle());
            }
            None => tasks.push(
                tokio::spawn(
                    router.serve_with_incoming(conn::guard(nodelay(grpc), shared.router_conns.clone())),
                )
                .abort_handle(),
            ),
        }

        // HTTP observability.
        let http = tokio::net::TcpListener::bind(shared.config.listen.http)
            .await
            .with_context(|| format!("binding {}", shared.config.listen.http))?;
        let http_addr = http.local_addr()?;
        let routes = HttpRoutes { shared: shared.clone(), servers: tasks.clone(), pool_socket };
        let http_bounds = http::Bounds {
            max_connections: shared.config.listeners.max_connections as usize,
            timeout: Duration::from_millis(shared.config.listeners.handshake_timeout_ms),
        };
        tasks.push(tokio::spawn(http::serve(http, Arc::new(routes), http_bounds)).abort_handle());

        // Certificate rotation: TLS files re-read when they change and on SIGHUP.
        let reloader = Arc::new(reload::Reloader::new(shared.clone(), router_tls, watched));
        let poll = Duration::from_millis(shared.config.tls.reload_poll_ms);
        tasks.push(tokio::spawn(reloader.clone().watch(poll)).abort_handle());

        tracing::info!(region = %shared.config.region, grpc = %grpc_addr, router_tls = %shared.config.router_tls.mode, peer = %peer_addr, http = %http_addr,
            run_dir = %shared.config.run_dir.display(), "kvferry daemon ready");
        Ok(Self { shared, grpc_addr, http_addr, peer_addr, reloader, tasks })
    }
}
