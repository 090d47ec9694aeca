//! `kvferry bench`: real GiB/s and real fetch-versus-recompute decisions against the model,
//! over the userspace WAN emulator (`kvferry-wanem`), with the baselines a user would
//! otherwise pick measured on the same emulated link in the same run.
//!
//! - [`regions`]: two regions (daemon + reference engine each, separate processes) inside the
//!   emulator's namespaces;
//! - [`session`]: seed, migrate and verify one session through the router API;
//! - [`run`](mod@run): the sweep (profiles × sizes, baselines, decision quality) and its outputs;
//! - [`vllm`]: `--engine vllm`, real vLLM servers as the engines and their decision sweep.
//!
//! The results' types, statistics, Markdown and plots live in `kvferry-bench-report` (pure);
//! the baselines in `kvferry-baselines`.

pub mod ceilings;
pub mod regions;
pub mod run;
pub mod session;
pub mod vllm;

pub use run::{BenchArgs, run};
