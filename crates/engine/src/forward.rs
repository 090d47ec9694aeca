//! The forward pass over a paged KV cache: for the token positions `[start, end)` of one
//! request, embed, run every layer (RMSNorm → Q/K/V → RoPE → store K/V into the pool through
//! the block table → causal GQA attention over positions `[0, end)` read back from the pool →
//! output projection → RMSNorm → SwiGLU MLP), and optionally the final norm and LM head of
//! the last position. Positions `[0, start)` must already be in the pool (computed earlier or
//! loaded from elsewhere); this module never decides where they came from.
//!
//! Invariant: every value of position `p` is a function of the tokens `[0, p]` and of the
//! pool bytes of positions `[0, p)`, computed in a fixed order independent of `start`/`end`.
//! Attention always reads K/V back from the pool (after rounding to its dtype), so a
//! position's result is the same whether its context was computed here or copied in.

use crate::blocks::BlockTable;
use crate::config::ModelConfig;
use crate::kv::{KvMemory, KvPool, Plane};
use crate::math::{dot, matvec, rmsnorm, rope, rope_tables, silu, softmax};
use crate::weights::Weights;

/// Read-only model state the forward pass needs.
#[derive(Debug)]
pub(crate) struct Model<'a> {
    pub cfg: &'a ModelConfig,
    pub weights: &'a Weights,
    pub inv_freq: &'a [f64],
}

/// Runs positions `[start, end)` of `tokens` (which must cover `end`; `start < end`) and
/// stores their K/V through `table`. Returns the logits of position `end - 1` if
/// `want_logits`.
///
/// # Panics
/// If `table` does not cover `end` or a token is outside the vocabulary (callers check both).
pub(crate) fn forward<M: KvMemory>(
    m: &Model<'_>,
    pool: &mut KvPool<M>,
    table: &BlockTable,
    tokens: &[u32],
    start: usize,
    end: usize,
    want_logits: bool,
) -> Option<Vec<f32>> {
    let cfg = m.cfg;
    let (h, qw, kvw, hd) = (cfg.hidden, cfg.q_width(), cfg.kv_width(), cfg.head_dim);
    let n = end - start;
    let half = hd / 2;

    // Embeddings.
    let mut x = vec![0.0f32; n * h];
    for (i, row) in x.chunks_exact_mut(h).enumerate() {
        let t = tokens[start + i] as usize;
        row.copy_from_slice(&m.weights.embed[t * h..(t + 1) * h]);
    }
    // RoPE tables of the chunk's positions.
    let mut cos = vec![0.0f32; n * half];
    let mut sin = vec![0.0f32; n * half];
    for i in 0..n {
        let r = i * half..(i + 1) * half;
        rope_tables(start + i, m.inv_freq, &mut cos[r.clone()], &mut sin[r]);
    }

    let mut hn = vec![0.0f32; h];
    let mut q = vec![0.0f32; n * qw];
    let mut k = vec![0.0f32; kvw];
    let mut v = vec![0.0f32; kvw];
    let mut kctx = vec![0.0f32; end * kvw];
    let mut vctx = vec![0.0f32; end * kvw];
    let mut att = vec![0.0f32; qw];
    let mut proj = vec![0.0f32; h];
    let mut gate = vec![0.0f32; cfg.ffn];
    let mut up = vec![0.0f32; cfg.ffn];
    let mut scores = vec![0.0f32; end];
    let scale = 1.0 / (hd as f32).sqrt();
    let group = cfg.group();

    for (l, lw) in m.weights.layers.iter().enumerate() {
        // Projections, RoPE, and K/V stores for the new positions.
        for i in 0..n {
            let xi = &x[i * h..(i + 1) * h];
            rmsnorm(xi, &lw.attn_norm, &mut hn);
            let qi = &mut q[i * qw..(i + 1) * qw];
            matvec(&lw.wq, &hn, qi);
            matvec(&lw.wk, &hn, &mut k);
            matvec(&lw.wv, &hn, &mut v);
            let (c, s) = (&cos[i * half..(i + 1) * half], &sin[i * half..(i + 1) * half]);
            for head in qi.chunks_exact_mut(hd) {
                rope(head, c, s);
            }
            for head in k.chunks_exact_mut(hd) {
                rope(head, c, s);
            }
            let (block, slot) = table.locate(start + i).expect("block table covers the chunk");
            pool.write_row(l, Plane::K, block, slot, &k);
            pool.write_row(l, Plane::V, block, slot, &v);
        }
        // Context K/V for [0, end), decoded from the pool.
        for p in 0..end {
            let (block, slot) = table.locate(p).expect("block table covers the context");
            pool.read_row(l, Plane::K, block, slot, &mut kctx[p * kvw..(p + 1) * kvw]);
            pool.read_row(l, Plane::V, block, slot, &mut vctx[p * kvw..(p + 1) * kvw]);
        }
        for i in 0..n {
            let pos = start + i;
            // Causal GQA attention of position `pos` over [0, pos].
            for hq in 0..cfg.heads {
                let g = hq / group;
                let qh = &q[i * qw + hq * hd..i * qw + (hq + 1) * hd];
                let s = &mut scores[..=pos];
                for (j, sj) in s.iter_mut().enumerate() {
                    *sj = dot(qh, &kctx[j * kvw + g * hd..j * kvw + (g + 1) * hd]) * scale;
                }
                softmax(s);
                let out = &mut att[hq * hd..(hq + 1) * hd];
                out.fill(0.0);
                for (j, w) in s.iter().enumerate() {
                    let vj = &vctx[j * kvw + g * hd..j * kvw + (g + 1) * hd];
                    for (o, vv) in out.iter_mut().zip(vj) {
                        *o += w * vv;
                    }
                }
            }
            let xi = &mut x[i * h..(i + 1) * h];
            matvec(&lw.wo, &att, &mut proj);
            for (a, b) in xi.iter_mut().zip(&proj) {
                *a += b;
            }
            // SwiGLU MLP.
            rmsnorm(xi, &lw.mlp_norm, &mut hn);
            matvec(&lw.w_gate, &hn, &mut gate);
            matvec(&lw.w_up, &hn, &mut up);
            for (g, u) in gate.iter_mut().zip(&up) {
                *g = silu(*g) * u;
            }
            matvec(&lw.w_down, &gate, &mut proj);
            for (a, b) in xi.iter_mut().zip(&proj) {
                *a += b;
            }
        }
    }

    want_logits.then(|| {
        rmsnorm(&x[(n - 1) * h..n * h], &m.weights.final_norm, &mut hn);
        let mut logits = vec![0.0f32; cfg.vocab];
        matvec(&m.weights.lm_head, &hn, &mut logits);
        logits
    })
}
