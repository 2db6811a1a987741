"""How well "auto" picks between the CUDA and the Triton decode kernels, from measured grids.

    python benchmarks/decode_kernel_auto.py benchmarks/results/decode_kernel_cuda_v4*.json \
        benchmarks/results/decode_kernel_cuda_fp8.json [--out benchmarks/results --name decode_kernel_auto]

Reads the JSON of `benchmarks/decode_kernel.py` runs that timed both kernels (--kernels triton,cuda), and for
every (heads, batch, context, format) they share prints both speeds over BF16, the faster kernel, the one
"auto" picks now (`auto_prefers_cuda`), and what a wrong pick costs. No GPU needed: it re-reads measurements, so rerun
it after a new grid or a new rule. Writes {name}.md and {name}.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from quantmla.kernels.mla_decode_cuda import auto_prefers_cuda  # noqa: E402


def cells(paths: list[str]) -> dict[tuple, dict[str, float]]:
    """(heads, batch, context, format) -> {kernel: speed over bf16}; a later file's row replaces an earlier one."""
    out: dict[tuple, dict[str, float]] = {}
    for p in paths:
        with open(p) as fh:
            for r in json.load(fh)["rows"]:
                if r.get("skipped") or r["format"] == "bf16" or r["kernel"] not in ("cuda", "triton"):
                    continue
                out.setdefault((r["heads"], r["batch"], r["context"], r["format"]), {})[r["kernel"]] = r["speedup_vs_bf16"]
    return {k: v for k, v in sorted(out.items()) if len(v) == 2}


def picks(table: dict[tuple, dict[str, float]]) -> list[dict]:
    rows = []
    for (h, b, ctx, fmt), x in table.items():
        pick = "cuda" if auto_prefers_cuda(h, b) else "triton"
        best = max(x, key=x.get)
        rows.append({"heads": h, "batch": b, "context": ctx, "format": fmt, "cuda_x": x["cuda"],
                     "triton_x": x["triton"], "faster": best, "auto": pick, "loss": 1 - x[pick] / x[best]})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="decode_kernel.py JSON files")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--name", default="decode_kernel_auto")
    args = ap.parse_args()
    rows = picks(cells(args.results))
    if not rows:
        sys.exit("no cell has both a cuda and a triton row: run decode_kernel.py with --kernels triton,cuda")
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
        "| H | B | context | format | cuda x | triton x | faster | auto | loss |",
        "|---:|---:|---:|---|---:|---:|---|---|---:|",
    ]
    lines += [f"| {r['heads']} | {r['batch']} | {r['context']} | {r['format']} | {r['cuda_x']:.2f} | "
              f"{r['triton_x']:.2f} | {r['faster']} | {r['auto']} | {r['loss']:.1%} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as fh:
        json.dump({"sources": args.results, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
