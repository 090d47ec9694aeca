//! `wanem`: run commands across an emulated WAN path for a bounded time.
//!
//! ```text
//! cargo run -p kvferry-wanem --example wanem -- --profile 1gbit-50ms --duration 30 \
//!     --in-b 'my-server --listen 198.18.0.2:4433' -- my-client 198.18.0.2:4433
//! ```
//!
//! The command after `--` runs in namespace A (198.18.0.1); `--in-b` runs in namespace B
//! (198.18.0.2), started first and stopped at the end. Both see `WANEM_ADDR_A`,
//! `WANEM_ADDR_B`, `WANEM_ADDR_PEER`, `WANEM_NS_A` and `WANEM_NS_B`. Without a command the
//! path stays up for `--duration` (use `ip netns exec <ns> …` by hand). Ctrl-C, SIGTERM and
//! the time limit all tear the namespaces down.

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use kvferry_wanem::cli::{RunOptions, run};
use kvferry_wanem::{PRESETS, PathProfile};

#[derive(Debug, Parser)]
#[command(about = "Userspace WAN emulator between two network namespaces")]
struct Args {
    /// Preset or spec for both directions, e.g. `1gbit-50ms` or `rate=100mbit,rtt=20ms,loss=1%`
    /// (times in preset names are round-trip times).
    #[arg(long, default_value = "1gbit-50ms")]
    profile: String,
    /// Override for the B→A direction only (same syntax).
    #[arg(long)]
    profile_ba: Option<String>,
    /// Hard time limit in seconds.
    #[arg(long, default_value_t = 30.0)]
    duration: f64,
    /// Shell command (`sh -c`) to run in namespace B, e.g. a server.
    #[arg(long)]
    in_b: Option<String>,
    /// Print counters every this many seconds (0 = only at the end).
    #[arg(long, default_value_t = 0.0)]
    stats_every: f64,
    /// Seed for loss, jitter and reordering.
    #[arg(long)]
    seed: Option<u64>,
    /// TUN MTU.
    #[arg(long, default_value_t = 1500)]
    mtu: u32,
    /// List presets and exit.
    #[arg(long)]
    list: bool,
    /// Command to run in namespace A.
    #[arg(last = true)]
    command: Vec<OsString>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.list {
        for p in PRESETS {
            let path = PathProfile::preset(p).expect("listed preset");
            println!("{p:20} {}", path.ab);
        }
        return ExitCode::SUCCESS;
    }
    match go(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("wanem: {e}");
            ExitCode::from(2)
        }
    }
}

fn go(args: &Args) -> Result<ExitCode, kvferry_wanem::WanemError> {
    let mut path = PathProfile::parse(&args.profile)?;
    if let Some(ba) = &args.profile_ba {
        path.ba = PathProfile::parse(ba)?.ba;
    }
    let mut opts = RunOptions::new(path, Duration::from_secs_f64(args.duration.max(0.0)));
    opts.config.seed = args.seed;
    opts.config.mtu = args.mtu;
    opts.stats_every = (args.stats_every > 0.0).then(|| Duration::from_secs_f64(args.stats_every));
    opts.command_b = args.in_b.as_ref().map(|c| vec!["sh".into(), "-c".into(), c.into()]);
    opts.command_a = (!args.command.is_empty()).then(|| args.command.clone());
    let out = run(&opts)?;
    if out.interrupted {
        return Ok(ExitCode::from(130));
    }
    Ok(match out.status_a {
        Some(st) if st.success() => ExitCode::SUCCESS,
        Some(st) => ExitCode::from(st.code().unwrap_or(1).clamp(1, 255) as u8),
        None if out.timed_out && opts.command_a.is_some() => ExitCode::from(124),
        None => ExitCode::SUCCESS,
    })
}
