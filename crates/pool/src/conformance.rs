//! The conformance suite every `MemoryBackend` must pass (feature `conformance`).
//!
//! A backend's tests implement [`Fixture`] (create a pool of given region sizes, returning the
//! backend view plus an independent [`EngineSide`] that reads/writes the engine's memory
//! without going through the backend) and call each case function from a `#[test]`, or
//! [`run_all`]. Every check is made against the engine's memory itself, not only through the
//! backend. Cases are seeded (a small SplitMix64, no external RNG); the seed is printed with
//! every result and in every failure message. Set `KVFERRY_CONFORMANCE_SEED` to add a seed.
//!
//! Each case builds its own tokio runtime, so call the cases from plain `#[test]` functions, not
//! from inside a runtime. Failures panic with `conformance[<backend>] <case> seed=<seed>: ...`.
//! This module owns no backend code and must not know about any particular backend.

use std::sync::Arc;

use crate::{Extent, MemoryBackend, PoolError, Staging, next_backend_id};

/// Errors a fixture reports (setup failures are not conformance failures of the backend).
pub type FixtureError = Box<dyn std::error::Error + Send + Sync>;

/// Independent access to the engine's raw region bytes (the "engine side"): for shm the
/// engine process's own mapping, for CUDA `cudaMemcpy`, and so on.
pub trait EngineSide: Send + Sync {
    /// Copy `out.len()` bytes from `region` at `offset` into `out`.
    fn read(&self, region: u32, offset: u64, out: &mut [u8]) -> Result<(), FixtureError>;
    /// Copy `data` into `region` at `offset`.
    fn write(&self, region: u32, offset: u64, data: &[u8]) -> Result<(), FixtureError>;
}

/// What [`Fixture::create`] returns: the backend view and the engine side of one pool.
pub type Created = (Box<dyn MemoryBackend>, Box<dyn EngineSide>);

/// Creates pools for the suite.
pub trait Fixture: Send + Sync {
    /// A fresh pool with one region per entry of `region_lens` (bytes), with a backend view and
    /// an engine-side handle onto the same memory.
    fn create(&self, region_lens: &[u64]) -> Result<Created, FixtureError>;
    /// Total bytes of the "large pool" case (default 256 MiB), split over two regions.
    fn large_pool_bytes(&self) -> u64 {
        256 << 20
    }
}

/// A tiny deterministic RNG (SplitMix64): good enough for test data, and reproducible from the
/// printed seed on every platform.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
    /// Fill `buf` with random bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        let mut chunks = buf.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next_u64().to_le_bytes();
        rest.copy_from_slice(&last[..rest.len()]);
    }
    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0; n];
        self.fill(&mut v);
        v
    }
    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.range(0, i as u64) as usize;
            v.swap(i, j);
        }
    }
}

/// The default seeds, plus `KVFERRY_CONFORMANCE_SEED` (decimal or 0x-hex) when set.
pub fn seeds() -> Vec<u64> {
    let mut s = vec![0x5EED_0001, 0x5EED_0002, 0x5EED_0003, 0xC0FF_EE00];
    if let Ok(v) = std::env::var("KVFERRY_CONFORMANCE_SEED") {
        let v = v.trim();
        let parsed = match v.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16),
            None => v.parse(),
        };
        s.push(parsed.unwrap_or_else(|e| panic!("KVFERRY_CONFORMANCE_SEED={v:?} is not a u64: {e}")));
    }
    s
}

/// What a case is, for messages.
struct Ctx {
    backend: &'static str,
    case: &'static str,
    seed: u64,
}

impl Ctx {
    fn fail(&self, msg: impl std::fmt::Display) -> ! {
        panic!("conformance[{}] {} seed={:#x}: {msg}", self.backend, self.case, self.seed)
    }
    fn ok(&self, what: impl std::fmt::Display) {
        eprintln!("conformance[{}] {} seed={:#x}: ok ({what})", self.backend, self.case, self.seed);
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("conformance: cannot build a tokio runtime")
}

/// A pool under test: backend, engine side, and a shadow copy of what the engine's memory must
/// hold. Only the shadow's touched windows are compared for large pools.
struct Pool {
    backend: Arc<dyn MemoryBackend>,
    engine: Arc<dyn EngineSide>,
    shadow: Vec<Vec<u8>>,
}

fn create(
    fx: &dyn Fixture,
    rt: &tokio::runtime::Runtime,
    lens: &[u64],
    case: &'static str,
    seed: u64,
) -> (Pool, Ctx) {
    let _enter = rt.enter();
    let (b, e) = fx.create(lens).unwrap_or_else(|err| {
        panic!("conformance[?] {case} seed={seed:#x}: fixture could not create a pool {lens:?}: {err}")
    });
    let ctx = Ctx { backend: b.name(), case, seed };
    let got: Vec<u64> = b.regions().iter().map(|r| r.len).collect();
    if got != lens {
        ctx.fail(format!("regions() = {got:?}, created with {lens:?}"));
    }
    (Pool { backend: Arc::from(b), engine: Arc::from(e), shadow: Vec::new() }, ctx)
}

impl Pool {
    /// Fill every region with random bytes through the engine side and remember them.
    fn prefill(&mut self, ctx: &Ctx, rng: &mut Rng) {
        self.shadow = self
            .backend
            .regions()
            .iter()
            .enumerate()
            .map(|(r, info)| {
                let bytes = rng.bytes(info.len as usize);
                self.engine
                    .write(r as u32, 0, &bytes)
                    .unwrap_or_else(|e| ctx.fail(format!("engine write: {e}")));
                bytes
            })
            .collect();
    }

    /// Compare every region's bytes (read via the engine side) with the shadow.
    fn verify_all(&self, ctx: &Ctx, when: &str) {
        for (r, want) in self.shadow.iter().enumerate() {
            let mut got = vec![0; want.len()];
            self.engine.read(r as u32, 0, &mut got).unwrap_or_else(|e| ctx.fail(format!("engine read: {e}")));
            if let Some(i) = first_diff(&got, want) {
                ctx.fail(format!(
                    "{when}: engine memory region {r} differs at offset {i}: got {:#04x}, want {:#04x}",
                    got[i], want[i]
                ));
            }
        }
    }

    fn staging(&self, ctx: &Ctx, len: usize) -> Staging {
        let s = self.backend.staging(len).unwrap_or_else(|e| ctx.fail(format!("staging({len}) failed: {e}")));
        if s.len() != len || s.owner() != self.backend.id() {
            ctx.fail(format!(
                "staging({len}) returned len {} owner {} (backend id {})",
                s.len(),
                s.owner(),
                self.backend.id()
            ));
        }
        if len > 0 && !(s.as_ptr() as usize).is_multiple_of(crate::STAGING_ALIGN) {
            ctx.fail(format!("staging({len}) not page aligned: {:p}", s.as_ptr()));
        }
        s
    }
}

fn first_diff(a: &[u8], b: &[u8]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// The expected staging bytes of a gather of `extents` from `shadow`.
fn gather(shadow: &[Vec<u8>], extents: &[Extent]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in extents {
        out.extend_from_slice(&shadow[e.region as usize][e.offset as usize..(e.offset + e.len) as usize]);
    }
    out
}

/// Apply a scatter of `data` into `extents` to `shadow`.
fn scatter(shadow: &mut [Vec<u8>], extents: &[Extent], data: &[u8]) {
    let mut at = 0;
    for e in extents {
        let n = e.len as usize;
        shadow[e.region as usize][e.offset as usize..e.offset as usize + n]
            .copy_from_slice(&data[at..at + n]);
        at += n;
    }
}

/// A random engine-like layout: per region one or two planes (K/V-like) of `num_blocks`
/// blocks at `base + b * stride`, `block_bytes` each, with padding and odd sizes.
#[derive(Debug, Clone)]
pub struct RandomLayout {
    /// Region lengths in bytes.
    pub region_lens: Vec<u64>,
    /// Planes: (region, base, stride, block_bytes).
    pub planes: Vec<(u32, u64, u64, u64)>,
    /// Blocks per plane.
    pub num_blocks: u32,
}

impl RandomLayout {
    /// Generate one from `rng`.
    pub fn generate(rng: &mut Rng) -> Self {
        let num_blocks = rng.range(1, 48) as u32;
        let mut region_lens = Vec::new();
        let mut planes = Vec::new();
        for r in 0..rng.range(1, 4) as u32 {
            let block_bytes = if rng.range(0, 1) == 0 { rng.range(1, 4096) } else { 16 * rng.range(1, 512) };
            let stride = block_bytes + if rng.range(0, 2) == 0 { 0 } else { rng.range(1, 300) };
            let mut at = rng.range(0, 600);
            for _ in 0..rng.range(1, 2) {
                planes.push((r, at, stride, block_bytes));
                at += u64::from(num_blocks) * stride + rng.range(0, 64);
            }
            region_lens.push(at + rng.range(0, 300));
        }
        Self { region_lens, planes, num_blocks }
    }

    /// Extents of `blocks` in staging order (plane-major, blocks in the given order).
    pub fn extents(&self, blocks: &[u32]) -> Vec<Extent> {
        let mut v = Vec::new();
        for &(region, base, stride, len) in &self.planes {
            for &b in blocks {
                v.push(Extent { region, offset: base + u64::from(b) * stride, len });
            }
        }
        v
    }

    /// A random subset of the blocks in random order (possibly empty).
    pub fn random_blocks(&self, rng: &mut Rng) -> Vec<u32> {
        let mut all: Vec<u32> = (0..self.num_blocks).collect();
        rng.shuffle(&mut all);
        all.truncate(rng.range(0, u64::from(self.num_blocks)) as usize);
        all
    }
}

/// Run every case with every seed; prints one line per case.
pub fn run_all(fx: &dyn Fixture) {
    staging_alloc(fx);
    empty_sets(fx);
    for seed in seeds() {
        read_after_write(fx, seed);
        engine_layouts(fx, seed);
        out_of_bounds_writes_nothing(fx, seed);
        concurrent_disjoint(fx, seed);
        host_writes(fx, seed);
    }
    staging_too_small(fx);
    foreign_staging(fx);
    large_pool(fx);
}

/// `staging(len)` returns a buffer of exactly `len` bytes, owned by the backend, page aligned.
pub fn staging_alloc(fx: &dyn Fixture) {
    let rt = runtime();
    let (mut pool, ctx) = create(fx, &rt, &[4096], "staging_alloc", 0);
    for len in [0usize, 1, 4095, 4096, 4097, (1 << 20) + 3] {
        let mut s = pool.staging(&ctx, len);
        s.as_mut_slice().fill(0x5A);
        if s.as_slice().iter().any(|&b| b != 0x5A) {
            ctx.fail(format!("staging({len}) does not keep its bytes"));
        }
    }
    // A buffer to fill: the same length, owner and alignment; whatever it held, a gather
    // of a whole region overwrites it.
    pool.prefill(&ctx, &mut Rng::new(0x5F));
    for _ in 0..2 {
        let mut s = pool
            .backend
            .staging_to_fill(4096)
            .unwrap_or_else(|e| ctx.fail(format!("staging_to_fill(4096) failed: {e}")));
        if s.len() != 4096
            || s.owner() != pool.backend.id()
            || !(s.as_ptr() as usize).is_multiple_of(crate::STAGING_ALIGN)
        {
            ctx.fail(format!(
                "staging_to_fill(4096) returned len {} owner {} at {:p}",
                s.len(),
                s.owner(),
                s.as_ptr()
            ));
        }
        let whole = [crate::Extent { region: 0, offset: 0, len: 4096 }];
        rt.block_on(pool.backend.read(&whole, &mut s))
            .unwrap_or_else(|e| ctx.fail(format!("gather into a buffer to fill: {e}")));
        if s.as_slice() != &pool.shadow[0][..] {
            ctx.fail("a gather did not overwrite a buffer to fill".to_string());
        }
        s.as_mut_slice().fill(0xEE);
    }
    ctx.ok("lens 0..1MiB+3; a buffer to fill overwritten by a gather");
}

/// An empty extent list is a successful no-op for read and write, with any staging length.
pub fn empty_sets(fx: &dyn Fixture) {
    let rt = runtime();
    let mut rng = Rng::new(0xE);
    let (mut pool, ctx) = create(fx, &rt, &[8192, 3000], "empty_sets", 0xE);
    pool.prefill(&ctx, &mut rng);
    for len in [0usize, 64] {
        let mut st = pool.staging(&ctx, len);
        rng.fill(st.as_mut_slice());
        let before = st.as_slice().to_vec();
        rt.block_on(pool.backend.write(&[], &st)).unwrap_or_else(|e| ctx.fail(format!("empty write: {e}")));
        rt.block_on(pool.backend.read(&[], &mut st)).unwrap_or_else(|e| ctx.fail(format!("empty read: {e}")));
        if st.as_slice() != before {
            ctx.fail(format!("empty read changed staging (len {len})"));
        }
    }
    pool.verify_all(&ctx, "after empty batches");
    ctx.ok("read+write, staging 0 and 64");
}

/// Random layouts and block sets: scatter via the backend then check engine memory (including
/// bytes outside the extents, untouched); gather via the backend after engine-side writes.
pub fn read_after_write(fx: &dyn Fixture, seed: u64) {
    let rt = runtime();
    let mut rng = Rng::new(seed);
    let mut runs = 0;
    let mut backend = "-";
    for round in 0..6 {
        let layout = RandomLayout::generate(&mut rng);
        let (mut pool, ctx) = create(fx, &rt, &layout.region_lens, "read_after_write", seed);
        backend = ctx.backend;
        pool.prefill(&ctx, &mut rng);
        for _ in 0..3 {
            let blocks = layout.random_blocks(&mut rng);
            let extents = layout.extents(&blocks);
            let total: u64 = extents.iter().map(|e| e.len).sum();
            let slack = rng.range(0, 40) as usize;
            // write
            let mut st = pool.staging(&ctx, total as usize + slack);
            rng.fill(st.as_mut_slice());
            rt.block_on(pool.backend.write(&extents, &st)).unwrap_or_else(|e| {
                ctx.fail(format!("round {round}: write of {} extents ({total} B) failed: {e}", extents.len()))
            });
            scatter(&mut pool.shadow, &extents, &st.as_slice()[..total as usize]);
            pool.verify_all(&ctx, &format!("round {round} after write of blocks {blocks:?}"));
            // engine changes the blocks, backend must see it
            for e in &extents {
                let fresh = rng.bytes(e.len as usize);
                pool.engine.write(e.region, e.offset, &fresh).unwrap_or_else(|err| ctx.fail(err));
                pool.shadow[e.region as usize][e.offset as usize..(e.offset + e.len) as usize]
                    .copy_from_slice(&fresh);
            }
            let mut rd = pool.staging(&ctx, total as usize + slack);
            rng.fill(rd.as_mut_slice());
            let tail = rd.as_slice()[total as usize..].to_vec();
            rt.block_on(pool.backend.read(&extents, &mut rd))
                .unwrap_or_else(|e| ctx.fail(format!("round {round}: read failed: {e}")));
            let want = gather(&pool.shadow, &extents);
            if let Some(i) = first_diff(&rd.as_slice()[..total as usize], &want) {
                ctx.fail(format!(
                    "round {round}: read staging differs from engine memory at staging byte {i}"
                ));
            }
            if rd.as_slice()[total as usize..] != tail[..] {
                ctx.fail(format!("round {round}: read wrote past sum(len) = {total} into staging"));
            }
            runs += 1;
        }
    }
    Ctx { backend, case: "read_after_write", seed }.ok(format!("{runs} batches over 6 random layouts"));
}

/// Real engine layouts from `kvferry-layout` (vLLM FlashAttention NHD/HND, FlashInfer, SGLang
/// MHA, MLA) with random small geometry: a random block set over a random layer range is
/// scattered and gathered through `PoolLayout::extents` (coalesced), checked against the
/// engine's memory, and a refused request (block id past the pool) never reaches the backend.
pub fn engine_layouts(fx: &dyn Fixture, seed: u64) {
    use kvferry_layout::{AttnSpec, Dtype, MlaSpec, PoolLayout, StrideOrder};
    let rt = runtime();
    let mut rng = Rng::new(seed ^ 0x1A70);
    let dtypes = [Dtype::F16, Dtype::Bf16, Dtype::F32, Dtype::Fp8E4m3];
    let mut backend = "-";
    for variant in 0..5 {
        let spec = AttnSpec {
            layers: rng.range(1, 4) as u32,
            kv_heads: rng.range(1, 4) as u32,
            head_dim: 8 * rng.range(1, 8) as u32,
            block_size: 16,
            dtype: dtypes[rng.range(0, 3) as usize],
        };
        let nb = rng.range(2, 24) as u32;
        let order = if rng.range(0, 1) == 0 { StrideOrder::Nhd } else { StrideOrder::Hnd };
        let mla =
            MlaSpec { layers: spec.layers, kv_lora_rank: 32, rope_dim: 8, block_size: 16, dtype: spec.dtype };
        let layout = match variant {
            0 => PoolLayout::vllm_flash_attn(spec, nb, order),
            1 => PoolLayout::flashinfer(spec, nb, order),
            2 => PoolLayout::sglang_mha(spec, 16 * u64::from(nb)),
            3 => PoolLayout::mla(mla, nb),
            _ => PoolLayout::sglang_mla(mla, 16 * u64::from(nb)),
        }
        .unwrap_or_else(|e| panic!("conformance engine_layouts seed={seed:#x}: layout: {e}"));
        let (mut pool, ctx) = create(fx, &rt, layout.region_lens(), "engine_layouts", seed);
        backend = ctx.backend;
        pool.prefill(&ctx, &mut rng);
        let mut blocks: Vec<u32> = (0..layout.num_blocks()).collect();
        rng.shuffle(&mut blocks);
        blocks.truncate(rng.range(1, u64::from(layout.num_blocks())) as usize);
        if rng.range(0, 1) == 0 {
            blocks.sort_unstable(); // sorted runs coalesce
        }
        let lo = rng.range(0, u64::from(layout.num_layers()) - 1) as u32;
        let hi = rng.range(u64::from(lo) + 1, u64::from(layout.num_layers())) as u32;
        let extents = layout.extents(&blocks, lo..hi).unwrap_or_else(|e| ctx.fail(e));
        let total = layout.staging_len(blocks.len() as u64, lo..hi).unwrap_or_else(|e| ctx.fail(e));
        let mut st = pool.staging(&ctx, total as usize);
        rng.fill(st.as_mut_slice());
        rt.block_on(pool.backend.write(&extents, &st))
            .unwrap_or_else(|e| ctx.fail(format!("{:?} write: {e}", layout.kind())));
        scatter(&mut pool.shadow, &extents, st.as_slice());
        pool.verify_all(&ctx, &format!("{:?} after write", layout.kind()));
        let mut rd = pool.staging(&ctx, total as usize);
        rt.block_on(pool.backend.read(&extents, &mut rd))
            .unwrap_or_else(|e| ctx.fail(format!("{:?} read: {e}", layout.kind())));
        if rd.as_slice() != st.as_slice() {
            ctx.fail(format!("{:?}: gather after scatter differs", layout.kind()));
        }
        if layout.extents(&[layout.num_blocks()], lo..hi).is_ok() {
            ctx.fail("layout addressed a block past the pool");
        }
    }
    Ctx { backend, case: "engine_layouts", seed }.ok("vLLM NHD/HND, FlashInfer, SGLang MHA, MLA, SGLang MLA");
}

/// Batches with a bad extent (past the end, overflowing, unknown region) placed among valid
/// ones are refused with the right error, and nothing is written: not the pool (including the
/// batch's in-bounds extents) and not the staging buffer.
pub fn out_of_bounds_writes_nothing(fx: &dyn Fixture, seed: u64) {
    let rt = runtime();
    let mut rng = Rng::new(seed ^ 0x00B0);
    let layout = RandomLayout::generate(&mut rng);
    let (mut pool, ctx) = create(fx, &rt, &layout.region_lens, "out_of_bounds_writes_nothing", seed);
    pool.prefill(&ctx, &mut rng);
    let nregions = layout.region_lens.len() as u32;
    for variant in 0..5 {
        let mut blocks: Vec<u32> = (0..layout.num_blocks).collect();
        rng.shuffle(&mut blocks);
        blocks.truncate(rng.range(1, u64::from(layout.num_blocks)) as usize);
        let mut extents = layout.extents(&blocks);
        let r = rng.range(0, u64::from(nregions) - 1) as u32;
        let rl = layout.region_lens[r as usize];
        let bad = match variant {
            0 => Extent { region: r, offset: rl - 1, len: 2 },
            1 => Extent { region: r, offset: rl, len: 1 },
            2 => Extent { region: r, offset: u64::MAX - 1, len: 16 },
            3 => Extent { region: r, offset: 0, len: rl + 1 },
            _ => Extent { region: nregions + rng.range(0, 3) as u32, offset: 0, len: 1 },
        };
        let at =
            if rng.range(0, 1) == 0 { extents.len() } else { rng.range(0, extents.len() as u64) as usize };
        extents.insert(at, bad);
        let total: u64 = extents.iter().map(|e| e.len.min(1 << 20)).sum();
        let mut st = pool.staging(&ctx, total as usize);
        rng.fill(st.as_mut_slice());
        let expect = |res: Result<(), PoolError>, op: &str| match (variant, res) {
            (0..=3, Err(PoolError::OutOfBounds { region, offset, len, region_len }))
                if region == r && offset == bad.offset && len == bad.len && region_len == rl => {}
            (4, Err(PoolError::UnknownRegion { region, regions }))
                if region == bad.region && regions == nregions => {}
            (_, other) => {
                ctx.fail(format!("variant {variant} {op} with bad extent {bad:?} at {at}: got {other:?}"))
            }
        };
        expect(rt.block_on(pool.backend.write(&extents, &st)), "write");
        pool.verify_all(&ctx, &format!("variant {variant}: after refused write"));
        let before = st.as_slice().to_vec();
        expect(rt.block_on(pool.backend.read(&extents, &mut st)), "read");
        if let Some(i) = first_diff(st.as_slice(), &before) {
            ctx.fail(format!("variant {variant}: refused read wrote staging byte {i}"));
        }
    }
    ctx.ok("5 variants, write+read");
}

/// Writes straight from host memory (`write_host`). Where the backend has them
/// (`writes_host`), random batches land in the engine's memory as `write` puts them, and a
/// batch with an out-of-bounds extent, or bytes one short, is refused with nothing written;
/// where it has none, `write_host` refuses with nothing written.
pub fn host_writes(fx: &dyn Fixture, seed: u64) {
    let rt = runtime();
    let mut rng = Rng::new(seed ^ 0x0405);
    let layout = RandomLayout::generate(&mut rng);
    let (mut pool, ctx) = create(fx, &rt, &layout.region_lens, "host_writes", seed);
    pool.prefill(&ctx, &mut rng);
    let batch = |rng: &mut Rng| {
        let mut blocks = layout.random_blocks(rng);
        if blocks.is_empty() {
            blocks.push(0);
        }
        let extents = layout.extents(&blocks);
        let total: u64 = extents.iter().map(|e| e.len).sum();
        let slack = rng.range(0, 40) as usize;
        let bytes = rng.bytes(total as usize + slack);
        (extents, total as usize, bytes)
    };
    if !pool.backend.writes_host() {
        let (extents, _, bytes) = batch(&mut rng);
        if pool.backend.write_host(&extents, &bytes).is_ok() {
            ctx.fail("write_host succeeded on a backend without host writes");
        }
        pool.verify_all(&ctx, "after a refused host write");
        ctx.ok("no host writes: refused, nothing written");
        return;
    }
    for round in 0..4 {
        let (extents, total, bytes) = batch(&mut rng);
        pool.backend.write_host(&extents, &bytes).unwrap_or_else(|e| {
            ctx.fail(format!(
                "round {round}: host write of {} extents ({total} B) failed: {e}",
                extents.len()
            ))
        });
        scatter(&mut pool.shadow, &extents, &bytes[..total]);
        pool.verify_all(&ctx, &format!("round {round} after a host write"));
    }
    let (extents, total, bytes) = batch(&mut rng);
    match pool.backend.write_host(&extents, &bytes[..total - 1]) {
        Err(PoolError::StagingSize { needed, got }) if needed == total as u64 && got == total as u64 - 1 => {}
        other => ctx.fail(format!("bytes one short: got {other:?}")),
    }
    pool.verify_all(&ctx, "after a host write one byte short");
    let mut bad = extents.clone();
    let r = rng.range(0, layout.region_lens.len() as u64 - 1) as u32;
    let rl = layout.region_lens[r as usize];
    bad.push(Extent { region: r, offset: rl, len: 1 });
    match pool.backend.write_host(&bad, &rng.bytes(total + 1)) {
        Err(PoolError::OutOfBounds { region, region_len, .. }) if region == r && region_len == rl => {}
        other => ctx.fail(format!("out-of-bounds extent: got {other:?}")),
    }
    pool.verify_all(&ctx, "after a refused out-of-bounds host write");
    ctx.ok("4 batches, one short and one out of bounds refused");
}

/// A staging buffer one byte short is refused (`StagingSize`) with nothing written.
pub fn staging_too_small(fx: &dyn Fixture) {
    let rt = runtime();
    let mut rng = Rng::new(0x5A11);
    let layout = RandomLayout::generate(&mut rng);
    let (mut pool, ctx) = create(fx, &rt, &layout.region_lens, "staging_too_small", 0x5A11);
    pool.prefill(&ctx, &mut rng);
    let blocks: Vec<u32> = (0..layout.num_blocks).collect();
    let extents = layout.extents(&blocks);
    let total: u64 = extents.iter().map(|e| e.len).sum();
    let mut st = pool.staging(&ctx, total as usize - 1);
    rng.fill(st.as_mut_slice());
    let check = |res: Result<(), PoolError>, op: &str| match res {
        Err(PoolError::StagingSize { needed, got }) if needed == total && got == total - 1 => {}
        other => ctx.fail(format!(
            "{op}: expected StagingSize {{ needed: {total}, got: {} }}, got {other:?}",
            total - 1
        )),
    };
    check(rt.block_on(pool.backend.write(&extents, &st)), "write");
    pool.verify_all(&ctx, "after refused write");
    let before = st.as_slice().to_vec();
    check(rt.block_on(pool.backend.read(&extents, &mut st)), "read");
    if st.as_slice() != before {
        ctx.fail("refused read wrote into staging");
    }
    ctx.ok(format!("{} extents, {total} B", extents.len()));
}

/// Staging from elsewhere (a plain host allocation under another id, or another backend
/// instance's buffer) is refused (`ForeignStaging`) with nothing written.
pub fn foreign_staging(fx: &dyn Fixture) {
    let rt = runtime();
    let mut rng = Rng::new(0xF0E1);
    let lens = [16_384u64, 5000];
    let (mut pool, ctx) = create(fx, &rt, &lens, "foreign_staging", 0xF0E1);
    let (other, _) = create(fx, &rt, &lens, "foreign_staging", 0xF0E1);
    if other.backend.id() == pool.backend.id() {
        ctx.fail(format!("two backend instances share id {}", pool.backend.id()));
    }
    pool.prefill(&ctx, &mut rng);
    let extents = [Extent { region: 0, offset: 100, len: 4000 }, Extent { region: 1, offset: 0, len: 5000 }];
    let foreigners = [
        ("plain host allocation", Staging::new_host(9000, next_backend_id())),
        ("another instance", { other.staging(&ctx, 9000) }),
    ];
    for (what, mut st) in foreigners {
        rng.fill(st.as_mut_slice());
        match rt.block_on(pool.backend.write(&extents, &st)) {
            Err(PoolError::ForeignStaging) => {}
            other => ctx.fail(format!("write with {what}: expected ForeignStaging, got {other:?}")),
        }
        pool.verify_all(&ctx, &format!("after refused write with {what}"));
        let before = st.as_slice().to_vec();
        match rt.block_on(pool.backend.read(&extents, &mut st)) {
            Err(PoolError::ForeignStaging) => {}
            other => ctx.fail(format!("read with {what}: expected ForeignStaging, got {other:?}")),
        }
        if st.as_slice() != before {
            ctx.fail(format!("refused read with {what} wrote into it"));
        }
    }
    ctx.ok("host allocation and another instance's staging");
}

/// Several tasks on a multi-thread runtime read and write disjoint blocks at once; every read
/// sees exactly its blocks' bytes and the engine memory ends as the union of all writes.
pub fn concurrent_disjoint(fx: &dyn Fixture, seed: u64) {
    const TASKS: u32 = 8;
    const ROUNDS: usize = 12;
    let rt = runtime();
    let mut rng = Rng::new(seed ^ 0xC0C0);
    let block = 16_384 + rng.range(0, 64) * 16;
    let num_blocks = TASKS * 6;
    let lens = [block * u64::from(num_blocks), block * u64::from(num_blocks)];
    let (mut pool, ctx) = create(fx, &rt, &lens, "concurrent_disjoint", seed);
    pool.prefill(&ctx, &mut rng);
    let layout = RandomLayout {
        region_lens: lens.to_vec(),
        planes: vec![(0, 0, block, block), (1, 0, block, block)],
        num_blocks,
    };
    let shadow = Arc::new(pool.shadow.clone());
    let mut handles = Vec::new();
    let barrier = Arc::new(tokio::sync::Barrier::new(TASKS as usize));
    for t in 0..TASKS {
        let mut blocks: Vec<u32> = (0..num_blocks).filter(|b| b % TASKS == t).collect();
        let mut trng = Rng::new(seed.wrapping_add(u64::from(t)));
        trng.shuffle(&mut blocks);
        let extents = layout.extents(&blocks);
        let (backend, barrier, shadow) = (pool.backend.clone(), barrier.clone(), shadow.clone());
        handles.push(rt.spawn(async move {
            let total: usize = extents.iter().map(|e| e.len as usize).sum();
            let mut st = backend.staging(total).map_err(|e| format!("task {t}: staging: {e}"))?;
            let mut rd = backend.staging(total).map_err(|e| format!("task {t}: staging: {e}"))?;
            barrier.wait().await;
            let mut last: Option<Vec<u8>> = None;
            for round in 0..ROUNDS {
                let writer = t % 2 == 0 || round >= ROUNDS / 2;
                if writer {
                    trng.fill(st.as_mut_slice());
                    backend
                        .write(&extents, &st)
                        .await
                        .map_err(|e| format!("task {t} round {round}: write: {e}"))?;
                    last = Some(st.as_slice().to_vec());
                }
                backend
                    .read(&extents, &mut rd)
                    .await
                    .map_err(|e| format!("task {t} round {round}: read: {e}"))?;
                let want = last.clone().unwrap_or_else(|| gather(&shadow, &extents));
                if let Some(i) = first_diff(rd.as_slice(), &want) {
                    return Err(format!("task {t} round {round}: read differs at staging byte {i}"));
                }
                tokio::task::yield_now().await;
            }
            Ok::<_, String>((extents, last))
        }));
    }
    for h in handles {
        match rt.block_on(h) {
            Ok(Ok((extents, Some(data)))) => scatter(&mut pool.shadow, &extents, &data),
            Ok(Ok((_, None))) => ctx.fail("a task never wrote"),
            Ok(Err(msg)) => ctx.fail(msg),
            Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
            Err(join) => ctx.fail(format!("task failed: {join}")),
        }
    }
    pool.verify_all(&ctx, "after concurrent writes");
    ctx.ok(format!("{TASKS} tasks x {ROUNDS} rounds, {num_blocks} blocks of {block} B in 2 regions"));
}

/// A large pool (default 256 MiB in two regions): 2 MiB blocks at the start, the middle and
/// the very end of each region round-trip, and their neighbours stay untouched.
pub fn large_pool(fx: &dyn Fixture) {
    const BLOCK: u64 = 2 << 20;
    let rt = runtime();
    let mut rng = Rng::new(0x1A46E);
    let total = fx.large_pool_bytes();
    let region = total / 2 / BLOCK * BLOCK;
    assert!(region >= 4 * BLOCK, "large_pool_bytes too small: {total}");
    let lens = [region, region];
    let (pool, ctx) = create(fx, &rt, &lens, "large_pool", 0x1A46E);
    let nb = region / BLOCK;
    let mut picks: Vec<(u32, u64)> = Vec::new();
    for r in 0..2u32 {
        for b in [0, 2, nb / 2, nb - 1] {
            picks.push((r, b));
        }
        picks.push((r, rng.range(4, nb - 2)));
    }
    picks.sort_unstable();
    picks.dedup();
    // Neighbour guards: engine-written blocks next to each target that must survive.
    let mut guards = Vec::new();
    for &(r, b) in &picks {
        for g in [b.wrapping_sub(1), b + 1] {
            if g < nb && !picks.contains(&(r, g)) && !guards.iter().any(|(gr, gb, _)| *gr == r && *gb == g) {
                let data = rng.bytes(BLOCK as usize);
                pool.engine.write(r, g * BLOCK, &data).unwrap_or_else(|e| ctx.fail(e));
                guards.push((r, g, data));
            }
        }
    }
    rng.shuffle(&mut picks);
    let extents: Vec<Extent> =
        picks.iter().map(|&(r, b)| Extent { region: r, offset: b * BLOCK, len: BLOCK }).collect();
    let bytes = (BLOCK as usize) * extents.len();
    let mut st = pool.staging(&ctx, bytes);
    rng.fill(st.as_mut_slice());
    rt.block_on(pool.backend.write(&extents, &st)).unwrap_or_else(|e| ctx.fail(format!("write: {e}")));
    let mut got = vec![0u8; BLOCK as usize];
    for (i, e) in extents.iter().enumerate() {
        pool.engine.read(e.region, e.offset, &mut got).unwrap_or_else(|err| ctx.fail(err));
        let want = &st.as_slice()[i * BLOCK as usize..(i + 1) * BLOCK as usize];
        if let Some(d) = first_diff(&got, want) {
            ctx.fail(format!(
                "block at region {} offset {} differs at byte {d} after write",
                e.region, e.offset
            ));
        }
    }
    for (r, g, data) in &guards {
        pool.engine.read(*r, g * BLOCK, &mut got).unwrap_or_else(|err| ctx.fail(err));
        if let Some(d) = first_diff(&got, data) {
            ctx.fail(format!("untouched neighbour block {g} of region {r} changed at byte {d}"));
        }
    }
    // Engine rewrites the first extent; a gather must see it.
    let fresh = rng.bytes(BLOCK as usize);
    pool.engine.write(extents[0].region, extents[0].offset, &fresh).unwrap_or_else(|e| ctx.fail(e));
    let mut rd = pool.staging(&ctx, bytes);
    rt.block_on(pool.backend.read(&extents, &mut rd)).unwrap_or_else(|e| ctx.fail(format!("read: {e}")));
    if first_diff(&rd.as_slice()[..BLOCK as usize], &fresh).is_some()
        || first_diff(&rd.as_slice()[BLOCK as usize..], &st.as_slice()[BLOCK as usize..]).is_some()
    {
        ctx.fail("gather differs from engine memory");
    }
    ctx.ok(format!("{} MiB pool, {} blocks of 2 MiB", (2 * region) >> 20, extents.len()));
}
