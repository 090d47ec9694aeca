//! Typed errors of the reference engine: configuration, pool/memory, block allocation,
//! sequence bookkeeping and block import (fingerprint refusal). Nothing here does I/O.

use thiserror::Error;

/// A [`crate::ModelConfig`] that cannot describe a model.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ConfigError {
    /// A dimension that must be positive is zero.
    #[error("config: {field} must be positive")]
    Zero {
        /// The offending field.
        field: &'static str,
    },
    /// `heads` is not a multiple of `kv_heads` (GQA needs whole groups).
    #[error("config: heads ({heads}) must be a multiple of kv_heads ({kv_heads})")]
    GqaGroups {
        /// Query heads.
        heads: usize,
        /// KV heads.
        kv_heads: usize,
    },
    /// RoPE rotates pairs of dimensions, so the head dimension must be even.
    #[error("config: head_dim ({0}) must be even for RoPE")]
    OddHeadDim(usize),
    /// `rope_theta` must be finite and greater than 1.
    #[error("config: rope_theta ({0}) must be finite and > 1")]
    RopeTheta(f64),
    /// A product of dimensions overflows `usize`.
    #[error("config: {what} overflows")]
    Overflow {
        /// What overflowed.
        what: &'static str,
    },
}

/// Errors of the KV pool over a memory region set.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PoolError {
    /// The memory has a different number of regions than the layout has layers.
    #[error("pool: memory has {got} regions, layout needs {want} (one per layer)")]
    RegionCount {
        /// Regions the layout needs.
        want: usize,
        /// Regions the memory has.
        got: usize,
    },
    /// A region is shorter than the layout's region length.
    #[error("pool: region {layer} is {got} bytes, layout needs {want}")]
    RegionTooSmall {
        /// Layer (region index).
        layer: usize,
        /// Bytes the layout needs.
        want: usize,
        /// Bytes the region has.
        got: usize,
    },
    /// A block id past the pool's block count.
    #[error("pool: block {block} out of range (pool has {num_blocks})")]
    BlockOutOfRange {
        /// The block id.
        block: u32,
        /// Blocks in the pool.
        num_blocks: u32,
    },
    /// A block payload of the wrong length.
    #[error("pool: block payload is {got} bytes, expected {want}")]
    PayloadLen {
        /// Expected bytes (all layers, K and V).
        want: usize,
        /// Bytes given.
        got: usize,
    },
    /// The layout has zero blocks or a size that overflows.
    #[error("pool: invalid layout ({0})")]
    Layout(&'static str),
}

/// The block allocator has no free block left.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("allocator: out of blocks (wanted {wanted}, {free} free)")]
pub struct OutOfBlocks {
    /// Blocks requested.
    pub wanted: usize,
    /// Blocks free.
    pub free: usize,
}

/// A block offer that the engine refuses: it was produced by another model or another layout,
/// so its bytes would silently corrupt attention. The caller recomputes instead.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FingerprintMismatch {
    /// The model fingerprints (config incl. seed) differ.
    #[error("refused blocks: model fingerprint {theirs} does not match ours {ours}")]
    Model {
        /// Our model fingerprint (hex).
        ours: String,
        /// The offered fingerprint (hex).
        theirs: String,
    },
    /// The layout fingerprints (kind, dtype, layers, kv heads, head dim, block size) differ.
    #[error("refused blocks: layout fingerprint {theirs} does not match ours {ours}")]
    Layout {
        /// Our layout fingerprint (hex).
        ours: String,
        /// The offered fingerprint (hex).
        theirs: String,
    },
}

/// Errors of engine operations (prefill, decode, block import).
#[derive(Debug, Clone, PartialEq, Error)]
pub enum EngineError {
    /// Invalid model configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Pool / memory error.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// No free blocks.
    #[error(transparent)]
    OutOfBlocks(#[from] OutOfBlocks),
    /// Offered blocks were refused.
    #[error(transparent)]
    Refused(#[from] FingerprintMismatch),
    /// A token id outside the vocabulary.
    #[error("token {token} at position {position} is outside the vocabulary ({vocab})")]
    TokenOutOfRange {
        /// The token id.
        token: u32,
        /// Its position in the sequence.
        position: usize,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A prefill/load range that does not fit the sequence's state.
    #[error("sequence: {0}")]
    Range(String),
    /// An empty prompt.
    #[error("sequence: empty prompt")]
    EmptyPrompt,
}
