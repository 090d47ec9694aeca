//! The results of `kvferry bench`, kept pure so they are tested exhaustively: the types
//! ([`report`]), decision quality ([`stats`]), consistency checks ([`mod@check`]), the Markdown
//! document ([`mod@markdown`]), PNG plots ([`plots`]), and a synthetic report for tests
//! ([`sample`]). Nothing here touches the network or starts a process; only [`plots`] writes
//! files.

pub mod check;
pub mod markdown;
pub mod plots;
pub mod report;
pub mod sample;
pub mod stats;
pub mod targets;

pub use check::check;
pub use markdown::markdown;
pub use plots::{PlotError, calibration_plot, decision_map, fetch_time_plot, goodput_plot, write_all};
pub use report::*;
pub use stats::{
    ALL_PROFILES, ErrorBucket, Outcome, SAMPLE_BUCKETS, Winner, error_by_samples, outcome, summaries,
    summarize,
};
pub use targets::target_notes;
