"""Folds the runs' report.json into the tables of README.md: python3 summarize.py [DIR]

DIR holds the run*/report.json to fold (default: this script's folder); other series of full
runs use this script with their folder, e.g. `python3 ../full-2026-12-05/summarize.py .`."""
import json
import statistics
import sys
from pathlib import Path

here = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
runs = sorted(p for p in here.glob("run*") if (p / "report.json").exists())
reports = [(p.name, json.loads((p / "report.json").read_text())) for p in runs]
MIB = 1 << 20


def transfers() -> None:
    print("| profile | size MiB | " + " | ".join(f"{n} % of link (meas/model), CPU s/GiB src/tgt" for n, _ in reports) + " |")
    print("|---|---:|" + "---|" * len(reports))
    keys = []
    for _, r in reports:
        for t in r["transfers"]:
            k = (t["link"]["profile"], t["session_bytes"] // MIB)
            if k not in keys:
                keys.append(k)
    for prof, size in keys:
        cells = []
        for _, r in reports:
            t = next((t for t in r["transfers"] if (t["link"]["profile"], t["session_bytes"] // MIB) == (prof, size)), None)
            if t is None:
                cells.append("—")
                continue
            pct = 100 * t["goodput_bps"] / t["link"]["rate_bps"]
            cells.append(f"{pct:.1f} ({t['wall_s'] / t['model_fetch_s']:.2f}), {t['cpu_s_per_gib_source']:.2f} / {t['cpu_s_per_gib_target']:.2f}")
        print(f"| {prof} | {size} | " + " | ".join(cells) + " |")


def decisions() -> None:
    print("| run | points | accuracy % | mean regret % | worst regret % | hedges run |")
    print("|---|---:|---:|---:|---:|---:|")
    for n, r in reports:
        s = next(s for s in r["decision_summary"] if s["profile"] == "all") if any(
            s["profile"] == "all" for s in r["decision_summary"]) else None
        ds = r["decisions"]
        hedges = sum(1 for d in ds if str(d["chosen"]).startswith("hedge"))
        if s is None:
            acc = statistics.mean(x["accuracy"] for x in r["decision_summary"])
            print(f"| {n} | {len(ds)} | {100 * acc:.1f} | | | {hedges} |")
        else:
            print(f"| {n} | {s['n']} | {100 * s['accuracy']:.1f} | {100 * s['mean_regret']:.1f} | {100 * s['worst_regret']:.1f} | {hedges} |")


def splits() -> None:
    print("| run | splits | within 10 % of modeled | within 15 % | ≥ 20 % faster than best pure | slower than best pure |")
    print("|---|---:|---:|---:|---:|---:|")
    for n, r in reports:
        sp = r["splits"]
        err = [abs(s["measured_split_s"] / s["predicted_split_s"] - 1) for s in sp]
        best = [s["measured_split_s"] / min(s["measured_fetch_s"], s["measured_recompute_s"]) for s in sp]
        print(f"| {n} | {len(sp)} | {sum(e <= 0.10 for e in err)} | {sum(e <= 0.15 for e in err)} | {sum(b <= 0.8 for b in best)} | {sum(b > 1.0 for b in best)} |")


def decision_profiles(r: dict) -> list:
    """The profiles of a run's decision sweeps, in the order they ran."""
    return list(dict.fromkeys(d["link"]["profile"] for d in r["decisions"]))


def split_scope() -> None:
    """Issue 13's split target per run: within 15 % of modeled; where the measured per-token
    costs are within 4x, >= 20 % faster than the better pure action; and what each profile
    split at all (a loaded host should mostly not)."""
    print("| run | profile | splits | within 15 % | in scope (costs within 4×) | in scope ≥ 20 % faster | slower than best pure |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for n, r in reports:
        for prof in decision_profiles(r):
            sp = [s for s in r["splits"] if s["link"]["profile"] == prof]
            within = sum(abs(s["measured_split_s"] / s["predicted_split_s"] - 1) <= 0.15 for s in sp)
            scope = [s for s in sp if max(s["measured_fetch_s"], s["measured_recompute_s"]) / min(s["measured_fetch_s"], s["measured_recompute_s"]) <= 4.0]
            fast = sum(s["measured_split_s"] / min(s["measured_fetch_s"], s["measured_recompute_s"]) <= 0.8 for s in scope)
            slow = sum(s["measured_split_s"] > min(s["measured_fetch_s"], s["measured_recompute_s"]) for s in sp)
            print(f"| {n} | {prof} | {len(sp)} | {within} | {len(scope)} | {fast} | {slow} |")


def fetch_per_token(r: dict, prof: str) -> float:
    """The profile's measured fetch seconds per token: the least-squares slope of the measured
    fetches (the engine's load included) against their prefix lengths, its fixed cost (the round
    trips) the intercept."""
    pts = [(d["prefix_tokens"], d["measured_fetch_s"]) for d in r["decisions"] if d["link"]["profile"] == prof]
    if len(pts) < 2:
        return float("nan")
    return statistics.linear_regression([x for x, _ in pts], [y for _, y in pts]).slope


def split_scope_per_token() -> None:
    """The same target with issue 13's own scope: where the two per-token costs are within 4x.
    Per token: a fetch's marginal seconds per token (the slope above; a split cannot halve the
    fetch's round trips, only its bytes) and a recompute's measured seconds per token at that
    prefix. `split_scope` above scopes by the two whole costs, round trips included."""
    print("| run | profile | fetch ms/token | splits in scope (per-token costs within 4×) | in scope ≥ 20 % faster | their gains % |")
    print("|---|---|---:|---:|---:|---|")
    for n, r in reports:
        for prof in decision_profiles(r):
            b = fetch_per_token(r, prof)
            sp = [s for s in r["splits"] if s["link"]["profile"] == prof]
            scope = [s for s in sp if b > 0 and max(b, s["measured_recompute_s"] / s["prefix_tokens"]) / min(b, s["measured_recompute_s"] / s["prefix_tokens"]) <= 4.0]
            gains = [1 - s["measured_split_s"] / min(s["measured_fetch_s"], s["measured_recompute_s"]) for s in scope]
            fast = sum(g >= 0.2 for g in gains)
            print(f"| {n} | {prof} | {1e3 * b:.3f} | {len(scope)} of {len(sp)} | {fast} | {', '.join(f'{100 * g:.0f}' for g in gains)} |")


def baselines() -> None:
    print("| profile | " + " | ".join(f"{n}: kvferry ÷ tcp-tls / nixl-ucx-tcp / quinn-defaults (256 MiB)" for n, _ in reports) + " |")
    print("|---|" + "---|" * len(reports))
    profs = []
    for _, r in reports:
        for b in r["baselines"]:
            if b["link"]["profile"] not in profs:
                profs.append(b["link"]["profile"])
    for prof in profs:
        cells = []
        for _, r in reports:
            k = next((t for t in r["transfers"] if t["link"]["profile"] == prof and t["session_bytes"] == 256 * MIB), None)
            out = []
            for name in ("tcp-tls", "nixl-ucx-tcp", "quinn-defaults"):
                b = next((b for b in r["baselines"] if b["link"]["profile"] == prof and b["name"] == name), None)
                out.append(f"{k['goodput_bps'] / b['goodput_bps']:.2f}" if k and b and b["goodput_bps"] > 0 else "—")
            cells.append(" / ".join(out))
        print(f"| {prof} | " + " | ".join(cells) + " |")


def bands() -> None:
    print("| run | fetch within 1 sd % / median z | recompute within 1 sd % / median z |")
    print("|---|---|---|")
    for n, r in reports:
        cells = []
        for a in ("fetch", "recompute"):
            z = sorted(abs(d[f"measured_{a}_s"] - d[f"predicted_{a}_s"]) / d[f"predicted_{a}_sd_s"]
                       for d in r["decisions"] if d.get(f"predicted_{a}_sd_s", 0) > 0)
            cells.append(f"{100 * sum(v <= 1 for v in z) / len(z):.1f} / {statistics.median(z):.2f}" if z else "—")
        print(f"| {n} | " + " | ".join(cells) + " |")


def calibrated_error() -> None:
    """Issue 13's second target: median |measured / predicted - 1| of each action at the
    decision points whose calibration had at least 10 samples."""
    print("| run | fetch: median \\|meas ÷ pred − 1\\| after 10+ samples (points) | recompute: the same (points) |")
    print("|---|---|---|")
    for n, r in reports:
        cells = []
        for a in ("fetch", "recompute"):
            e = [abs(d[f"measured_{a}_s"] / d[f"predicted_{a}_s"] - 1) for d in r["decisions"]
                 if d.get(f"{a}_samples", 0) >= 10 and d.get(f"measured_{a}_s") and d.get(f"predicted_{a}_s")]
            cells.append(f"{100 * statistics.median(e):.1f} % ({len(e)})" if e else "—")
        print(f"| {n} | " + " | ".join(cells) + " |")


for f in (transfers, baselines, decisions, bands, calibrated_error, splits, split_scope, split_scope_per_token):
    f()
    print()
sys.exit(0)
