//! One full decision (validation, both pure actions, split search, crossovers) must cost well
//! under 1 µs, so the daemon can decide on every request. Baseline in the same run: the seed's
//! bare linear fetch/recompute comparison.
//!
//! Run: `cargo bench -p kvferry-model --bench decision`

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use kvferry_model::presets;
use kvferry_model::{ComputeModel, KvFootprint, LinkModel, Policy, QueueState, Queues, Scenario, decide};

fn scenario(attention: bool, queues: bool) -> Scenario {
    let m = presets::model("llama-3.1-70b").unwrap();
    Scenario {
        kv: KvFootprint::new(m.kv, 2.0).unwrap(),
        compute: ComputeModel::new(m.active_params, 989e12, 0.4, attention.then_some(m.attention)).unwrap(),
        link: LinkModel::new(5.0, 0.07, 1.0).unwrap(),
        prefix_tokens: 32_768,
        queues: queues.then(|| Queues {
            fetch: QueueState::new(0.3, 20.0).unwrap(),
            compute: QueueState::new(0.1, 20.0).unwrap(),
        }),
        load_s_per_byte: 0.0,
    }
}

fn bench(c: &mut Criterion) {
    let policy = Policy { allow_split: true, split_granularity: 1, ..Policy::default() };
    let s = scenario(false, false);
    c.bench_function("baseline: seed linear compare", |b| {
        b.iter(|| {
            let s = black_box(&s);
            let bpt = s.kv.bytes_per_token();
            let f = s.link.fetch_seconds(s.prefix_tokens, bpt);
            let r = s.compute.recompute_seconds(s.prefix_tokens);
            black_box(f < r)
        })
    });
    c.bench_function("decide: linear, split search (granularity 1)", |b| {
        b.iter(|| decide(black_box(&s), black_box(&policy)).unwrap())
    });
    let s = scenario(true, true);
    c.bench_function("decide: attention + queues, split search (granularity 1)", |b| {
        b.iter(|| decide(black_box(&s), black_box(&policy)).unwrap())
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
