//! `kvferry migrate` and `kvferry links`: a router's view, over the Migration gRPC API.

use std::time::Duration;

use clap::Args;
use kvferry_proto::v1::migration_client::MigrationClient;
use kvferry_proto::v1::{GetLinksRequest, MigrateSessionRequest, Policy, PolicyMode, migration_event};
use tonic::transport::Channel;

/// Flags of `kvferry migrate`.
#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// The target region's daemon (router API), e.g. http://127.0.0.1:7070.
    #[arg(long, default_value = "http://127.0.0.1:7070")]
    pub daemon: String,
    #[arg(long)]
    pub session: String,
    #[arg(long)]
    pub tenant: String,
    #[arg(long, default_value = "")]
    pub model: String,
    /// Token ids, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub tokens: Vec<u32>,
    /// The region that holds the prefix (empty: ask every peer).
    #[arg(long, default_value = "")]
    pub source: String,
    #[arg(long, default_value_t = 0)]
    pub deadline_ms: u64,
    /// auto | fetch | recompute
    #[arg(long, default_value = "auto")]
    pub mode: String,
    #[arg(long)]
    pub allow_split: bool,
    /// Allow a hedge (fetch and recompute at once, first to finish wins) when the calibrated
    /// bands straddle the crossover (the daemon's `policy.hedge` must be `on_request`).
    #[arg(long)]
    pub allow_hedge: bool,
    #[arg(long, default_value_t = 0)]
    pub max_egress_bytes: u64,
    /// Bearer token for the router API.
    #[arg(long, env = "KVFERRY_BEARER_TOKEN", default_value = "")]
    pub bearer: String,
    #[command(flatten)]
    pub tls: RouterTlsArgs,
    /// Print the decision only (PlanMigration).
    #[arg(long)]
    pub plan_only: bool,
    #[arg(long)]
    pub json: bool,
}

/// Flags of `kvferry links`.
#[derive(Debug, Args)]
pub struct LinksArgs {
    #[arg(long, default_value = "http://127.0.0.1:7070")]
    pub daemon: String,
    #[arg(long, env = "KVFERRY_BEARER_TOKEN", default_value = "")]
    pub bearer: String,
    #[command(flatten)]
    pub tls: RouterTlsArgs,
}

/// Mutual TLS to a daemon with `[router_tls]` enabled (use an `https://` address).
#[derive(Debug, Clone, Default, Args)]
pub struct RouterTlsArgs {
    /// CA certificate(s) (PEM) the daemon's router certificate must chain to.
    #[arg(long)]
    pub tls_ca: Option<std::path::PathBuf>,
    /// This router's client certificate chain (PEM).
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// Its private key (PEM).
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,
    /// Name to verify the daemon's certificate against [default: the address's host].
    #[arg(long)]
    pub tls_domain: Option<String>,
}

fn read_pem(p: &std::path::Path, what: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(p).map_err(|e| anyhow::anyhow!("{what} {}: {e}", p.display()))
}

/// A Migration client; TLS (with a client certificate when given) for `https://` addresses.
pub async fn client(addr: &str, tls: &RouterTlsArgs) -> anyhow::Result<MigrationClient<Channel>> {
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    let mut ep =
        tonic::transport::Endpoint::from_shared(addr.to_owned())?.connect_timeout(Duration::from_secs(5));
    let https = addr.starts_with("https://");
    let any_tls = tls.tls_ca.is_some() || tls.tls_cert.is_some() || tls.tls_domain.is_some();
    if any_tls && !https {
        anyhow::bail!("--tls-* flags need an https:// daemon address, got {addr}");
    }
    if https {
        let mut c = ClientTlsConfig::new();
        match &tls.tls_ca {
            Some(p) => c = c.ca_certificate(Certificate::from_pem(read_pem(p, "--tls-ca")?)),
            None => {
                anyhow::bail!("an https:// daemon address needs --tls-ca (the CA of its router certificate)")
            }
        }
        if let (Some(cert), Some(key)) = (&tls.tls_cert, &tls.tls_key) {
            c = c.identity(Identity::from_pem(read_pem(cert, "--tls-cert")?, read_pem(key, "--tls-key")?));
        }
        if let Some(d) = &tls.tls_domain {
            c = c.domain_name(d.clone());
        }
        ep = ep.tls_config(c)?;
    }
    let ch = ep.connect().await.map_err(|e| explain(addr, tls, &e))?;
    Ok(MigrationClient::new(ch).max_decoding_message_size(64 << 20))
}

/// A connection error with its whole cause chain, and what a refused handshake usually means.
fn explain(addr: &str, tls: &RouterTlsArgs, e: &dyn std::error::Error) -> anyhow::Error {
    let mut chain = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        chain.push_str(": ");
        chain.push_str(&s.to_string());
        src = s.source();
    }
    // Under TLS 1.3 a server that refuses the client certificate does so after the client's
    // side of the handshake finished: hyper then sees the connection close, without the alert.
    let closed = ["connection closed", "reset", "canceled", "broken pipe", "connection error"]
        .iter()
        .any(|w| chain.contains(w));
    let https = addr.starts_with("https://");
    let hint = if chain.contains("CertificateRequired") || (https && closed && tls.tls_cert.is_none()) {
        "; the daemon closed the connection: it requires a router client certificate (--tls-cert, --tls-key)"
    } else if chain.contains("UnknownCA") || chain.contains("BadCertificate") || (https && closed) {
        "; the daemon closed the connection: it refused the client certificate (not signed by its router client CA?)"
    } else if chain.contains("UnknownIssuer") {
        "; the daemon's certificate does not chain to --tls-ca"
    } else if !https && closed {
        "; if the daemon has [router_tls] enabled, use https:// with --tls-ca, --tls-cert, --tls-key"
    } else {
        ""
    };
    anyhow::anyhow!("{addr}: {chain}{hint}")
}

fn with_auth<T>(msg: T, bearer: &str) -> anyhow::Result<tonic::Request<T>> {
    let mut r = tonic::Request::new(msg);
    if !bearer.is_empty() {
        r.metadata_mut().insert("authorization", format!("Bearer {bearer}").parse()?);
    }
    Ok(r)
}

/// The request a migrate invocation sends.
pub fn request(a: &MigrateArgs) -> anyhow::Result<MigrateSessionRequest> {
    let mode = match a.mode.as_str() {
        "auto" => PolicyMode::Auto,
        "fetch" => PolicyMode::Fetch,
        "recompute" => PolicyMode::Recompute,
        other => anyhow::bail!("--mode must be auto, fetch or recompute, got {other:?}"),
    };
    Ok(MigrateSessionRequest {
        session_id: a.session.clone(),
        tenant: a.tenant.clone(),
        model_id: a.model.clone(),
        token_ids: a.tokens.clone(),
        source_region: a.source.clone(),
        deadline_ms: a.deadline_ms,
        policy: Some(Policy {
            mode: mode as i32,
            allow_split: a.allow_split,
            max_egress_bytes: a.max_egress_bytes,
            allow_hedge: a.allow_hedge,
        }),
        ..Default::default()
    })
}

/// Calls MigrateSession (or PlanMigration) and prints the decision and receipt.
pub async fn run(a: &MigrateArgs) -> anyhow::Result<()> {
    let mut c = client(&a.daemon, &a.tls).await?;
    let req = request(a)?;
    if a.plan_only {
        let d = c
            .plan_migration(with_auth(req, &a.bearer)?)
            .await
            .map_err(|e| explain(&a.daemon, &a.tls, &e))?
            .into_inner();
        println!("{}", crate::report::decision(&d));
        return Ok(());
    }
    let mut stream = c
        .migrate_session(with_auth(req, &a.bearer)?)
        .await
        .map_err(|e| explain(&a.daemon, &a.tls, &e))?
        .into_inner();
    while let Some(ev) = stream.message().await? {
        match ev.event {
            Some(migration_event::Event::Decision(d)) => println!("{}", crate::report::decision(&d)),
            Some(migration_event::Event::Progress(p)) => {
                let pct =
                    if p.bytes_total > 0 { 100.0 * p.bytes_done as f64 / p.bytes_total as f64 } else { 0.0 };
                let bar = "#".repeat((pct / 5.0) as usize);
                eprint!(
                    "\r  [{bar:<20}] {pct:5.1}%  {:.1} MiB  {:.2} s",
                    p.bytes_done as f64 / 1048576.0,
                    p.elapsed_s
                );
            }
            Some(migration_event::Event::Receipt(r)) => {
                eprintln!();
                println!("{}", crate::report::receipt(&r));
            }
            None => {}
        }
    }
    Ok(())
}

/// Calls GetLinks and prints a table.
pub async fn links(a: &LinksArgs) -> anyhow::Result<()> {
    let mut c = client(&a.daemon, &a.tls).await?;
    let r = c
        .get_links(with_auth(GetLinksRequest {}, &a.bearer)?)
        .await
        .map_err(|e| explain(&a.daemon, &a.tls, &e))?
        .into_inner();
    println!("links of region {}:", r.region);
    println!(
        "  {:<14} {:>9} {:>12} {:>9} {:>6} {:>8} {:>10} {:>9} {:>10}",
        "peer", "rtt_ms", "goodput", "age_s", "conf", "samples", "pred_err", "connected", "transport"
    );
    for l in r.links {
        // The setting, and what carried the last job where it differs (auto -> tcp).
        let transport = match (l.transport_setting.as_str(), l.transport.as_str()) {
            (set, "") => set.to_owned(),
            (set, used) if set == used => set.to_owned(),
            (set, used) => format!("{set}->{used}"),
        };
        println!(
            "  {:<14} {:>9.2} {:>8.2} Gb/s {:>9} {:>6.2} {:>8} {:>10.3} {:>9} {:>10}",
            l.region,
            l.rtt_ms,
            l.goodput_gbps,
            if l.age_s < 0.0 { "never".to_owned() } else { format!("{:.1}", l.age_s) },
            l.confidence,
            l.samples,
            l.prediction_error,
            l.connected,
            transport
        );
    }
    if !r.engines.is_empty() {
        println!("engines (calibrated from executed migrations):");
        println!(
            "  {:<20} {:>13} {:>8} {:>8} {:>8} {:>8} {:>6} {:>8} {:>6} {:>12} {:>6}",
            "engine",
            "prefill ms/t",
            "samples",
            "split_i",
            "split_sd",
            "split_ms",
            "n",
            "hedge_i",
            "n",
            "load s/GiB",
            "n"
        );
        for e in r.engines {
            println!(
                "  {:<20} {:>13.4} {:>8} {:>8.3} {:>8.3} {:>8.2} {:>6} {:>8.3} {:>6} {:>12.3} {:>6}",
                e.engine_id,
                e.linear_s_per_token * 1e3,
                e.calibration_samples,
                e.split_interference,
                e.split_scatter,
                e.split_overhead_s * 1e3,
                e.split_samples,
                e.hedge_interference,
                e.hedge_samples,
                e.load_s_per_byte * (1u64 << 30) as f64,
                e.load_samples
            );
        }
    }
    Ok(())
}
