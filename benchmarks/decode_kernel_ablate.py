"""Where the CUDA decode kernel's time goes, by ablation.

    PYTHONPATH=src python benchmarks/decode_kernel_ablate.py [--batches 16] [--contexts 16384,65536]
        [--format int4/int4] [--heads 16] [--out benchmarks/results]

Each ablation is a copy of `mla_decode_int.cu` with one part of the body-tile loop taken out (named text
substitutions below; the script stops if the source no longer holds the text, so it cannot silently time the
unchanged kernel). Every version is timed in one process against the unmodified kernel on the same cache, as
decode_kernel.bench does (CUDA-graph replays, L2 flushed, median). An ablated kernel's output is wrong by
construction and is not checked. "Share" is 1 - t_ablated / t_full: how much shorter the launch gets without
that part. Shares overlap (parts hide each other's latency), so they need not add up to 1.

It also times the unmodified kernel over a block table folded onto 64 pages (1.2 MB of codes: L2-resident
after the first touch). If that is as slow as the real table, the launch is bound by the SMs' work, not by
memory. Writes decode_kernel_ablate.{json,md}. Needs a GPU and nvcc.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

_VALUES_LOOP = "      // ---- values: content group w, all 64 tokens\n#pragma unroll\n      for (int ks = 0; ks < NT / 16; ++ks) {"

# name -> (what is taken out, [(text, replacement), ...])
ABLATIONS = {
    "score runs": (
        "the scores' MMA runs over the codes (q fragment loads, code loads, dequantization, MMAs, scales)",
        [("        if (CS == 1 || w < NQ) slice(IntC<0>{});\n        else slice(IntC<CS - 1>{});",
          "        keep[0] = keep[1] = keep[2] = keep[3] = 0.f;\n"
          "        if constexpr (CS > 1) sm.xu.xs[w * 32 + lane] = make_float4(0.f, 0.f, 0.f, 0.f);")]),
    "q fragment loads": (
        "3 of the 4 q fragment loads of each score run (each run reuses its first k step's fragment)",
        [("    const uint4 a = qf[32 * kk];", "    const uint4 a = qf[0];")]),
    "values": (
        "the values product: P fragments, scales, code loads, dequantization, MMAs, W",
        [(_VALUES_LOOP, _VALUES_LOOP.replace("ks < NT / 16;", "ks < 0;"))]),
    "values dequantization": (
        "the values' code loads and lop3 dequantization (constant B operands instead)",
        [("          const uint32_t b0 = codes2<CB>(bit < 16 ? y01a : y01b, bit & 15);\n"
          "          const uint32_t b1 = codes2<CB>(bit < 16 ? y23a : y23b, bit & 15);",
          "          const uint32_t b0 = KMID + jn, b1 = KMID - jn;")]),
    "scale staging": (
        "loading the next tile's scales and zeros and storing them to shared memory",
        [("      load_sz(tile_row(tt + 1, nxt[0]));\n", ""), ("      store_sz(tt + 1);\n    }", "    }")]),
    "code copies": (
        "the cp.async copies of the next tiles' codes (the ring keeps stale codes)",
        [("      issue(tt + STAGES - 1, tile_row(tt + STAGES - 1, nxt[STAGES - 2]));", "      cp_commit();")]),
    "zero term": (
        "the two MMAs of the scores' zero term Z",
        [("            mma_f16(z, sm.qzf[0][lane], zb0, zb1);\n            mma_f16(z, sm.qzf[1][lane], zb0, zb1);", "")]),
    "exp2": (
        "the softmax's exp2 (P = S - m instead)",
        [("          const float p0 = exp2f(x[j][2 * r] - m_i[r]), p1 = exp2f(x[j][2 * r + 1] - m_i[r]);",
          "          const float p0 = x[j][2 * r] - m_i[r], p1 = x[j][2 * r + 1] - m_i[r];")]),
}


def ablated(src: str, name: str) -> str:
    """src with ablation `name` applied; exits if a text it replaces is missing."""
    for old, new in ABLATIONS[name][1]:
        if old not in src:
            sys.exit(f"ablation {name!r}: mla_decode_int.cu no longer holds\n{old}\n-- update ABLATIONS")
        src = src.replace(old, new)
    return src


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="16")
    ap.add_argument("--contexts", default="16384,65536")
    ap.add_argument("--format", default="int4/int4")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--only", default="", help="comma-separated ablation names (default: all)")
    ap.add_argument("--rep", type=float, default=10, help="timed replays per row: about this many ms")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--name", default="decode_kernel_ablate", help="results file stem")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(ABLATIONS)
    for n in names:
        if n not in ABLATIONS:
            sys.exit(f"unknown ablation {n!r}; known: {', '.join(ABLATIONS)}")

    import torch
    from decode_kernel import SCALE, bench, build, queries, require_cuda

    require_cuda()
    from decode_kernel_ab import cuda_source

    from quantmla.kernels import mla_decode_cuda as mdc
    from quantmla.kernels.mla_decode import mla_decode

    full = mdc.SRC
    text = full.read_text()
    tmp = Path(tempfile.mkdtemp())
    variants = {}
    for n in names:
        variants[n] = tmp / f"ablate_{len(variants)}.cu"
        variants[n].write_text(ablated(text, n))
    os.environ[mdc.ENV] = "cuda"
    rows = []
    for B in map(int, args.batches.split(",")):
        for ctx in map(int, args.contexts.split(",")):
            qn, qp = queries(B, args.heads)
            cache, tables, lens, slots = build(args.format, B, ctx)
            folded = (tables % 64).contiguous()

            def timed(src, tab):
                with cuda_source(src):
                    return bench(lambda: mla_decode(qn, qp, cache, tab, lens, slots, SCALE, max_seq_len=ctx), args)

            t_full, t_l2 = timed(full, tables), timed(full, folded)
            row = {"batch": B, "context": ctx, "format": args.format, "heads": args.heads, "full_us": t_full,
                   "l2_resident_us": t_l2, "ablations": {n: timed(variants[n], tables) for n in names}}
            rows.append(row)
            print(f"B={B} context={ctx}: full {t_full:.1f} us, L2-resident {t_l2:.1f} us; "
                  + ", ".join(f"{n} {1 - t / t_full:+.1%}" for n, t in row["ablations"].items()), flush=True)
            del cache
            torch.cuda.empty_cache()
    meta = {
        "card": torch.cuda.get_device_name(0),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python"] + sys.argv),
        "torch": torch.__version__,
        "ablations": {n: ABLATIONS[n][0] for n in names},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    shapes = [f"B={r['batch']} / {r['context'] // 1024}K" for r in rows]
    lines = [
        "# Where the CUDA decode kernel's time goes (ablations)",
        "",
        f"Card: {meta['card']}. Date: {meta['date']}. torch {meta['torch']}. Command: `{meta['command']}`. "
        f"{args.format}, {args.heads} heads, kv_lora_rank 512, rope 64, page 64. Median of CUDA-graph replays, "
        "L2 flushed. Share = 1 - t(without the part) / t(full kernel); shares overlap.",
        "",
        "| | " + " | ".join(shapes) + " |",
        "|---|" + "---:|" * len(rows),
        "| full kernel (us) | " + " | ".join(f"{r['full_us']:.1f}" for r in rows) + " |",
        "| codes L2-resident (us) | " + " | ".join(f"{r['l2_resident_us']:.1f}" for r in rows) + " |",
    ]
    for n in names:
        lines.append(f"| without {n}: share | " + " | ".join(f"{1 - r['ablations'][n] / r['full_us']:.1%}" for r in rows) + " |")
    lines += ["", "What each ablation takes out:", ""] + [f"- {n}: {ABLATIONS[n][0]}." for n in names]
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
