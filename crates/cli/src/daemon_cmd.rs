//! `kvferry daemon`: load the config (file, then `KVFERRY_*` environment, then flags),
//! validate it before binding anything, run until SIGINT/SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Args;
use kvferry_daemon::{Config, Daemon};

/// Flags of `kvferry daemon`.
#[derive(Debug, Args)]
pub struct DaemonArgs {
    /// TOML configuration file (see deploy/kvferry.toml).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override `region`.
    #[arg(long)]
    region: Option<String>,
    /// Override `run_dir`.
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// Override `listen.grpc`.
    #[arg(long)]
    grpc: Option<SocketAddr>,
    /// Override `listen.peer`.
    #[arg(long)]
    peer: Option<SocketAddr>,
    /// Override `listen.http`.
    #[arg(long)]
    http: Option<SocketAddr>,
}

/// Builds the validated configuration.
pub fn load(args: &DaemonArgs) -> anyhow::Result<Config> {
    let mut cfg = match &args.config {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    cfg.apply_env(|k| std::env::var(k).ok())?;
    if let Some(v) = &args.region {
        cfg.region = v.clone();
    }
    if let Some(v) = &args.run_dir {
        cfg.run_dir = v.clone();
    }
    if let Some(v) = args.grpc {
        cfg.listen.grpc = v;
    }
    if let Some(v) = args.peer {
        cfg.listen.peer = v;
    }
    if let Some(v) = args.http {
        cfg.listen.http = v;
    }
    cfg.validate()?;
    Ok(cfg)
}

/// Runs the daemon on `cfg` (from [`load`]) until a signal.
pub async fn run(cfg: Config) -> anyhow::Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    tracing::info!(
        workers = cfg.runtime_workers(cores),
        cores,
        configured = cfg.runtime.worker_threads,
        "runtime worker threads"
    );
    let daemon = Daemon::start(cfg).await?;
    println!(
        "kvferry daemon {}: grpc {} peer {} http {}",
        daemon.shared.config.region, daemon.grpc_addr, daemon.peer_addr, daemon.http_addr
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down");
    drop(daemon);
    Ok(())
}
