//! kvferry's WAN emulator: a userspace, packet-level link between two network namespaces.
//!
//! Linux here has no `netem`, so the emulator shapes packets itself: each side of the path
//! is a network namespace holding a TUN device, and one thread per direction moves IP
//! packets between the two devices, applying that direction's [`LinkProfile`] (loss, a
//! rate-limited bottleneck with a tail-drop queue sized in bandwidth-delay products, one-way
//! delay, jitter and reordering). Because it works on IP packets it shapes QUIC and TCP alike.
//!
//! ```no_run
//! use kvferry_wanem::{Emulator, PathProfile, Side};
//! let emu = Emulator::start_path(PathProfile::preset("1gbit-50ms").unwrap())?;
//! let server = emu.run_in(Side::B, || std::net::UdpSocket::bind((emu.addr_b(), 4433)))??;
//! let client = emu.run_in(Side::A, || std::net::UdpSocket::bind((emu.addr_a(), 0)))??;
//! # let _ = (server, client);
//! println!("{:?}", emu.stats());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Needs root (namespaces, TUN). Everything it creates is removed when the [`Emulator`] is
//! dropped; [`cli::run`] also cleans up on SIGINT/SIGTERM, and [`netns::cleanup_stale`]
//! removes namespaces left by a process that was SIGKILLed.

pub mod cli;
pub mod emulator;
pub mod error;
pub mod forwarder;
pub mod gso;
pub mod netns;
pub mod probe;
pub mod profile;
pub mod relay;
pub mod rng;
pub mod shaper;
pub mod sys;

pub use emulator::{
    ADDR_A, ADDR_B, DEVICE, Emulator, EmulatorConfig, KernelCounters, Side, Stats, check_support,
};
pub use error::{Result, WanemError};
pub use forwarder::DirectionStats;
pub use profile::{LinkProfile, PRESETS, PathProfile};
