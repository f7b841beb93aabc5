"""Markdown table of the harness results (results/*.json), in run order."""

import json
from pathlib import Path

rows = []
for f in sorted(Path(__file__).with_name("results").glob("*.json"), key=lambda p: p.stat().st_mtime):
    r = json.loads(f.read_text())
    if "final_full_val" not in r:
        continue
    cmd = (
        r["command"]
        .replace("harness.py ", "")
        .replace(f"--name {r['name']} ", "")
        .replace(f"--lever {r['lever']} ", "")
    )
    rows.append(
        f"| {r['name']} | {r['lever']} | `{cmd}` | {r['steps']} | {r['tokens']:,} | {r['train_time_s']:.0f} | "
        f"**{r['final_full_val']['bpb']:.4f}** | {r['tokens_per_s']:,.0f} | {r['load_before'][0]:.2f}/{max(x[0] for x in r['load_during']):.2f}/{r['load_after'][0]:.2f} |"
    )
print(
    "| run | lever | args (harness.py ...) | steps | tokens | train s | val bpb (full) | tokens/s | load 1-min before/max during/after |"
)
print("|---|---|---|---|---|---|---|---|---|")
print("\n".join(rows))
