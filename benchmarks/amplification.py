"""The amplification experiment on the default model (or MODEL): JSON, plot and a markdown table.

    python benchmarks/amplification.py [MODEL] [--out benchmarks/results]

Runs `quantmla analyze` with its defaults (cache NMSE 1 %, 4 x 512 tokens of the built-in calibration text)
and renders its JSON as the table the README shows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

from quantmla.cli import main as quantmla


def markdown(data: dict, command: str) -> str:
    lines = [
        f"Cache noise of NMSE {data['nmse']:g} in one path of one layer; attention-output NMSE after o_proj.",
        f"Model `{Path(data['model']).name}`, {data['tokens']} tokens. Command: `{command}` "
        f"({datetime.date.today()}, CPU: {platform.processor() or platform.machine()}).",
        "",
        "| layer | content noise → output NMSE | RoPE noise → output NMSE | ratio RoPE/content |",
        "|---:|---:|---:|---:|",
    ]
    for r in data["layers"]:
        lines.append(f"| {r['layer']} | {r['content_out_nmse']:.2e} | {r['rope_out_nmse']:.2e} | {r['ratio']:.2f} |")
    lines.append(f"| **mean** | | | **{data['mean_ratio']:.2f}** |")
    lines += ["", "| noise in every layer | next-token KL (nats) | perplexity (clean) |", "|---|---:|---:|"]
    for path, s in data["end_to_end"].items():
        lines.append(f"| {path} | {s['kl']:.2e} | {s['ppl']:.4f} ({s['ppl_clean']:.4f}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?")
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    out = Path(a.out)
    args = ["analyze", *([a.model] if a.model else []), "--json", str(out / "amplification.json"),
            "--plot", str(out / "amplification.png")]
    if quantmla(args):
        raise SystemExit(1)
    data = json.loads((out / "amplification.json").read_text())
    (out / "amplification.md").write_text(markdown(data, "python benchmarks/amplification.py"))
    print((out / "amplification.md").read_text())
