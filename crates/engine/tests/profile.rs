//! Done criterion 5: the measured prefill profile predicts a direct timing of the same kind
//! of prefill, taken in the same run, within 20%, and its shape shows the attention term
//! (per-token cost rises with context). Measured again when a noisy moment on this shared
//! machine spoils an attempt (see `ATTEMPTS`). Alone in its own test binary so no other test of
//! this crate competes for the CPU while it times.

mod common;

use common::random_prompt;
use kvferry_engine::detmath::SplitMix64;
use kvferry_engine::profile::Stopwatch;
use kvferry_engine::{Engine, KvDtype, ModelConfig, ProfileClock, ProfileOptions};
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Wide enough in attention (4 KV heads) that the attention term dominates at long context.
fn profile_config() -> ModelConfig {
    ModelConfig {
        layers: 2,
        hidden: 64,
        heads: 4,
        kv_heads: 4,
        head_dim: 16,
        ffn: 128,
        vocab: 256,
        rope_theta: 10_000.0,
        seed: 7,
        kv_dtype: KvDtype::F32,
    }
}

/// Median thread-CPU time of prefilling `prompt[context..]` after a loaded `[0, context)`
/// (the profile's clock; this box is shared with other builds, so wall time is noise).
fn direct_timing(
    e: &mut Engine<kvferry_engine::VecMemory>,
    prompt: &[u32],
    context: usize,
    reps: usize,
) -> f64 {
    let times = (0..reps)
        .map(|_| {
            let mut s = e.start(prompt).unwrap();
            if context > 0 {
                e.mark_loaded(&mut s, context).unwrap();
            }
            let clock = Stopwatch::start(ProfileClock::ThreadCpu);
            e.prefill(&mut s).unwrap();
            let dt = clock.seconds();
            e.free(s);
            dt
        })
        .collect();
    median(times)
}

/// One attempt: measure the profile, then the direct timings right after it; the relative
/// prediction errors at context 0 and 320.
fn one_attempt(e: &mut Engine<kvferry_engine::VecMemory>, prompt: &[u32]) -> Vec<(usize, f64, f64)> {
    let opts = ProfileOptions {
        contexts: vec![0, 256, 512, 768],
        chunk: 64,
        repeats: 5,
        clock: ProfileClock::ThreadCpu,
    };
    e.set_profile(None);
    let t0 = Instant::now();
    let profile = e.measure_profile(&opts).unwrap();
    eprintln!("profile measured in {:.2}s: {profile:?}", t0.elapsed().as_secs_f64());

    // Shape: the attention term is there and per-token cost rises with context.
    assert!(profile.b_attention_s_per_pair > 0.0);
    let first = profile.points[0].seconds / profile.points[0].tokens as f64;
    let last = profile.points.last().map(|p| p.seconds / p.tokens as f64).unwrap();
    assert!(last > 1.5 * first, "per-token cost {first:e} at c=0 vs {last:e} at c=768");
    assert!(profile.per_token_at(768) > 1.5 * profile.per_token_at(0));

    // Direct timings in the same run: a full prefill from scratch, and a remainder after a
    // loaded prefix (the migrated-prefix case), each compared with the profile's prediction.
    e.set_profile(None);
    [0usize, 320]
        .into_iter()
        .map(|context| {
            let measured = direct_timing(e, prompt, context, 5);
            let predicted = profile.predict(context, prompt.len() - context);
            (context, measured, predicted)
        })
        .collect()
}

/// The profile is a timing on a machine other builds share: an attempt whose errors exceed
/// the bound is measured again (up to `ATTEMPTS` times), so a noisy moment does not fail the
/// test while a model that mispredicts (no attention term, a wrong fit) fails every attempt.
const ATTEMPTS: usize = 5;

#[test]
fn measured_profile_predicts_direct_timing_and_shows_attention() {
    let mut e = Engine::with_heap_pool(profile_config(), 80).unwrap();
    let mut rng = SplitMix64::new(11);
    let prompt = random_prompt(&mut rng, 256, 448, 449);
    let mut worst = Vec::new();
    for attempt in 1..=ATTEMPTS {
        let results = one_attempt(&mut e, &prompt);
        let mut max_err: f64 = 0.0;
        for &(context, measured, predicted) in &results {
            let err = (predicted - measured).abs() / measured;
            eprintln!(
                "attempt {attempt}, context {context}: measured {measured:.4}s predicted {predicted:.4}s ({:.1}%)",
                err * 100.0
            );
            max_err = max_err.max(err);
        }
        if max_err < 0.20 {
            return;
        }
        worst.push((max_err, results));
    }
    panic!("the profile mispredicted direct timings by 20% or more in all {ATTEMPTS} attempts: {worst:?}");
}

#[test]
fn profile_refreshes_from_served_prefills() {
    let mut e = Engine::with_heap_pool(ModelConfig::tiny(1), 16).unwrap();
    let opts = ProfileOptions { contexts: vec![0, 64], chunk: 16, repeats: 1, ..Default::default() };
    e.measure_profile(&opts).unwrap();
    let mut s = e.start(&[3; 40]).unwrap();
    e.prefill(&mut s).unwrap();
    assert_eq!(e.profile().unwrap().observations, 1);
}
