"""Scheduling variants of the many-heads decode kernel against each other, in one process.

    PYTHONPATH=src python benchmarks/decode_kernel_heads_ab.py [--variant NAME=KEY:VALUE,KEY:VALUE ...]
        [--batches 1,16,64] [--contexts 16384,65536] [--formats int4/int4] [--heads 128] [--out benchmarks/results]

For each shape it fills one cache (decode_kernel.build), times the BF16 Triton kernel on a BF16 cache of the
same shape, then `mla_decode_many_heads` with its defaults ("default") and with each --variant (keys of
`mla_decode_many_heads.VARIANT`, e.g. PF_L1:1, or min_split:256 for the split rule), each checked against the
fp64 reference and timed as decode_kernel.bench does (CUDA-graph replays, L2 flushed, median). Writes
decode_kernel_heads_ab.{json,md} (--name changes the stem). Needs an sm_90 GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, spec = text.partition("=")
    return name, {k: int(v) for k, v in (kv.split(":") for kv in spec.split(",") if kv)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", default=[], help="NAME=KEY:VALUE,...")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="16384,65536")
    ap.add_argument("--formats", default="int4/int4")
    ap.add_argument("--heads", default="128")
    ap.add_argument("--rep", type=float, default=10, help="ms of replays per timing")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--name", default="decode_kernel_heads_ab")
    args = ap.parse_args()

    import torch
    from decode_kernel import SCALE, bench, bf16_us, build, check, ok, queries, require_cuda

    require_cuda()

    from quantmla.kernels import mla_decode_many_heads as mh

    variants = [("default", {})] + [parse_variant(v) for v in args.variant]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for fmt in args.formats.split(","):
        for H in (int(h) for h in args.heads.split(",")):
            for B in (int(b) for b in args.batches.split(",")):
                for L in (int(c) for c in args.contexts.split(",")):
                    qn, qp = queries(B, H)
                    base = bf16_us(qn, qp, B, L, args)
                    cache, tables, seq_lens, slots = build(fmt, B, L)
                    for name, var in variants:
                        fn = lambda: mh.mla_decode_many_heads(qn, qp, cache, tables, seq_lens, slots, SCALE,  # noqa: E731
                                                              max_seq_len=L, num_sms=sms, variant=var)
                        out, lse = fn()
                        err = check(cache, tables, seq_lens, slots, qn, qp, out, lse)
                        t = bench(fn, args) if ok(err) else float("nan")
                        rows.append(dict(format=fmt, heads=H, batch=B, context=L, variant=name, us=t, bf16_us=base,
                                         x=base / t, rms_err=err[0]))
                        print(f"{fmt} H={H} B={B} L={L} {name}: {t:.1f} us, {base / t:.3f}x bf16, err {err[0]:.1e}",
                              flush=True)
                    del cache
                    torch.cuda.empty_cache()
    meta = dict(card=torch.cuda.get_device_name(), date=datetime.datetime.now().isoformat(timespec="seconds"),
                command="python " + " ".join(sys.argv), variants=dict(variants), torch=torch.__version__)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    lines = [f"# Many-heads kernel variants ({meta['card']}, {meta['date']})", "",
             f"Command: `{meta['command']}`. Variants: " + "; ".join(f"{n} = {v or 'the defaults'}" for n, v in variants)
             + ". x = speedup over the Triton bf16 kernel on a bf16 cache of the same shape.", "",
             "| format | H | B | context | variant | us | x bf16 | rms err |", "|---|---:|---:|---:|---|---:|---:|---:|"]
    lines += [f"| {r['format']} | {r['heads']} | {r['batch']} | {r['context']} | {r['variant']} | {r['us']:.1f} | "
              f"{r['x']:.3f} | {r['rms_err']:.1e} |" for r in rows]
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
