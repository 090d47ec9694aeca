//! Nothing to link: this crate holds the workspace's tidy tests (`tests/tidy.rs`), in the manner
//! of rust-analyzer's `tidy`. They read `cargo metadata` and the source tree and fail when a
//! crate depends on what ARCHITECTURE.md's Boundaries forbid, when a Rust source file does not
//! open with a `//!` module doc, or when a dependency shared by several crates states its
//! version outside `[workspace.dependencies]`. Run: `cargo test -p kvferry-tidy`.
