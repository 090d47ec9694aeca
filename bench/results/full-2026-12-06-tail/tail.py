"""The loss tail in the runs: python3 tail.py [DIR]

For every decision point of the lossy profile (and, for contrast, the others) in DIR's
run*/report.json: the fetch the daemon predicted, the probability it gave the fetch of
coming in a round trip late (`predicted_fetch_late_p`, its loss tail), what
`1 − (1 − 0.001)^packets` says for the profile's 0.1 % loss (packets: the request and the
payload up to the path's bandwidth-delay product, 1,400 bytes each), and what the fetch
measured. The short warm-up fetches each sweep starts with are in each run's log."""
import json
import sys
from pathlib import Path

here = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
runs = sorted(p for p in here.glob("run*") if (p / "report.json").exists())
KIB_PER_TOKEN = 64
PAYLOAD = 1400.0


def analytic(tokens: int, rate_bps: float, rtt_s: float, loss: float) -> float:
    window = rate_bps * rtt_s / 8
    n = 1 + min(tokens * KIB_PER_TOKEN * 1024, window) / PAYLOAD
    return 1 - (1 - loss) ** n


print("| run | profile | tokens | chosen | fetch predicted, s | late p priced | 1 − (1 − p)^n | fetch measured, s | recompute predicted / measured, s |")
print("|---|---|---:|---|---:|---:|---:|---:|---|")
for run in runs:
    r = json.loads((run / "report.json").read_text())
    for d in r["decisions"]:
        link = d["link"]
        prof = link["profile"]
        loss = link.get("loss", 0.0) or 0.0
        if d["prefix_tokens"] > 400:
            continue
        a = analytic(d["prefix_tokens"], link["rate_bps"], link["rtt_s"], loss) if loss else 0.0
        print(
            f"| {run.name} | {prof} | {d['prefix_tokens']} | {d['chosen']} | {d['predicted_fetch_s']:.3f} "
            f"| {d.get('predicted_fetch_late_p', 0.0):.2f} | {a:.2f} | {d['measured_fetch_s']:.3f} "
            f"| {d['predicted_recompute_s']:.3f} / {d['measured_recompute_s']:.3f} |"
        )
