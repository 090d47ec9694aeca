//! Property tests over random layouts (engine constructors with random geometry, and random
//! custom plane tables): extents of distinct blocks never overlap, lengths add up, coalescing
//! preserves the byte sequence, everything stays in bounds, out-of-range requests are refused,
//! and overlap validation agrees with brute-force enumeration.

use std::collections::BTreeMap;

use kvferry_layout::{
    AttnSpec, Dtype, Extent, LayoutError, LayoutKind, MlaSpec, Plane, PlaneKind, PoolLayout, StrideOrder,
};
use proptest::prelude::*;

fn dtype() -> impl Strategy<Value = Dtype> {
    prop_oneof![
        Just(Dtype::F16),
        Just(Dtype::Bf16),
        Just(Dtype::F32),
        Just(Dtype::Fp8E4m3),
        Just(Dtype::Fp8E5m2)
    ]
}

fn spec() -> impl Strategy<Value = AttnSpec> {
    let attn = |(l, h, d, b, t)| AttnSpec { layers: l, kv_heads: h, head_dim: d, block_size: b, dtype: t };
    (1u32..5, 1u32..4, 1u32..9, 1u32..5, dtype()).prop_map(attn)
}

fn order() -> impl Strategy<Value = StrideOrder> {
    prop_oneof![Just(StrideOrder::Nhd), Just(StrideOrder::Hnd)]
}

/// A random plane table: planes may overlap (validation decides).
fn raw_custom() -> impl Strategy<Value = (AttnSpec, u32, Vec<u64>, Vec<Vec<Plane>>)> {
    (spec(), 1u32..12, 1u32..4).prop_flat_map(|(spec, nb, nregions)| {
        let bb = spec.block_bytes().unwrap();
        let e = spec.dtype.size();
        let plane =
            (0..nregions, 0u64..64, 0u64..4, any::<bool>()).prop_map(move |(region, base_el, pad, wide)| {
                let stride = if wide { 2 * bb + pad * e } else { bb + pad * e };
                Plane { kind: PlaneKind::K, region, base: base_el * e * 8, stride, block_bytes: bb }
            });
        let layers = prop::collection::vec(prop::collection::vec(plane, 1..4), spec.layers as usize);
        (Just(spec), Just(nb), layers, prop::collection::vec(0u64..64, nregions as usize)).prop_map(
            move |(spec, nb, layers, tails)| {
                let mut lens: Vec<u64> = tails;
                for planes in &layers {
                    for p in planes {
                        let end = p.base + u64::from(nb - 1) * p.stride + p.block_bytes;
                        let l = &mut lens[p.region as usize];
                        *l = (*l).max(end);
                    }
                }
                (spec, nb, lens, layers)
            },
        )
    })
}

fn brute_force_overlap(nb: u32, layers: &[Vec<Plane>]) -> bool {
    let mut by_region: BTreeMap<u32, Vec<(u64, u64)>> = BTreeMap::new();
    for p in layers.iter().flatten() {
        for b in 0..u64::from(nb) {
            let s = p.base + b * p.stride;
            by_region.entry(p.region).or_default().push((s, s + p.block_bytes));
        }
    }
    by_region.values_mut().any(|v| {
        v.sort_unstable();
        v.windows(2).any(|w| w[1].0 < w[0].1)
    })
}

fn mla() -> impl Strategy<Value = MlaSpec> {
    let mla = |(l, r, p, b, t)| MlaSpec { layers: l, kv_lora_rank: r, rope_dim: p, block_size: b, dtype: t };
    (1u32..4, 1u32..16, 0u32..8, 1u32..5, dtype()).prop_map(mla)
}

fn layout() -> impl Strategy<Value = PoolLayout> {
    prop_oneof![
        (spec(), 1u32..40, order()).prop_map(|(s, n, o)| PoolLayout::vllm_flash_attn(s, n, o).unwrap()),
        (spec(), 1u32..40, order()).prop_map(|(s, n, o)| PoolLayout::flashinfer(s, n, o).unwrap()),
        (spec(), 1u64..30)
            .prop_map(|(s, pages)| PoolLayout::sglang_mha(s, pages * u64::from(s.block_size)).unwrap()),
        (mla(), 1u32..40).prop_map(|(m, n)| PoolLayout::mla(m, n).unwrap()),
        (mla(), 1u64..30).prop_map(|(m, p)| PoolLayout::sglang_mla(m, p * u64::from(m.block_size)).unwrap()),
        raw_custom().prop_filter_map("overlapping planes", |(spec, nb, lens, layers)| {
            PoolLayout::custom(LayoutKind::Custom { name: "p".into() }, spec, nb, lens, layers).ok()
        }),
    ]
}

/// A layout plus distinct block ids in random order and a layer range.
fn request() -> impl Strategy<Value = (PoolLayout, Vec<u32>, std::ops::Range<u32>)> {
    layout().prop_flat_map(|l| {
        let nb = l.num_blocks();
        let nl = l.num_layers();
        let blocks = prop::sample::subsequence((0..nb).collect::<Vec<_>>(), 0..=nb as usize).prop_shuffle();
        let layers = (0..=nl).prop_flat_map(move |a| (Just(a), a..=nl)).prop_map(|(a, b)| a..b);
        (Just(l), blocks, layers)
    })
}

fn bytes_of(extents: &[Extent]) -> Vec<(u32, u64)> {
    extents.iter().flat_map(|e| (e.offset..e.offset + e.len).map(move |o| (e.region, o))).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn validation_refuses_exactly_the_overlapping_tables((spec, nb, lens, layers) in raw_custom()) {
        let overlap = brute_force_overlap(nb, &layers);
        let res = PoolLayout::custom(LayoutKind::Custom { name: "p".into() }, spec, nb, lens, layers);
        match res {
            Ok(_) => prop_assert!(!overlap, "accepted overlapping planes"),
            Err(LayoutError::Overlap { .. }) => prop_assert!(overlap, "refused disjoint planes"),
            Err(e) => prop_assert!(false, "unexpected error {e}"),
        }
    }

    #[test]
    fn extents_are_disjoint_in_bounds_and_sized((l, blocks, layers) in request()) {
        let raw = l.extents_uncoalesced(&blocks, layers.clone()).unwrap();
        let co = l.extents(&blocks, layers.clone()).unwrap();
        // lengths add up
        let total: u64 = co.iter().map(|e| e.len).sum();
        prop_assert_eq!(total, l.staging_len(blocks.len() as u64, layers.clone()).unwrap());
        prop_assert_eq!(total, raw.iter().map(|e| e.len).sum::<u64>());
        prop_assert_eq!(total, blocks.len() as u64 * l.bytes_per_block(layers.clone()).unwrap());
        // in bounds, non-empty
        for e in &co {
            prop_assert!(e.len > 0);
            prop_assert!(e.offset + e.len <= l.region_lens()[e.region as usize], "{e:?} out of bounds");
        }
        // never overlapping (distinct blocks, planes, layers)
        let mut by_region: BTreeMap<u32, Vec<(u64, u64)>> = BTreeMap::new();
        for e in &raw {
            by_region.entry(e.region).or_default().push((e.offset, e.offset + e.len));
        }
        for v in by_region.values_mut() {
            v.sort_unstable();
            prop_assert!(v.windows(2).all(|w| w[0].1 <= w[1].0), "overlapping extents");
        }
        // coalescing preserves the byte sequence and never leaves two mergeable neighbours
        prop_assert_eq!(bytes_of(&co), bytes_of(&raw));
        prop_assert!(co.len() <= raw.len());
        prop_assert!(co.windows(2).all(|w| !(w[0].region == w[1].region && w[0].offset + w[0].len == w[1].offset)));
    }

    #[test]
    fn out_of_range_is_refused((l, mut blocks, _layers) in request(), extra in 0u32..5, at in any::<prop::sample::Index>()) {
        let nb = l.num_blocks();
        let nl = l.num_layers();
        let bad = nb + extra;
        let pos = at.index(blocks.len() + 1);
        blocks.insert(pos, bad);
        prop_assert_eq!(l.extents(&blocks, 0..nl), Err(LayoutError::BlockOutOfRange { block: bad, num_blocks: nb }));
        blocks.remove(pos);
        prop_assert_eq!(
            l.extents(&blocks, 0..nl + 1 + extra),
            Err(LayoutError::LayerOutOfRange { start: 0, end: nl + 1 + extra, layers: nl })
        );
        if let Some(&first) = blocks.first() {
            blocks.push(first);
            prop_assert_eq!(l.extents(&blocks, 0..nl), Err(LayoutError::DuplicateBlock { block: first }));
        }
    }

    #[test]
    fn fingerprint_digest_tracks_equality(a in layout(), b in layout()) {
        let (fa, fb) = (a.fingerprint("m"), b.fingerprint("m"));
        prop_assert_eq!(fa.check_compatible(&fb).is_ok(), fa == fb);
        prop_assert_eq!(fa.digest() == fb.digest(), fa == fb);
    }

    #[test]
    fn serde_round_trip(l in layout()) {
        let back: PoolLayout = serde_json::from_str(&serde_json::to_string(&l).unwrap()).unwrap();
        prop_assert_eq!(back, l);
    }

    #[test]
    fn block_hash_prefix_and_tenant(tokens in prop::collection::vec(any::<u32>(), 0..200), cut in any::<prop::sample::Index>(),
                                    bs in 1u32..20, salt_a in prop::collection::vec(any::<u8>(), 0..8), salt_b in prop::collection::vec(any::<u8>(), 0..8)) {
        let full = kvferry_layout::block_hashes(&salt_a, &tokens, bs);
        prop_assert_eq!(full.len(), tokens.len() / bs as usize);
        let c = cut.index(tokens.len() + 1);
        let pre = kvferry_layout::block_hashes(&salt_a, &tokens[..c], bs);
        prop_assert_eq!(&full[..pre.len()], &pre[..]);
        if salt_a != salt_b {
            let other = kvferry_layout::block_hashes(&salt_b, &tokens, bs);
            prop_assert!(full.iter().all(|h| !other.contains(h)));
        }
    }
}
