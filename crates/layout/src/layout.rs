//! `PoolLayout`: a validated description of where every block of every layer lives, and the
//! validation itself (shape, strides, alignment, bounds, plane overlap).
//!
//! A `PoolLayout` can only exist validated: construction and deserialization both go through
//! [`PoolLayout::custom`]. Engine-specific constructors live in `engines.rs`, addressing in
//! `addressing.rs`.

use serde::{Deserialize, Serialize};

use crate::{AttnSpec, LayoutError, LayoutKind, Plane};

/// Planes with interleaved spans and different strides are checked by enumerating their
/// blocks; above this many blocks per plane the layout is refused as unverifiable.
const MAX_ENUMERATED_BLOCKS: u32 = 1 << 20;

/// Where every block's bytes live in an engine's pool: per layer a list of planes (K then V,
/// or one latent), each `(region, base, stride, block_bytes)`, over `num_blocks` blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawLayout")]
pub struct PoolLayout {
    pub(crate) kind: LayoutKind,
    pub(crate) spec: AttnSpec,
    pub(crate) num_blocks: u32,
    pub(crate) region_lens: Vec<u64>,
    pub(crate) layers: Vec<Vec<Plane>>,
}

/// The unvalidated wire form of a layout.
#[derive(Deserialize)]
struct RawLayout {
    kind: LayoutKind,
    spec: AttnSpec,
    num_blocks: u32,
    region_lens: Vec<u64>,
    layers: Vec<Vec<Plane>>,
}

impl TryFrom<RawLayout> for PoolLayout {
    type Error = LayoutError;
    fn try_from(r: RawLayout) -> Result<Self, LayoutError> {
        PoolLayout::custom(r.kind, r.spec, r.num_blocks, r.region_lens, r.layers)
    }
}

impl PoolLayout {
    /// Any layout, validated: `layers[l]` are layer `l`'s planes in staging order, all with
    /// `spec.block_bytes()` bytes per block (`kv_heads = 1` for a latent plane; twice that for a
    /// [`PlaneKind::KvRecord`](crate::PlaneKind::KvRecord) plane).
    ///
    /// Refuses: zero dimensions, a plane table not `spec.layers` long, layers without planes,
    /// unknown regions, zero strides, stride < block bytes, base/stride not multiples of the
    /// element size, planes reaching past their region, and planes that share bytes.
    pub fn custom(
        kind: LayoutKind,
        spec: AttnSpec,
        num_blocks: u32,
        region_lens: Vec<u64>,
        layers: Vec<Vec<Plane>>,
    ) -> Result<Self, LayoutError> {
        for (what, v) in [
            ("layers", spec.layers),
            ("kv_heads", spec.kv_heads),
            ("head_dim", spec.head_dim),
            ("block_size", spec.block_size),
            ("num_blocks", num_blocks),
        ] {
            if v == 0 {
                return Err(LayoutError::Zero { what });
            }
        }
        let expected = spec.block_bytes().ok_or(LayoutError::Overflow { what: "block bytes" })?;
        if layers.len() != spec.layers as usize {
            return Err(LayoutError::Shape {
                detail: format!("{} layer plane lists for {} layers", layers.len(), spec.layers),
            });
        }
        let regions =
            u32::try_from(region_lens.len()).map_err(|_| LayoutError::Overflow { what: "region count" })?;
        let align = spec.dtype.size();
        for (l, planes) in layers.iter().enumerate() {
            let layer = l as u32;
            if planes.is_empty() {
                return Err(LayoutError::Shape { detail: format!("layer {layer} has no planes") });
            }
            for (p, pl) in planes.iter().enumerate() {
                let plane = p as u32;
                if pl.region >= regions {
                    return Err(LayoutError::UnknownRegion { layer, plane, region: pl.region, regions });
                }
                if pl.stride == 0 {
                    return Err(LayoutError::ZeroStride { layer, plane });
                }
                let expected = expected
                    .checked_mul(pl.kind.block_multiple())
                    .ok_or(LayoutError::Overflow { what: "block bytes" })?;
                if pl.block_bytes != expected {
                    return Err(LayoutError::BlockBytes { layer, plane, got: pl.block_bytes, expected });
                }
                if pl.stride < pl.block_bytes {
                    return Err(LayoutError::StrideTooSmall {
                        layer,
                        plane,
                        stride: pl.stride,
                        block_bytes: pl.block_bytes,
                    });
                }
                for (what, value) in [("base", pl.base), ("stride", pl.stride)] {
                    if !value.is_multiple_of(align) {
                        return Err(LayoutError::Misaligned { layer, plane, what, value, align });
                    }
                }
                let end = plane_end(pl, num_blocks).ok_or(LayoutError::Overflow { what: "plane end" })?;
                let region_len = region_lens[pl.region as usize];
                if end > region_len {
                    return Err(LayoutError::PlaneOutOfRegion {
                        layer,
                        plane,
                        region: pl.region,
                        end,
                        region_len,
                    });
                }
            }
        }
        check_overlaps(&layers, num_blocks)?;
        Ok(Self { kind, spec, num_blocks, region_lens, layers })
    }

    /// The layout kind.
    pub fn kind(&self) -> &LayoutKind {
        &self.kind
    }
    /// The attention geometry.
    pub fn spec(&self) -> &AttnSpec {
        &self.spec
    }
    /// Blocks per plane.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }
    /// Layers.
    pub fn num_layers(&self) -> u32 {
        self.spec.layers
    }
    /// Lengths of the pool's regions (bytes), index = `Extent::region`.
    pub fn region_lens(&self) -> &[u64] {
        &self.region_lens
    }
    /// Total bytes over all regions.
    pub fn total_bytes(&self) -> u64 {
        self.region_lens.iter().sum()
    }
    /// Layer `layer`'s planes in staging order (`None` past the last layer).
    pub fn planes(&self, layer: u32) -> Option<&[Plane]> {
        self.layers.get(layer as usize).map(Vec::as_slice)
    }
}

/// End offset of a plane's last block.
pub(crate) fn plane_end(pl: &Plane, num_blocks: u32) -> Option<u64> {
    u64::from(num_blocks - 1).checked_mul(pl.stride)?.checked_add(pl.base)?.checked_add(pl.block_bytes)
}

/// Refuse any two planes sharing a byte of a region. Exact: disjoint spans are fine; equal
/// strides are decided arithmetically; otherwise the blocks are enumerated (bounded).
fn check_overlaps(layers: &[Vec<Plane>], num_blocks: u32) -> Result<(), LayoutError> {
    let mut all: Vec<(u32, u32, &Plane)> = Vec::new();
    for (l, planes) in layers.iter().enumerate() {
        for (p, pl) in planes.iter().enumerate() {
            all.push((l as u32, p as u32, pl));
        }
    }
    // Sort by (region, base) so that, per region, only planes whose spans reach each other are
    // compared in the common case.
    all.sort_by_key(|(_, _, pl)| (pl.region, pl.base));
    for i in 0..all.len() {
        let (al, ap, a) = all[i];
        let a_end = plane_end(a, num_blocks).unwrap_or(u64::MAX);
        for &(bl, bp, b) in &all[i + 1..] {
            if b.region != a.region || b.base >= a_end {
                break;
            }
            let overlap = || LayoutError::Overlap {
                region: a.region,
                a_layer: al,
                a_plane: ap,
                b_layer: bl,
                b_plane: bp,
            };
            if a.stride == b.stride {
                if equal_stride_overlap(a, b, num_blocks) {
                    return Err(overlap());
                }
            } else if num_blocks > MAX_ENUMERATED_BLOCKS {
                return Err(LayoutError::Unverifiable { a_layer: al, a_plane: ap, b_layer: bl, b_plane: bp });
            } else if enumerated_overlap(a, b, num_blocks) {
                return Err(overlap());
            }
        }
    }
    Ok(())
}

/// Planes `a` and `b` with the same stride `s`: block `i` of `a` and `j` of `b` overlap iff
/// `e - la < q*s < e + lb` with `e = b.base - a.base`, `q = i - j`, `|q| < n`.
fn equal_stride_overlap(a: &Plane, b: &Plane, n: u32) -> bool {
    let s = i128::from(a.stride);
    let e = i128::from(b.base) - i128::from(a.base);
    let (la, lb) = (i128::from(a.block_bytes), i128::from(b.block_bytes));
    // smallest q with q*s > e - la, largest q with q*s < e + lb
    let q_min = (e - la).div_euclid(s) + 1;
    let q_max = (e + lb - 1).div_euclid(s);
    let n = i128::from(n);
    q_min.max(-(n - 1)) <= q_max.min(n - 1)
}

/// Enumerate both planes' blocks (merged by start) and look for an intersection.
fn enumerated_overlap(a: &Plane, b: &Plane, n: u32) -> bool {
    let mut v: Vec<(u64, u64)> = Vec::with_capacity(2 * n as usize);
    for pl in [a, b] {
        for blk in 0..u64::from(n) {
            let start = pl.base + blk * pl.stride;
            v.push((start, start + pl.block_bytes));
        }
    }
    v.sort_unstable();
    v.windows(2).any(|w| w[1].0 < w[0].1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Dtype, PlaneKind};

    fn spec(layers: u32) -> AttnSpec {
        AttnSpec { layers, kv_heads: 2, head_dim: 8, block_size: 4, dtype: Dtype::F16 }
    }
    const BB: u64 = 4 * 2 * 8 * 2; // 128

    fn plane(region: u32, base: u64, stride: u64) -> Plane {
        Plane { kind: PlaneKind::K, region, base, stride, block_bytes: BB }
    }

    fn custom(planes: Vec<Plane>, region_len: u64, n: u32) -> Result<PoolLayout, LayoutError> {
        PoolLayout::custom(
            LayoutKind::Custom { name: "t".into() },
            spec(1),
            n,
            vec![region_len],
            vec![planes],
        )
    }

    #[test]
    fn accepts_interleaved_disjoint_planes() {
        custom(vec![plane(0, 0, 2 * BB), plane(0, BB, 2 * BB)], 20 * BB, 10).unwrap();
        custom(vec![plane(0, 0, BB), plane(0, 10 * BB, BB)], 20 * BB, 10).unwrap();
    }

    #[test]
    fn refuses_overlapping_planes() {
        let e = custom(vec![plane(0, 0, 2 * BB), plane(0, BB - 2, 2 * BB)], 20 * BB, 10).unwrap_err();
        assert!(matches!(e, LayoutError::Overlap { region: 0, .. }), "{e:?}");
        let e = custom(vec![plane(0, 0, BB), plane(0, 9 * BB, BB)], 20 * BB, 10).unwrap_err();
        assert!(matches!(e, LayoutError::Overlap { .. }), "{e:?}");
        // different strides: a: 0,256,512..  b: 3*128=384 + k*384 -> 768 collides with a's 768
        let e = custom(vec![plane(0, 0, 2 * BB), plane(0, 3 * BB, 3 * BB)], 40 * BB, 10).unwrap_err();
        assert!(matches!(e, LayoutError::Overlap { .. }), "{e:?}");
        assert!(e.to_string().contains("overlap in region 0"));
    }

    #[test]
    fn refuses_bad_strides_and_alignment() {
        assert!(matches!(custom(vec![plane(0, 0, 0)], 1 << 20, 4), Err(LayoutError::ZeroStride { .. })));
        assert!(matches!(
            custom(vec![plane(0, 0, BB - 2)], 1 << 20, 4),
            Err(LayoutError::StrideTooSmall { stride: 126, block_bytes: 128, .. })
        ));
        assert!(matches!(
            custom(vec![plane(0, 0, BB + 1)], 1 << 20, 4),
            Err(LayoutError::Misaligned { what: "stride", value: 129, align: 2, .. })
        ));
        assert!(matches!(
            custom(vec![plane(0, 3, BB)], 1 << 20, 4),
            Err(LayoutError::Misaligned { what: "base", value: 3, .. })
        ));
    }

    #[test]
    fn refuses_out_of_region_and_unknown_region_and_bad_shape() {
        assert!(matches!(
            custom(vec![plane(0, 0, BB)], 4 * BB - 1, 4),
            Err(LayoutError::PlaneOutOfRegion { end: 512, region_len: 511, .. })
        ));
        assert!(matches!(
            custom(vec![plane(1, 0, BB)], 1 << 20, 4),
            Err(LayoutError::UnknownRegion { region: 1, .. })
        ));
        assert!(matches!(custom(vec![], 1 << 20, 4), Err(LayoutError::Shape { .. })));
        assert!(matches!(
            custom(vec![plane(0, 0, BB)], 1 << 20, 0),
            Err(LayoutError::Zero { what: "num_blocks" })
        ));
        let mut p = plane(0, 0, BB);
        p.block_bytes = 64;
        assert!(matches!(
            custom(vec![p], 1 << 20, 4),
            Err(LayoutError::BlockBytes { got: 64, expected: 128, .. })
        ));
        assert!(matches!(
            custom(vec![plane(0, u64::MAX - 1, BB)], u64::MAX, 4),
            Err(LayoutError::Misaligned { .. } | LayoutError::Overflow { .. })
        ));
    }

    #[test]
    fn equal_stride_formula_matches_enumeration() {
        for s in [BB, BB + 2, 2 * BB, 3 * BB] {
            for base_b in (0..6 * BB).step_by(2) {
                for (n, la, lb) in [(1u32, BB, BB), (2, BB, 64), (3, 64, BB), (7, BB, 2), (5, 2, BB)] {
                    let a = Plane { block_bytes: la, ..plane(0, 0, s) };
                    let b = Plane { block_bytes: lb, ..plane(0, base_b, s) };
                    assert_eq!(
                        equal_stride_overlap(&a, &b, n),
                        enumerated_overlap(&a, &b, n),
                        "stride {s} base {base_b} n {n} la {la} lb {lb}"
                    );
                }
            }
        }
    }

    #[test]
    fn serde_round_trip_revalidates() {
        let l = custom(vec![plane(0, 0, 2 * BB), plane(0, BB, 2 * BB)], 20 * BB, 10).unwrap();
        let json = serde_json::to_string(&l).unwrap();
        let back: PoolLayout = serde_json::from_str(&json).unwrap();
        assert_eq!(back, l);
        let broken = json.replace(&format!("\"base\":{BB}"), "\"base\":2");
        assert_ne!(broken, json);
        let err = serde_json::from_str::<PoolLayout>(&broken).unwrap_err();
        assert!(err.to_string().contains("overlap"), "{err}");
    }
}
