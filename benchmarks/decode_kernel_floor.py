"""Where the decode kernels' time goes at batch 1 and short contexts: the fixed cost of a launch.

    PYTHONPATH=src python benchmarks/decode_kernel_floor.py [--contexts 0,64,1024,4096] [--bound 131072]
        [--cases bf16:16:triton,int4/int4:16:cuda,int4/int4:16:cuda:nowin,...] [--out benchmarks/results]

At B = 1 and 1-4 K tokens the INT4 kernels take ~30 us whatever the length (CUDA kernel at 16 heads, many-heads
kernel at 128), the BF16 Triton kernel ~14-21 us (decode_kernel_bound_own.md). This times each case (FORMAT:
HEADS:KERNEL, the kernel forced through $QUANTMLA_DECODE_KERNEL) at each context, with max_seq_len = the context
and = --bound (an engine's), with the BF16 window (sink 4 + recent 128) or without it (":nowin": every token
quantized; the CUDA kernel walks the protected rows in one CTA of plain loads, the suspect at B = 1: fp8/bf16
ran 34.7 us at B = 1 / 4 K where fp8:0/fp8:0, which has no window, ran 26.6, decode_kernel_cuda_fp8.md), or with
them over N CTAs (":pN", the CUDA kernel's prot_splits), in three states of L2:
  - cold: L2 flushed before each replay (decode_kernel.bench, as every other benchmark here);
  - code: flushed, then a twin launch (the same kernel and shapes on another cache and queries) runs untimed
    just before: the kernel's instructions are in L2 (and its constants), this call's data is not;
  - warm: no flush, the previous replay's code and data are in L2.
cold - code is what fetching the kernel's code costs; code - warm what fetching its data costs. Context 0 is a
64-token cache with every sequence length 0: the launch, the prologue and the combine, no tile. Every run is
checked against the fp64 reference (context 0: lse is -inf). Writes decode_kernel_floor.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

CASES = ("bf16:16:triton,int4/int4:16:cuda,int4/int4:16:cuda:nowin,int4/int4:16:cuda:p3,int4/int4:16:triton,"
         "bf16:128:triton,int4/int4:128:heads,int4/int4:128:heads:nowin")
STATES = ("cold", "code", "warm")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="0,64,1024,4096")
    ap.add_argument("--bound", type=int, default=131072, help="the loose max_seq_len (an engine's max_model_len)")
    ap.add_argument("--cases", default=CASES, help="FORMAT:HEADS:KERNEL[:nowin][:pN], comma-separated")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rep", type=float, default=10, help="timed replays per row: about this many ms")
    ap.add_argument("--name", default="decode_kernel_floor", help="results file stem")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()

    import torch
    from decode_kernel import SCALE, bench, build, check, ok, queries, require_cuda, run_meta, write_results

    require_cuda()

    from quantmla.kernels import mla_decode_cuda as mdc
    from quantmla.kernels.mla_decode import mla_decode
    from quantmla.kernels.mla_decode_cuda import mla_decode_cuda

    B, rows = args.batch, []
    print(f"{'case':>22} {'ctx':>5} {'bound':>6} " + " ".join(f"{s:>7}" for s in STATES))
    for case in args.cases.split(","):
        fields = case.split(":")  # a format may hold ":" itself (fp8:0/fp8:0): the fields are read from the end
        flags = []
        while fields[-1] == "nowin" or re.fullmatch(r"p\d+", fields[-1]):
            flags.append(fields.pop())
        fmt, H, kernel = ":".join(fields[:-2]), int(fields[-2]), fields[-1]
        window = "nowin" not in flags
        prot = next((int(f[1:]) for f in flags if f[0] == "p"), None)
        if prot is not None and kernel != "cuda":
            sys.exit(f"{case}: pN (protected rows over N CTAs) is a flag of the cuda kernel")
        decode = functools.partial(mla_decode_cuda, prot_splits=prot) if prot else mla_decode
        os.environ[mdc.ENV] = kernel
        for ctx in map(int, args.contexts.split(",")):
            cache, tables, lens, slots = build(fmt, B, max(ctx, 64), window=window)
            twin = build(fmt, B, max(ctx, 64), seed=1, window=window)
            if ctx == 0:
                lens.zero_()
                twin[2].zero_()
            qn, qp = queries(B, H)
            tq = queries(B, H, seed=2)
            for bound in (max(ctx, 1), args.bound):
                def run(b=bound):
                    return decode(qn, qp, cache, tables, lens, slots, SCALE, max_seq_len=b)

                def twin_run(b=bound):
                    return decode(*tq, twin[0], twin[1], twin[2], twin[3], SCALE, max_seq_len=b)

                out, lse = run()
                if ctx == 0:
                    if not bool(torch.isneginf(lse).all()):
                        sys.exit(f"{case} context 0 bound {bound}: lse is not -inf for empty sequences")
                elif not ok(err := check(cache, tables, lens, slots, qn, qp, out, lse)):
                    sys.exit(f"{case} context {ctx} bound {bound}: error {err}")
                us = {"cold": bench(run, args), "code": bench(run, args, before=twin_run),
                      "warm": bench(run, args, flush_l2=False)}
                rows.append({"format": fmt, "heads": H, "kernel": kernel + (f" p{prot}" if prot else ""),
                             "window": window, "batch": B, "context": ctx, "bound": bound, "us": us})
                print(f"{case:>22} {ctx:5d} {bound:6d} " + " ".join(f"{us[s]:7.1f}" for s in STATES), flush=True)
            del cache, twin
            torch.cuda.empty_cache()
    meta = run_meta()
    lines = [
        "# Decode kernels' fixed cost at short contexts",
        "",
        f"Card: {meta['card']}. Date: {meta['date']}. torch {meta['torch']}. Command: `{meta['command']}`. "
        f"B = {B}, kv_lora_rank 512, rope 64, page 64, sink 4 + recent 128 BF16 rows (quantized formats). "
        "Microseconds of `mla_decode` (CUDA-graph replays, median) with L2 cold (flushed), code (flushed, then "
        "a twin launch on other data: the kernel's code in L2) and warm (not flushed). Context 0: every length 0. "
        "window: the BF16 sink + recent rows (no: every token quantized).",
        "",
        "| format | H | kernel | window | context | max_seq_len | cold | code | warm | cold - code | code - warm |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        u = r["us"]
        lines.append(f"| {r['format']} | {r['heads']} | {r['kernel']} | {'yes' if r['window'] else 'no'} | "
                     f"{r['context']} | {r['bound']} | "
                     f"{u['cold']:.1f} | {u['code']:.1f} | {u['warm']:.1f} | {u['cold'] - u['code']:.1f} | "
                     f"{u['code'] - u['warm']:.1f} |")  # fmt: skip
    write_results(args.out, args.name, meta, rows, lines)


if __name__ == "__main__":
    main()
