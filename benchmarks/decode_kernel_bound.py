"""What a loose max_seq_len costs the decode kernels: the engine's bound against the sequences' real length.

    PYTHONPATH=src python benchmarks/decode_kernel_bound.py [--batches 1,16,64] [--contexts 1024,4096]
        [--bounds 32768,131072] [--heads 16,128] [--formats bf16,int4/int4] [--out benchmarks/results]

The engine captures one CUDA graph per batch size, so it passes the model's max_model_len as `max_seq_len`
(the kernels size their splits from it without a host sync) whatever the sequences' real lengths are. This
times `mla_decode` (the kernel "auto" picks; bf16 is the Triton kernel) with max_seq_len = the real context
and = each --bounds value, on full caches of B sequences of `context` tokens. Timing as decode_kernel.bench
(CUDA-graph replays, L2 flushed, median); every run is checked against the fp64 reference. Writes
decode_kernel_bound.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--bounds", default="32768,131072")
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--formats", default="bf16,int4/int4")
    ap.add_argument("--rep", type=float, default=10, help="timed replays per row: about this many ms")
    ap.add_argument("--name", default="decode_kernel_bound", help="results file stem")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()

    import torch
    from decode_kernel import SCALE, bench, build, check, ok, queries, require_cuda, run_meta, write_results

    require_cuda()

    from quantmla.kernels import mla_decode_cuda as mdc
    from quantmla.kernels.mla_decode import mla_decode

    bounds = [int(x) for x in args.bounds.split(",")]
    rows = []
    print(f"{'fmt':>10} {'H':>4} {'B':>3} {'context':>7} {'kernel':>7} {'exact us':>9} "
          + " ".join(f"{b:>9}" for b in bounds))  # fmt: skip
    for fmt in args.formats.split(","):
        os.environ[mdc.ENV] = "triton" if fmt == "bf16" else "auto"
        for H in map(int, args.heads.split(",")):
            for B in map(int, args.batches.split(",")):
                for ctx in map(int, args.contexts.split(",")):
                    cache, tables, lens, slots = build(fmt, B, ctx)
                    qn, qp = queries(B, H)
                    kernel = "triton" if fmt == "bf16" else mdc.decode_kernel_name(cache, H, qn.device, batch=B)
                    times = {}
                    for bound in [ctx] + bounds:
                        run = lambda b=bound: mla_decode(qn, qp, cache, tables, lens, slots, SCALE, max_seq_len=b)  # noqa: E731
                        err = check(cache, tables, lens, slots, qn, qp, *run())
                        if not ok(err):
                            sys.exit(f"{fmt} H={H} B={B} context={ctx} bound={bound}: error {err}")
                        times[str(bound)] = bench(run, args)
                    del cache
                    torch.cuda.empty_cache()
                    rows.append({"format": fmt, "heads": H, "batch": B, "context": ctx, "kernel": kernel, "us": times})
                    print(f"{fmt:>10} {H:4d} {B:3d} {ctx:7d} {kernel:>7} {times[str(ctx)]:9.1f} "
                          + " ".join(f"{times[str(b)]:9.1f}" for b in bounds), flush=True)  # fmt: skip
    meta = run_meta()
    lines = [
        "# Decode kernels with a loose max_seq_len",
        "",
        f"Card: {meta['card']}. Date: {meta['date']}. torch {meta['torch']}. Command: `{meta['command']}`. "
        "kv_lora_rank 512, rope 64, page 64, sink 4 + recent 128 BF16 rows (quantized formats). Microseconds of "
        "`mla_decode` with max_seq_len = the real context (exact) and = each bound; in brackets the time against "
        "exact. kernel = the one that ran (bf16: Triton).",
        "",
        "| format | H | B | context | kernel | exact | " + " | ".join(f"bound {b // 1024}K" for b in bounds) + " |",
        "|---|---:|---:|---:|---|---:|" + "---:|" * len(bounds),
    ]
    for r in rows:
        t0 = r["us"][str(r["context"])]
        cells = [f"{r['us'][str(b)]:.1f} ({r['us'][str(b)] / t0:.2f}x)" for b in bounds]
        lines.append(f"| {r['format']} | {r['heads']} | {r['batch']} | {r['context']} | {r['kernel']} | {t0:.1f} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    write_results(args.out, args.name, meta, rows, lines)


if __name__ == "__main__":
    main()
