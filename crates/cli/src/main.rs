//! The `kvferry` binary: one command with subcommands.
//!
//! Owns argument parsing, logging set-up and process exit codes only; every subcommand lives
//! in its own module and calls into library crates: `plan` (the cost model), `daemon` (the
//! per-region daemon), `migrate` and `links` (a router's view of the gRPC API), `engine`
//! (the reference engine process), `demo` (two regions on loopback, end to end) and `bench`
//! (goodput and decisions over the WAN emulator).

mod daemon_cmd;
mod demo;
mod migrate_cmd;
mod plan;
mod report;
mod sweep;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// kvferry: move LLM KV-cache prefixes between regions, or decide not to.
#[derive(Debug, Parser)]
#[command(name = "kvferry", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Decide fetch vs recompute (vs split) for one migration and show the crossover analysis.
    Plan(Box<plan::PlanArgs>),
    /// Run the per-region daemon.
    Daemon(daemon_cmd::DaemonArgs),
    /// Migrate a session to the region of --daemon (calls MigrateSession; prints the receipt).
    Migrate(Box<migrate_cmd::MigrateArgs>),
    /// Show a daemon's live link figures (GetLinks).
    Links(migrate_cmd::LinksArgs),
    /// Run the reference engine next to a daemon.
    Engine(Box<kvferry_engine_node::EngineArgs>),
    /// Two regions on loopback: run a conversation in A, migrate it to B, prove the next token.
    Demo(demo::DemoArgs),
    /// Measure real goodput and real decisions against the model over an emulated WAN (root).
    Bench(Box<kvferry_bench::BenchArgs>),
    /// The NIXL helper process of one pool (spawned by the daemon with a socket as stdin; the
    /// only process that loads an engine's NIXL metadata).
    #[command(name = "nixl-helper", hide = true)]
    NixlHelper,
}

fn init_logging(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVFERRY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

/// Keeps the allocator from returning chunk-sized buffers to the kernel between chunks.
///
/// A transfer allocates a few MiB-sized buffers per chunk (the received payload, the staging
/// copy). glibc serves allocations above `M_MMAP_THRESHOLD` with a fresh `mmap` and gives them
/// back on `free`, so every chunk paid ~256 page faults and page clears per MiB (measured: about
/// 5 % of a receiving daemon's CPU during a fetch). With the threshold above the chunk size
/// (4 MiB by default; 32 MiB is glibc's largest threshold, so chunks above it keep the old
/// path) they stay in the heap, where the next chunk reuses them;
/// the trim threshold keeps a freed run of them mapped. Memory stays bounded by the staging
/// budgets, which cap how many chunks are alive at once.
fn tune_allocator() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes glibc's allocation thresholds; it is called once at the
    // start of main, before any other thread exists, with documented parameters and values.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}

/// Runs `job` to completion on a multi-thread runtime of `workers` workers (tokio's default,
/// one per core, where `None`).
fn block_on(
    workers: Option<usize>,
    job: impl std::future::Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = workers {
        builder.worker_threads(n);
    }
    builder.enable_all().build()?.block_on(job)
}

fn main() -> ExitCode {
    tune_allocator();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            // One line: clap's first line names the flag and the problem.
            let text = e.render().to_string();
            eprintln!("{}", text.lines().next().unwrap_or("error: invalid arguments"));
            return ExitCode::from(2);
        }
    };
    let (result, error_code) = match cli.command {
        Command::Plan(args) => (plan::run(&args), 2),
        Command::NixlHelper => return kvferry_pool_nixl::helper_main(),
        Command::Daemon(a) => {
            init_logging("info");
            // A daemon's config is read (and validated) first: it sizes the runtime.
            let cfg = match daemon_cmd::load(&a) {
                Ok(cfg) => cfg,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    return ExitCode::from(1);
                }
            };
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            (block_on(Some(cfg.runtime_workers(cores)), daemon_cmd::run(cfg)), 1)
        }
        other => {
            init_logging(if matches!(other, Command::Engine(_)) { "info" } else { "warn" });
            let r = block_on(None, async move {
                match other {
                    Command::Migrate(a) => migrate_cmd::run(&a).await,
                    Command::Links(a) => migrate_cmd::links(&a).await,
                    Command::Engine(a) => kvferry_engine_node::run(*a).await.map_err(anyhow::Error::from),
                    Command::Demo(a) => demo::run(&a).await,
                    Command::Bench(a) => {
                        let cmd = std::env::args().collect::<Vec<_>>().join(" ");
                        kvferry_bench::run(&a, cmd).await.map(|_| ())
                    }
                    // Handled above, before any runtime exists.
                    Command::Daemon(_) | Command::Plan(_) | Command::NixlHelper => Ok(()),
                }
            });
            (r, 1)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(error_code)
        }
    }
}
