//! Passes the target triple to the tests, which ask `cargo metadata` for this platform's
//! dependency graph (`--filter-platform`) so that it resolves offline.

fn main() {
    let target = std::env::var("TARGET").unwrap_or_default();
    println!("cargo:rustc-env=KVFERRY_TIDY_TARGET={target}");
}
