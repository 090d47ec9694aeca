//! `kvferry bench`: real GiB/s and real fetch-versus-recompute decisions against the model,
//! over the userspace WAN emulator (`kvferry-wanem`), with the baselines a user would
//! otherwise pick measured on the same emulated link in the same run.
//!
//! - [`report`]: the result types (JSON), their Markdown rendering and consistency checks;
//! - [`stats`]: decision quality (accuracy, regret), pure;
//! - [`plots`]: PNG plots of a report;
//! - [`baselines`]: quinn with default transport, one TCP stream with TLS, NIXL UCX over TCP.

pub mod baselines;
pub mod plots;
pub mod report;
pub mod stats;
