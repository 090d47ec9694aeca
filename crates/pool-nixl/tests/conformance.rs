//! The shared conformance suite, run against NixlBackend with the engine in a separate process
//! (`kvferry-nixl-engine`, Rust/nixl-sys) and every byte moved by real NIXL transfers.

mod common;

use common::{EngineKind, NixlFixture, nixl_available, serial};
use kvferry_pool::conformance as c;

fn fx() -> NixlFixture {
    NixlFixture { kind: EngineKind::Rust, large_pool_bytes: 256 << 20 }
}

macro_rules! case {
    ($name:ident, $body:expr) => {
        #[test]
        fn $name() {
            let _g = serial();
            if !nixl_available() {
                return;
            }
            let f = fx();
            ($body)(&f);
        }
    };
}

case!(staging_alloc, |f: &NixlFixture| c::staging_alloc(f));
case!(empty_sets, |f: &NixlFixture| c::empty_sets(f));
case!(read_after_write, |f: &NixlFixture| c::seeds().into_iter().for_each(|s| c::read_after_write(f, s)));
case!(out_of_bounds_writes_nothing, |f: &NixlFixture| {
    c::seeds().into_iter().for_each(|s| c::out_of_bounds_writes_nothing(f, s))
});
case!(concurrent_disjoint, |f: &NixlFixture| c::seeds()
    .into_iter()
    .for_each(|s| c::concurrent_disjoint(f, s)));
case!(staging_too_small, |f: &NixlFixture| c::staging_too_small(f));
case!(foreign_staging, |f: &NixlFixture| c::foreign_staging(f));
case!(large_pool, |f: &NixlFixture| c::large_pool(f));
