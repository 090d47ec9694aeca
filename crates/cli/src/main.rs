//! The `kvferry` binary: one command with subcommands.
//!
//! Owns argument parsing and process exit codes only; every subcommand lives in its own module
//! and calls into library crates. Today: `plan` (the cost model). The daemon, migrate, links,
//! engine, demo and bench subcommands arrive with their issues.

mod plan;
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
}

fn main() -> ExitCode {
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
    let result = match cli.command {
        Command::Plan(args) => plan::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
