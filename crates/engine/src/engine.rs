//! The reference [`Engine`]: a model (config + weights) over a paged KV pool, a block
//! allocator, and per-request [`Sequence`]s. It owns the connector-style flow a vLLM KV
//! connector follows — ask how much prefix is ready, allocate, load blocks (checked against
//! fingerprints), compute only the remainder — plus greedy decoding, block publication, block
//! export/import, and the measured prefill profile. It does not talk to a daemon: callers pass
//! offers in and take published blocks out.

use std::ops::Range;

use crate::blocks::{BlockAllocator, BlockTable, blocks_for};
use crate::config::ModelConfig;
use crate::error::{EngineError, FingerprintMismatch, OutOfBlocks};
use crate::forward::{Model, forward};
use crate::hash::{PublishedBlock, block_keys, hex};
use crate::kv::{BLOCK_SIZE, KvLayout, KvMemory, KvPool, VecMemory};
use crate::math::{argmax, rope_inv_freq};
use crate::profile::{PrefillProfile, ProfileClock, ProfileOptions, ProfilePoint, Stopwatch, median};
use crate::weights::Weights;

/// What two engines must share before one may use the other's blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EngineFingerprint {
    /// [`ModelConfig::model_fingerprint`].
    pub model: [u8; 32],
    /// [`KvLayout::fingerprint`].
    pub layout: [u8; 32],
}

/// `Ok` when blocks produced under `got` may be loaded by an engine expecting `expected`.
pub fn accept_blocks(
    expected: &EngineFingerprint,
    got: &EngineFingerprint,
) -> Result<(), FingerprintMismatch> {
    if expected.model != got.model {
        return Err(FingerprintMismatch::Model { ours: hex(&expected.model), theirs: hex(&got.model) });
    }
    if expected.layout != got.layout {
        return Err(FingerprintMismatch::Layout { ours: hex(&expected.layout), theirs: hex(&got.layout) });
    }
    Ok(())
}

/// Tokens of a `prompt_len`-token prompt that may be taken from `hit_blocks` ready leading
/// blocks. Like vLLM, at least the last prompt token is always computed (its hidden state,
/// hence the next-token logits, is not in the KV cache).
pub fn matchable_tokens(prompt_len: usize, hit_blocks: usize) -> usize {
    (hit_blocks * BLOCK_SIZE).min(prompt_len.saturating_sub(1))
}

/// Blocks offered to a sequence by someone else (another engine, via the daemon).
#[derive(Debug, Clone)]
pub struct BlockOffer {
    /// Who produced the bytes.
    pub fingerprint: EngineFingerprint,
    /// Logical index (in the receiving sequence) of the first offered block.
    pub first_block: usize,
    /// One payload per block ([`KvPool::export_block`] format).
    pub payloads: Vec<Vec<u8>>,
}

/// What became of an offer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefixOutcome {
    /// Offered blocks were loaded; `tokens` prompt tokens were not recomputed.
    Loaded {
        /// Tokens taken from the offer.
        tokens: usize,
    },
    /// The offer was refused; the whole remainder was recomputed.
    Refused(FingerprintMismatch),
}

/// One request: its tokens, its block table, how many positions are in the pool, and the
/// logits after the last computed position (when that is the last token).
#[derive(Debug)]
pub struct Sequence {
    tokens: Vec<u32>,
    table: BlockTable,
    computed: usize,
    logits: Option<Vec<f32>>,
}

impl Sequence {
    /// Prompt plus generated tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    /// Logical → physical blocks.
    pub fn table(&self) -> &BlockTable {
        &self.table
    }
    /// Positions whose K/V are in the pool.
    pub fn computed(&self) -> usize {
        self.computed
    }
    /// Next-token logits, once every token is computed.
    pub fn logits(&self) -> Option<&[f32]> {
        self.logits.as_deref()
    }
    /// Ends the request without freeing anything: its physical block ids in logical order,
    /// for a caller that manages blocks itself (see [`Engine::start_with_blocks`]).
    pub fn into_blocks(mut self) -> Vec<u32> {
        self.table.take()
    }
}

/// The reference engine over pool memory `M`.
#[derive(Debug)]
pub struct Engine<M: KvMemory> {
    cfg: ModelConfig,
    weights: Weights,
    inv_freq: Vec<f64>,
    pool: KvPool<M>,
    alloc: BlockAllocator,
    profile: Option<PrefillProfile>,
    clock: ProfileClock,
}

impl Engine<VecMemory> {
    /// An engine whose pool is zeroed heap memory of `num_blocks` blocks.
    pub fn with_heap_pool(cfg: ModelConfig, num_blocks: u32) -> Result<Self, EngineError> {
        cfg.validate()?;
        let layout = KvLayout::for_model(&cfg, num_blocks)?;
        Self::new(cfg, num_blocks, VecMemory::zeroed(&layout.region_lens()))
    }
}

impl<M: KvMemory> Engine<M> {
    /// An engine over externally provided memory (one region per layer of at least
    /// `KvLayout::for_model(&cfg, num_blocks)?.region_len()` bytes).
    pub fn new(cfg: ModelConfig, num_blocks: u32, mem: M) -> Result<Self, EngineError> {
        let weights = Weights::generate(&cfg)?;
        let layout = KvLayout::for_model(&cfg, num_blocks)?;
        let pool = KvPool::new(layout, mem)?;
        let inv_freq = rope_inv_freq(cfg.rope_theta, cfg.head_dim);
        Ok(Engine {
            cfg,
            weights,
            inv_freq,
            pool,
            alloc: BlockAllocator::new(num_blocks),
            profile: None,
            clock: ProfileClock::default(),
        })
    }

    /// The model configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    /// The pool layout (for registering the pool with a transfer backend).
    pub fn layout(&self) -> &KvLayout {
        self.pool.layout()
    }
    /// The pool.
    pub fn pool(&self) -> &KvPool<M> {
        &self.pool
    }
    /// The pool, mutably (a transfer backend landing blocks directly).
    pub fn pool_mut(&mut self) -> &mut KvPool<M> {
        &mut self.pool
    }
    /// Free blocks.
    pub fn free_blocks(&self) -> usize {
        self.alloc.free_count()
    }
    /// This engine's model + layout fingerprint.
    pub fn fingerprint(&self) -> EngineFingerprint {
        EngineFingerprint { model: self.cfg.model_fingerprint(), layout: self.layout().fingerprint() }
    }
    /// The current prefill profile, if measured.
    pub fn profile(&self) -> Option<&PrefillProfile> {
        self.profile.as_ref()
    }
    /// Replaces the profile (e.g. one restored from a previous run).
    pub fn set_profile(&mut self, p: Option<PrefillProfile>) {
        self.profile = p;
    }
    /// The clock served prefills are timed with (the last `measure_profile`'s).
    pub fn profile_clock(&self) -> ProfileClock {
        self.clock
    }

    fn check_tokens(&self, tokens: &[u32], offset: usize) -> Result<(), EngineError> {
        match tokens.iter().position(|&t| t as usize >= self.cfg.vocab) {
            Some(i) => Err(EngineError::TokenOutOfRange {
                token: tokens[i],
                position: offset + i,
                vocab: self.cfg.vocab,
            }),
            None => Ok(()),
        }
    }

    /// A new request for `prompt`, with blocks allocated for the whole prompt; nothing is
    /// computed yet.
    pub fn start(&mut self, prompt: &[u32]) -> Result<Sequence, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        self.check_tokens(prompt, 0)?;
        let blocks = self.alloc.allocate(blocks_for(prompt.len()))?;
        Ok(Sequence { tokens: prompt.to_vec(), table: BlockTable::new(blocks), computed: 0, logits: None })
    }

    /// `n` free blocks that the caller manages from now on (e.g. an engine-wide prefix cache
    /// sharing blocks between requests); all or none. Give them back with
    /// [`Engine::release_blocks`].
    pub fn allocate_blocks(&mut self, n: usize) -> Result<Vec<u32>, OutOfBlocks> {
        self.alloc.allocate(n)
    }

    /// Returns caller-managed blocks to the free list.
    ///
    /// # Panics
    /// On an id out of range (and, in debug builds, a double free): a bookkeeping bug.
    pub fn release_blocks(&mut self, blocks: &[u32]) {
        self.alloc.release(blocks);
    }

    /// A new request for `prompt` over caller-managed `blocks` (logical order; they may
    /// already hold K/V of a shared prefix, declared with [`Engine::mark_loaded`]). They must
    /// cover the prompt; spare capacity is used by decoding before any block is allocated.
    /// End it with [`Sequence::into_blocks`], not [`Engine::free`].
    pub fn start_with_blocks(&mut self, prompt: &[u32], blocks: Vec<u32>) -> Result<Sequence, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        self.check_tokens(prompt, 0)?;
        let num_blocks = self.layout().num_blocks;
        if let Some(&b) = blocks.iter().find(|&&b| b >= num_blocks) {
            return Err(crate::error::PoolError::BlockOutOfRange { block: b, num_blocks }.into());
        }
        let table = BlockTable::new(blocks);
        if table.capacity() < prompt.len() {
            return Err(EngineError::Range(format!(
                "{} blocks cannot hold a {}-token prompt",
                table.blocks().len(),
                prompt.len()
            )));
        }
        Ok(Sequence { tokens: prompt.to_vec(), table, computed: 0, logits: None })
    }

    /// Ends a request, returning its blocks to the free list.
    pub fn free(&mut self, mut seq: Sequence) {
        self.alloc.release(&seq.table.take());
    }

    /// Declares positions `[computed, upto)` present in the sequence's blocks (someone loaded
    /// them). `upto <= tokens`.
    pub fn mark_loaded(&mut self, seq: &mut Sequence, upto: usize) -> Result<(), EngineError> {
        if upto > seq.tokens.len() || upto < seq.computed {
            return Err(EngineError::Range(format!(
                "mark_loaded({upto}) outside [{}, {}]",
                seq.computed,
                seq.tokens.len()
            )));
        }
        if upto > seq.computed {
            seq.computed = upto;
            seq.logits = None;
        }
        Ok(())
    }

    /// Computes positions `[computed, end)` (attending to everything before), storing their
    /// K/V. Logits are kept when `end` is the last token. Feeds the profile when one exists.
    pub fn prefill_to(&mut self, seq: &mut Sequence, end: usize) -> Result<(), EngineError> {
        if end <= seq.computed || end > seq.tokens.len() {
            return Err(EngineError::Range(format!(
                "prefill_to({end}) needs computed ({}) < end <= {}",
                seq.computed,
                seq.tokens.len()
            )));
        }
        let start = seq.computed;
        let want_logits = end == seq.tokens.len();
        let clock = Stopwatch::start(self.clock);
        let model = Model { cfg: &self.cfg, weights: &self.weights, inv_freq: &self.inv_freq };
        let logits = forward(&model, &mut self.pool, &seq.table, &seq.tokens, start, end, want_logits);
        let secs = clock.seconds();
        if let Some(p) = self.profile.as_mut() {
            p.observe(start, end - start, secs);
        }
        seq.computed = end;
        seq.logits = logits;
        Ok(())
    }

    /// Computes the rest of the sequence; returns the next-token logits.
    pub fn prefill(&mut self, seq: &mut Sequence) -> Result<Vec<f32>, EngineError> {
        if seq.computed < seq.tokens.len() {
            self.prefill_to(seq, seq.tokens.len())?;
        }
        seq.logits.clone().ok_or_else(|| {
            EngineError::Range("all tokens were loaded; the last one must be computed for logits".into())
        })
    }

    /// Positions `[0, cached)` are already in the pool (loaded by someone else); compute the
    /// rest and return the next-token logits. `cached` must leave at least one token.
    pub fn prefill_from(&mut self, seq: &mut Sequence, cached: usize) -> Result<Vec<f32>, EngineError> {
        if cached >= seq.tokens.len() {
            return Err(EngineError::Range(format!("prefill_from({cached}) leaves no token to compute")));
        }
        self.mark_loaded(seq, cached)?;
        self.prefill(seq)
    }

    /// Appends `token` and computes it; returns the new next-token logits.
    pub fn step<'s>(&mut self, seq: &'s mut Sequence, token: u32) -> Result<&'s [f32], EngineError> {
        if seq.computed != seq.tokens.len() {
            return Err(EngineError::Range("step before the prompt is fully computed".into()));
        }
        self.check_tokens(&[token], seq.tokens.len())?;
        if seq.tokens.len() == seq.table.capacity() {
            let b = self.alloc.allocate(1)?;
            seq.table.extend(&b);
        }
        seq.tokens.push(token);
        let pos = seq.tokens.len() - 1;
        let model = Model { cfg: &self.cfg, weights: &self.weights, inv_freq: &self.inv_freq };
        seq.logits = forward(&model, &mut self.pool, &seq.table, &seq.tokens, pos, pos + 1, true);
        seq.computed = pos + 1;
        Ok(seq.logits.as_deref().unwrap_or_default())
    }

    /// Greedy decoding of `steps` tokens after a computed prompt; returns them.
    pub fn decode(&mut self, seq: &mut Sequence, steps: usize) -> Result<Vec<u32>, EngineError> {
        let mut out = Vec::with_capacity(steps);
        for _ in 0..steps {
            let logits = seq.logits.as_deref().ok_or_else(|| {
                EngineError::Range("decode needs the next-token logits (prefill first)".into())
            })?;
            let next = argmax(logits) as u32;
            self.step(seq, next)?;
            out.push(next);
        }
        Ok(out)
    }

    /// The full, computed blocks of `seq` under tenant `salt`: content key → physical id.
    pub fn published_blocks(&self, seq: &Sequence, salt: &[u8]) -> Vec<PublishedBlock> {
        let full = seq.computed / BLOCK_SIZE;
        block_keys(salt, &seq.tokens[..full * BLOCK_SIZE], BLOCK_SIZE)
            .into_iter()
            .zip(seq.table.blocks())
            .map(|(hash, &block_id)| PublishedBlock { hash, block_id })
            .collect()
    }

    /// Payloads of the sequence's logical blocks `range` (each: every layer's K then V).
    pub fn export_blocks(&self, seq: &Sequence, range: Range<usize>) -> Result<Vec<Vec<u8>>, EngineError> {
        let ids = seq.table.blocks().get(range.clone()).ok_or_else(|| {
            EngineError::Range(format!(
                "export of blocks {range:?} of a {}-block table",
                seq.table.blocks().len()
            ))
        })?;
        Ok(ids.iter().map(|&b| self.pool.export_block(b)).collect::<Result<_, _>>()?)
    }

    /// Loads offered payloads into the sequence's logical blocks starting at `first_block`,
    /// after checking the producer's fingerprint. Nothing is written on refusal. Does not
    /// move `computed`: follow with [`Engine::mark_loaded`].
    pub fn import_blocks(&mut self, seq: &Sequence, offer: &BlockOffer) -> Result<(), EngineError> {
        accept_blocks(&self.fingerprint(), &offer.fingerprint)?;
        let end = offer.first_block + offer.payloads.len();
        let ids = seq.table.blocks().get(offer.first_block..end).ok_or_else(|| {
            EngineError::Range(format!(
                "offer of blocks {}..{end} to a {}-block table",
                offer.first_block,
                seq.table.blocks().len()
            ))
        })?;
        let want = self.layout().payload_bytes();
        if let Some(bad) = offer.payloads.iter().find(|p| p.len() != want) {
            return Err(crate::error::PoolError::PayloadLen { want, got: bad.len() }.into());
        }
        for (&b, p) in ids.iter().zip(&offer.payloads) {
            self.pool.import_block(b, p)?;
        }
        Ok(())
    }

    /// The connector flow for a new request: take a prefix offer (blocks from logical block
    /// 0), load what is acceptable, compute the remainder, return the logits. A refused offer
    /// (fingerprint mismatch) is recomputed instead. At least the last token is computed.
    pub fn prefill_with_offer(
        &mut self,
        seq: &mut Sequence,
        offer: &BlockOffer,
    ) -> Result<(PrefixOutcome, Vec<f32>), EngineError> {
        if offer.first_block * BLOCK_SIZE != seq.computed {
            return Err(EngineError::Range(format!(
                "offer starts at block {} but {} tokens are computed",
                offer.first_block, seq.computed
            )));
        }
        let outcome = match self.import_blocks(seq, offer) {
            Ok(()) => {
                let upto = matchable_tokens(seq.tokens.len(), offer.first_block + offer.payloads.len());
                let taken = upto.saturating_sub(seq.computed);
                self.mark_loaded(seq, upto.max(seq.computed))?;
                PrefixOutcome::Loaded { tokens: taken }
            }
            Err(EngineError::Refused(m)) => PrefixOutcome::Refused(m),
            Err(e) => return Err(e),
        };
        let logits = self.prefill(seq)?;
        Ok((outcome, logits))
    }

    /// Measures prefill cost at several context lengths (synthetic zeroed context; the cost
    /// does not depend on values), fits the profile, installs and returns it.
    pub fn measure_profile(&mut self, opts: &ProfileOptions) -> Result<PrefillProfile, EngineError> {
        let max_c = opts.contexts.iter().copied().max().unwrap_or(0);
        if opts.chunk == 0 || opts.repeats == 0 || opts.contexts.is_empty() {
            return Err(EngineError::Range("profile needs contexts, chunk > 0 and repeats > 0".into()));
        }
        let total = max_c + opts.chunk;
        let blocks = self.alloc.allocate(blocks_for(total))?;
        let table = BlockTable::new(blocks);
        let result = self.measure_on(&table, total, opts);
        self.alloc.release(table.blocks());
        let points = result?;
        let p = PrefillProfile::fit(points)
            .ok_or_else(|| EngineError::Range("no usable profile point (timer resolution?)".into()))?;
        self.profile = Some(p.clone());
        self.clock = opts.clock;
        Ok(p)
    }

    fn measure_on(
        &mut self,
        table: &BlockTable,
        total: usize,
        opts: &ProfileOptions,
    ) -> Result<Vec<ProfilePoint>, EngineError> {
        for &b in table.blocks() {
            self.pool.zero_block(b)?;
        }
        let vocab = self.cfg.vocab;
        let tokens: Vec<u32> = (0..total).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
        let model = Model { cfg: &self.cfg, weights: &self.weights, inv_freq: &self.inv_freq };
        let pool = &mut self.pool;
        // Warm-up (caches, page faults of scratch buffers).
        forward(&model, pool, table, &tokens, 0, opts.chunk, true);
        let mut points = Vec::with_capacity(opts.contexts.len());
        for &c in &opts.contexts {
            let mut times: Vec<f64> = (0..opts.repeats)
                .map(|_| {
                    let clock = Stopwatch::start(opts.clock);
                    forward(&model, pool, table, &tokens, c, c + opts.chunk, true);
                    clock.seconds()
                })
                .collect();
            points.push(ProfilePoint { context: c, tokens: opts.chunk, seconds: median(&mut times) });
        }
        Ok(points)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matchable_leaves_the_last_token() {
        assert_eq!(matchable_tokens(40, 2), 32);
        assert_eq!(matchable_tokens(32, 2), 31);
        assert_eq!(matchable_tokens(32, 5), 31);
        assert_eq!(matchable_tokens(1, 1), 0);
        assert_eq!(matchable_tokens(0, 0), 0);
    }

    #[test]
    fn caller_managed_blocks_share_a_prefix() {
        let mut e = Engine::with_heap_pool(ModelConfig::tiny(3), 8).unwrap();
        let prompt: Vec<u32> = (0..20).map(|i| (i * 37 % 256) as u32).collect();
        let blocks = e.allocate_blocks(2).unwrap();
        let mut a = e.start_with_blocks(&prompt, blocks).unwrap();
        let full = e.prefill(&mut a).unwrap();
        let a_blocks = a.into_blocks();
        assert_eq!(e.free_blocks(), 6);
        // A second request reuses A's first block and computes only the rest.
        let mut b_blocks = vec![a_blocks[0]];
        b_blocks.extend(e.allocate_blocks(1).unwrap());
        let mut b = e.start_with_blocks(&prompt, b_blocks).unwrap();
        let reused = e.prefill_from(&mut b, BLOCK_SIZE).unwrap();
        assert_eq!(
            reused.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            full.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        assert!(matches!(e.start_with_blocks(&prompt, vec![0]), Err(EngineError::Range(_))));
        assert!(matches!(e.start_with_blocks(&prompt, vec![0, 8]), Err(EngineError::Pool(_))));
        e.release_blocks(&b.into_blocks()[1..]);
        e.release_blocks(&a_blocks);
        assert_eq!(e.free_blocks(), 8);
    }

    #[test]
    fn accept_blocks_names_the_mismatch() {
        let a = EngineFingerprint { model: [1; 32], layout: [2; 32] };
        assert_eq!(accept_blocks(&a, &a), Ok(()));
        let mut b = a;
        b.layout[31] = 0;
        assert!(matches!(accept_blocks(&a, &b), Err(FingerprintMismatch::Layout { .. })));
        b.model[0] = 0;
        assert!(matches!(accept_blocks(&a, &b), Err(FingerprintMismatch::Model { .. })));
    }
}
