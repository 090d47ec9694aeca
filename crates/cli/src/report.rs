//! Human-readable rendering of decisions and receipts (shared by `migrate` and `demo`).

use kvferry_proto::v1::{Decision, Receipt};

/// A decision with its reasons and predicted costs.
pub fn decision(d: &Decision) -> String {
    let mut o = format!("decision: {}\n  reason: {}\n", d.action.to_uppercase(), d.reason);
    o += &format!(
        "  source {} holds {} tokens; {} tokens already local\n",
        if d.source_region.is_empty() { "-" } else { &d.source_region },
        d.source_tokens,
        d.local_tokens
    );
    if let Some(l) = &d.link {
        o += &format!(
            "  link: rtt {:.2} ms, goodput {:.2} Gbit/s ({} samples, confidence {:.2})\n",
            l.rtt_ms, l.goodput_gbps, l.samples, l.confidence
        );
    }
    for c in &d.candidates {
        o += &format!(
            "  {:<10} predicted {:>10.3} ms   gpu {:>8.3} s   wan {:>10.0} B{}\n",
            c.action,
            c.seconds * 1e3,
            c.gpu_seconds,
            c.wire_bytes,
            if c.feasible { "" } else { "   (not feasible)" }
        );
    }
    if let Some(x) = d.crossover_tokens {
        o += &format!("  crossover: fetch wins above {x:.0} tokens on this link\n");
    }
    o
}

/// A receipt.
pub fn receipt(r: &Receipt) -> String {
    let mut o = format!(
        "receipt: {} -> {} tokens ready, {:.2} MiB moved in {:.3} s",
        r.action.to_uppercase(),
        r.tokens_ready,
        r.bytes_moved as f64 / 1048576.0,
        r.wall_s
    );
    if r.bytes_moved > 0 {
        o += &format!(
            " ({:.2} Gbit/s = {:.3} GiB/s)",
            r.goodput_gbps,
            r.goodput_gbps * 1e9 / 8.0 / (1u64 << 30) as f64
        );
    }
    o += &format!("\n  predicted {:.3} s vs measured {:.3} s", r.predicted_s, r.measured_s);
    if r.first_layer_s > 0.0 {
        o += &format!("; first layer landed after {:.3} s", r.first_layer_s);
    }
    o += &format!("\n  path: {}", r.path);
    if r.reconnects > 0 {
        o += &format!("\n  reconnects: {}", r.reconnects);
    }
    if !r.fallback.is_empty() {
        o += &format!("\n  fallback: {}", r.fallback);
    }
    o
}
