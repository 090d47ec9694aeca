//! kvferry's reference engine: a small decoder-only transformer in pure Rust whose KV cache
//! is paged in vLLM's FlashAttention layout and can live in any memory a pool backend
//! provides. It exists to prove kvferry's claims end to end: migrated KV blocks are
//! byte-identical to the source's, the logits after a migrated (or split) prefix are
//! bit-identical to a full local recompute, and the daemon's recompute estimate comes from a
//! measured prefill profile.
//!
//! Codemap:
//! - [`config`]: `ModelConfig`, validation, model fingerprint.
//! - [`detmath`]: seeded PRNG and platform-independent `exp`/`ln`/`sin`/`cos`.
//! - [`weights`]: weights generated from the seed.
//! - [`kv`]: pool layout (vLLM FA NHD), `KvMemory`, `KvPool`, bf16 rounding.
//! - [`blocks`]: block allocator and block tables.
//! - [`hash`]: prompt block keys (local copy of the canonical hash) and published blocks.
//! - [`math`], `forward`: fixed-order kernels and the paged forward pass.
//! - [`profile`]: prefill cost model, fit, EWMA refresh.
//! - [`engine`]: the `Engine` (connector flow, decode, export/import, profiling).
//!
//! Architecture invariant: all arithmetic is single-threaded, fixed-order f32 (f64 only for
//! RoPE angles), with no platform `libm`, so the same config and tokens give the same bits on
//! every machine and for every chunking of the prompt.

pub mod blocks;
pub mod config;
pub mod detmath;
pub mod engine;
pub mod error;
mod forward;
pub mod hash;
pub mod kv;
pub mod math;
pub mod profile;
pub mod weights;

pub use blocks::{BlockAllocator, BlockTable};
pub use config::{KvDtype, ModelConfig};
pub use engine::{
    BlockOffer, Engine, EngineFingerprint, PrefixOutcome, Sequence, accept_blocks, matchable_tokens,
};
pub use error::{ConfigError, EngineError, FingerprintMismatch, OutOfBlocks, PoolError};
pub use hash::{BlockHash, PublishedBlock, block_keys};
pub use kv::{BLOCK_SIZE, KvLayout, KvMemory, KvPool, Plane, SliceMemory, VecMemory};
pub use profile::{PrefillProfile, ProfileClock, ProfileOptions, ProfilePoint};
pub use weights::Weights;
