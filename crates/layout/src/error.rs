//! Typed errors of the layout crate: invalid layouts, out-of-range addressing, and
//! fingerprint mismatches. Every message names the layer/plane/block/field it is about.

/// A layout that cannot be built, or an address that cannot be resolved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A dimension that must be positive is zero.
    #[error("invalid layout: {what} is zero")]
    Zero {
        /// Which dimension.
        what: &'static str,
    },
    /// A size computation overflows u64.
    #[error("invalid layout: {what} overflows u64")]
    Overflow {
        /// What was being computed.
        what: &'static str,
    },
    /// A layer has no planes, or the plane table does not match the layer count.
    #[error("invalid layout: {detail}")]
    Shape {
        /// What is wrong.
        detail: String,
    },
    /// A plane names a region the layout does not have.
    #[error(
        "invalid layout: layer {layer} plane {plane} names region {region}, but there are {regions} region(s)"
    )]
    UnknownRegion {
        /// Layer index.
        layer: u32,
        /// Plane index within the layer.
        plane: u32,
        /// The region it names.
        region: u32,
        /// Number of regions.
        regions: u32,
    },
    /// A plane's block stride is zero.
    #[error("invalid layout: layer {layer} plane {plane} has a zero block stride")]
    ZeroStride {
        /// Layer index.
        layer: u32,
        /// Plane index within the layer.
        plane: u32,
    },
    /// A plane's stride is smaller than its block: its own blocks would overlap.
    #[error("invalid layout: layer {layer} plane {plane} stride {stride} < block bytes {block_bytes}")]
    StrideTooSmall {
        /// Layer index.
        layer: u32,
        /// Plane index within the layer.
        plane: u32,
        /// The stride.
        stride: u64,
        /// The block bytes.
        block_bytes: u64,
    },
    /// A plane's block bytes disagree with block_size × heads × head_dim × dtype size.
    #[error("invalid layout: layer {layer} plane {plane} block bytes {got}, expected {expected}")]
    BlockBytes {
        /// Layer index.
        layer: u32,
        /// Plane index within the layer.
        plane: u32,
        /// Declared block bytes.
        got: u64,
        /// What the dimensions imply.
        expected: u64,
    },
    /// A base or stride is not a multiple of the element size.
    #[error("invalid layout: layer {layer} plane {plane} {what} {value} is not a multiple of {align}")]
    Misaligned {
        /// Layer index.
        layer: u32,
        /// Plane index within the layer.
        plane: u32,
        /// "base" or "stride".
        what: &'static str,
        /// The offending value.
        value: u64,
        /// Required alignment (element size in bytes).
        align: u64,
    },
    /// A plane's last block ends past its region.
    #[error(
        "invalid layout: layer {layer} plane {plane} ends at {end}, past region {region} of length {region_len}"
    )]
    PlaneOutOfRegion {
        /// Layer index.
        layer: u32,
        /// Plane index within the layer.
        plane: u32,
        /// The region.
        region: u32,
        /// End offset of the plane's last block.
        end: u64,
        /// Length of the region.
        region_len: u64,
    },
    /// Two planes share bytes of a region.
    #[error(
        "invalid layout: layer {a_layer} plane {a_plane} and layer {b_layer} plane {b_plane} overlap in region {region}"
    )]
    Overlap {
        /// The region.
        region: u32,
        /// First plane's layer.
        a_layer: u32,
        /// First plane's index.
        a_plane: u32,
        /// Second plane's layer.
        b_layer: u32,
        /// Second plane's index.
        b_plane: u32,
    },
    /// Two planes with different strides whose spans interleave, too large to check exactly.
    #[error(
        "invalid layout: cannot verify that layer {a_layer} plane {a_plane} and layer {b_layer} plane {b_plane} do not overlap"
    )]
    Unverifiable {
        /// First plane's layer.
        a_layer: u32,
        /// First plane's index.
        a_plane: u32,
        /// Second plane's layer.
        b_layer: u32,
        /// Second plane's index.
        b_plane: u32,
    },
    /// A block id at or past `num_blocks`.
    #[error("block id {block} out of range: the pool has {num_blocks} blocks")]
    BlockOutOfRange {
        /// The block id.
        block: u32,
        /// Blocks in the pool.
        num_blocks: u32,
    },
    /// The same block id twice in one request.
    #[error("block id {block} requested twice")]
    DuplicateBlock {
        /// The block id.
        block: u32,
    },
    /// A layer range reaching past the last layer, or reversed.
    #[error("layer range {start}..{end} out of range: the pool has {layers} layers")]
    LayerOutOfRange {
        /// Range start.
        start: u32,
        /// Range end (exclusive).
        end: u32,
        /// Layers in the pool.
        layers: u32,
    },
    /// An extent computed past its region (cannot happen for a validated layout).
    #[error("extent region {region} offset {offset} len {len} exceeds region length {region_len}")]
    ExtentOutOfRegion {
        /// The region.
        region: u32,
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Region length.
        region_len: u64,
    },
    /// The SGLang pool size is not a whole number of pages.
    #[error("invalid layout: SGLang pool size {size} tokens is not a multiple of page size {page_size}")]
    PartialPage {
        /// Pool size in tokens.
        size: u64,
        /// Page size in tokens.
        page_size: u32,
    },
}

/// Two pools whose fingerprints differ: copying blocks between them is illegal.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("layout fingerprint mismatch in {field}: ours {ours}, theirs {theirs}")]
pub struct FingerprintMismatch {
    /// The first field that differs ("model_id", "dtype", "layers", "kv_heads", "head_dim",
    /// "block_size", "kind").
    pub field: &'static str,
    /// Our value.
    pub ours: String,
    /// Their value.
    pub theirs: String,
}
