//! The results of `kvferry bench`, kept pure so they are tested exhaustively: the types
//! ([`report`]), decision quality ([`stats`]), and (as they land) Markdown and PNG renderings.

pub mod report;
pub mod stats;

pub use report::*;
