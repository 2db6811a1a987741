"""The Triton decode kernel's shortest split (KernelConfig.min_split), timed.

    PYTHONPATH=src python benchmarks/decode_kernel_min_split.py [--batches 1,16,64] [--contexts 1024,4096,16384]
        [--heads 16,128] [--formats bf16,int4/int4] [--min-splits 64,128,256,512] [--out benchmarks/results]

A sequence of L tokens gets min(want, ceil(L / min_split)) splits (`num_splits_for`; want keeps every SM busy),
so min_split decides the split count of short sequences and of small batches. For each shape and format this
times `mla_decode` with the Triton kernel and `default_config` but for min_split (CUDA-graph replays, L2
flushed, median, as decode_kernel.bench), each run checked against the fp64 reference. Writes
decode_kernel_min_split.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--formats", default="bf16,int4/int4")
    ap.add_argument("--min-splits", default="64,128,256,512")
    ap.add_argument("--rep", type=float, default=10, help="timed replays per row: about this many ms")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()

    import torch
    from decode_kernel import SCALE, bench, build, check, ok, queries, require_cuda, run_meta, write_results

    require_cuda()

    from quantmla.kernels.mla_decode import default_config, mla_decode, num_splits_for

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    mins = [int(x) for x in args.min_splits.split(",")]
    rows = []
    for fmt in args.formats.split(","):
        for H in map(int, args.heads.split(",")):
            for B in map(int, args.batches.split(",")):
                for ctx in map(int, args.contexts.split(",")):
                    cache, tables, lens, slots = build(fmt, B, ctx)
                    qn, qp = queries(B, H)
                    times = {}
                    for m in mins:
                        cfg = replace(default_config(cache, H), min_split=m)
                        run = lambda c=cfg: mla_decode(qn, qp, cache, tables, lens, slots, SCALE, max_seq_len=ctx, config=c)  # noqa: E731
                        err = check(cache, tables, lens, slots, qn, qp, *run())
                        if not ok(err):
                            sys.exit(f"{fmt} H={H} B={B} context={ctx} min_split={m}: error {err}")
                        times[str(m)] = {"splits": num_splits_for(B, H, ctx, cfg, sms), "us": bench(run, args)}
                    del cache
                    torch.cuda.empty_cache()
                    rows.append({"format": fmt, "heads": H, "batch": B, "context": ctx, "triton": times})
                    print(f"{fmt:>10} H={H:3d} B={B:2d} {ctx:6d}: "
                          + "  ".join(f"{m}: {t['us']:.1f} ({t['splits']})" for m, t in times.items()), flush=True)
    meta = {
        **run_meta(),
        "default_min_split": default_config(build("bf16", 1, 64)[0], 16).min_split,
    }
    lines = [
        "# The Triton decode kernel by shortest split (min_split)",
        "",
        f"Card: {meta['card']}. Date: {meta['date']}. torch {meta['torch']}. Command: `{meta['command']}`. "
        f"kv_lora_rank 512, rope 64, page 64; `default_config` (min_split {meta['default_min_split']}) but for "
        "min_split. Microseconds; in brackets the splits per sequence; * the fastest.",
        "",
        "| format | H | B | context | " + " | ".join(f"{m} tokens" for m in mins) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(mins),
    ]
    for r in rows:
        best = min(t["us"] for t in r["triton"].values())
        cells = [f"{t['us']:.1f} ({t['splits']}){'*' if t['us'] == best else ''}" for t in r["triton"].values()]
        lines.append(f"| {r['format']} | {r['heads']} | {r['batch']} | {r['context']} | " + " | ".join(cells) + " |")
    write_results(args.out, "decode_kernel_min_split", meta, rows, lines)


if __name__ == "__main__":
    main()
