//! `Weights`: every parameter tensor of the reference transformer, generated from the
//! config's seed by [`crate::detmath::SplitMix64`] in one fixed order, so two
//! engines with the same [`ModelConfig`] hold bit-identical weights with no download.
//! Matrices are row-major `[out][in]`; uniform values scaled to std `1/sqrt(fan_in)`.

use crate::config::ModelConfig;
use crate::detmath::SplitMix64;
use crate::error::ConfigError;

/// Parameters of one transformer layer.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// RMSNorm gain before attention, `[hidden]`.
    pub attn_norm: Vec<f32>,
    /// Query projection `[heads*head_dim][hidden]`.
    pub wq: Vec<f32>,
    /// Key projection `[kv_heads*head_dim][hidden]`.
    pub wk: Vec<f32>,
    /// Value projection `[kv_heads*head_dim][hidden]`.
    pub wv: Vec<f32>,
    /// Output projection `[hidden][heads*head_dim]`.
    pub wo: Vec<f32>,
    /// RMSNorm gain before the MLP, `[hidden]`.
    pub mlp_norm: Vec<f32>,
    /// SwiGLU gate `[ffn][hidden]`.
    pub w_gate: Vec<f32>,
    /// SwiGLU up `[ffn][hidden]`.
    pub w_up: Vec<f32>,
    /// SwiGLU down `[hidden][ffn]`.
    pub w_down: Vec<f32>,
}

/// All parameters of the model.
#[derive(Debug, Clone)]
pub struct Weights {
    /// Token embeddings `[vocab][hidden]`.
    pub embed: Vec<f32>,
    /// Per-layer weights.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm gain `[hidden]`.
    pub final_norm: Vec<f32>,
    /// LM head `[vocab][hidden]` (not tied to the embeddings).
    pub lm_head: Vec<f32>,
}

fn matrix(rng: &mut SplitMix64, rows: usize, cols: usize) -> Vec<f32> {
    // Uniform(-s, s) has std s/sqrt(3); s = sqrt(3/fan_in) gives std 1/sqrt(fan_in).
    let s = (3.0f32 / cols as f32).sqrt();
    (0..rows * cols).map(|_| rng.next_sym_f32() * s).collect()
}

fn gain(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
    (0..n).map(|_| 1.0 + 0.1 * rng.next_sym_f32()).collect()
}

impl Weights {
    /// Generates the weights of `cfg` from `cfg.seed` (validating `cfg` first).
    pub fn generate(cfg: &ModelConfig) -> Result<Self, ConfigError> {
        cfg.validate()?;
        let mut rng = SplitMix64::new(cfg.seed);
        let (h, q, kv) = (cfg.hidden, cfg.q_width(), cfg.kv_width());
        // Embeddings: std ~1 per element (fan_in 1 in the sense of the scale rule).
        let embed = (0..cfg.vocab * h).map(|_| rng.next_sym_f32() * 1.732_050_8).collect();
        let layers = (0..cfg.layers)
            .map(|_| LayerWeights {
                attn_norm: gain(&mut rng, h),
                wq: matrix(&mut rng, q, h),
                wk: matrix(&mut rng, kv, h),
                wv: matrix(&mut rng, kv, h),
                wo: matrix(&mut rng, h, q),
                mlp_norm: gain(&mut rng, h),
                w_gate: matrix(&mut rng, cfg.ffn, h),
                w_up: matrix(&mut rng, cfg.ffn, h),
                w_down: matrix(&mut rng, h, cfg.ffn),
            })
            .collect();
        let final_norm = gain(&mut rng, h);
        let lm_head = matrix(&mut rng, cfg.vocab, h);
        Ok(Weights { embed, layers, final_norm, lm_head })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn same_seed_same_bits_other_seed_differs() {
        let cfg = ModelConfig::tiny(42);
        let (a, b) = (Weights::generate(&cfg).unwrap(), Weights::generate(&cfg).unwrap());
        assert_eq!(bits(&a.lm_head), bits(&b.lm_head));
        assert_eq!(bits(&a.layers[1].wk), bits(&b.layers[1].wk));
        let c = Weights::generate(&ModelConfig::tiny(43)).unwrap();
        assert_ne!(bits(&a.embed), bits(&c.embed));
        assert_eq!(a.layers[0].wq.len(), cfg.q_width() * cfg.hidden);
        assert_eq!(a.layers[0].w_down.len(), cfg.hidden * cfg.ffn);
    }

    #[test]
    fn scale_is_about_one_over_sqrt_fan_in() {
        let w = Weights::generate(&ModelConfig::tiny(1)).unwrap();
        let m = &w.layers[0].w_gate;
        let var = m.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>() / m.len() as f64;
        assert!((var * 64.0 - 1.0).abs() < 0.1, "var*fan_in = {}", var * 64.0);
    }

    #[test]
    fn invalid_config_is_refused() {
        let mut c = ModelConfig::tiny(1);
        c.heads = 0;
        assert!(Weights::generate(&c).is_err());
    }
}
