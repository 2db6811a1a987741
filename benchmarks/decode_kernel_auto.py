"""How well "auto" picks among the CUDA, many-heads and Triton decode kernels, from measured grids.

    python benchmarks/decode_kernel_auto.py benchmarks/results/decode_kernel_cuda_v4*.json \
        benchmarks/results/decode_kernel_cuda_fp8.json benchmarks/results/decode_kernel_heads.json \
        [--out benchmarks/results --name decode_kernel_auto]

Reads the JSON of `benchmarks/decode_kernel.py` runs that timed the CUDA kernel and at least one other
(--kernels triton,cuda[,heads]), and for every (heads, batch, context, format) prints each kernel's speed over
BF16, the fastest, the one "auto" picks now (`auto_kernel`, with the many-heads kernel available where the
cell timed it) and what a wrong pick costs. No GPU needed: it re-reads measurements, so rerun it after a new
grid or a new rule. Writes {name}.md and {name}.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from quantmla.kernels.mla_decode_cuda import auto_kernel  # noqa: E402

KERNELS = ("cuda", "heads", "triton")


def cells(paths: list[str]) -> dict[tuple, dict[str, float]]:
    """(heads, batch, context, format) -> {kernel: speed over bf16}; a later file's row replaces an earlier one."""
    out: dict[tuple, dict[str, float]] = {}
    for p in paths:
        with open(p) as fh:
            for r in json.load(fh)["rows"]:
                if r.get("skipped") or r["format"] == "bf16" or r["kernel"] not in KERNELS:
                    continue
                out.setdefault((r["heads"], r["batch"], r["context"], r["format"]), {})[r["kernel"]] = r["speedup_vs_bf16"]
    return {k: v for k, v in sorted(out.items()) if "cuda" in v and len(v) >= 2}


def picks(table: dict[tuple, dict[str, float]]) -> list[dict]:
    rows = []
    for (h, b, ctx, fmt), x in table.items():
        pick = auto_kernel(h, b, cuda=True, many_heads="heads" in x)
        if pick not in x:  # the rule wants a kernel this cell did not time: not scored
            continue
        best = max(x, key=x.get)
        rows.append({"heads": h, "batch": b, "context": ctx, "format": fmt,
                     **{f"{k}_x": x.get(k) for k in KERNELS}, "faster": best, "auto": pick,
                     "loss": 1 - x[pick] / x[best]})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="decode_kernel.py JSON files")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--name", default="decode_kernel_auto")
    args = ap.parse_args()
    rows = picks(cells(args.results))
    if not rows:
        sys.exit("no cell has a cuda row and another: run decode_kernel.py with --kernels triton,cuda[,heads]")
    wrong = [r for r in rows if r["loss"] > 0]
    lines = [
        "# The decode kernel \"auto\" picks, against the measured faster one",
        "",
        "From: " + ", ".join(f"`{os.path.basename(p)}`" for p in args.results) + ". x = speed over the BF16 "
        "Triton kernel; loss = how much slower the pick is than the faster kernel.",
        "",
        f"{len(rows)} cells; auto picks the slower kernel in {len(wrong)}"
        + (f", losing at most {max(r['loss'] for r in wrong):.1%}." if wrong else "."),
        "",
        "| H | B | context | format | cuda x | heads x | triton x | faster | auto | loss |",
        "|---:|---:|---:|---|---:|---:|---:|---|---|---:|",
    ]

    def x(v):
        return "" if v is None else f"{v:.2f}"

    lines += [f"| {r['heads']} | {r['batch']} | {r['context']} | {r['format']} | {x(r['cuda_x'])} | "
              f"{x(r['heads_x'])} | {x(r['triton_x'])} | {r['faster']} | {r['auto']} | {r['loss']:.1%} |"
              for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as fh:
        json.dump({"sources": args.results, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
