"""How long a split of the CUDA decode kernel should be: the kernel timed at several body-split counts.

    PYTHONPATH=src python benchmarks/decode_kernel_splits.py [--batches 1,4,16] [--contexts 4096,16384,65536]
        [--split-tokens 128,256,512,1024] [--format int4/int4] [--heads 16] [--out benchmarks/results]

For each shape: the BF16 Triton kernel, then the CUDA kernel with the body cut into splits of about each
--split-tokens length (num_splits = ceil(context / tokens), capped by one wave of blocks as `body_splits`
caps it) and with `body_splits`' own choice ("default"). Timing as decode_kernel.bench (CUDA-graph replays,
L2 flushed, median), each run checked against the fp64 reference. A split costs a prologue (the q fragments)
and a partial output to combine; more splits fill more SMs when the batch is small. Writes
decode_kernel_splits.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--contexts", default="4096,16384,65536")
    ap.add_argument("--split-tokens", default="128,256,512,1024")
    ap.add_argument("--format", default="int4/int4")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--rep", type=float, default=10, help="timed replays per row: about this many ms")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()

    import torch
    from decode_kernel import SCALE, bench, bf16_us, build, check, ok, queries, require_cuda

    require_cuda()

    from quantmla.kernels import mla_decode_cuda as mdc
    from quantmla.kernels.mla_decode import mla_decode

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lengths = [int(x) for x in args.split_tokens.split(",")]
    rows = []
    print(f"{'B':>3} {'context':>7} {'bf16 us':>8} " + " ".join(f"{n:>7}" for n in lengths) + "  default (splits)")
    for B in map(int, args.batches.split(",")):
        for ctx in map(int, args.contexts.split(",")):
            qn, qp = queries(B, args.heads)
            t_bf16 = bf16_us(qn, qp, B, ctx, args)
            cache, tables, lens, slots = build(args.format, B, ctx)
            os.environ[mdc.ENV] = "cuda"
            wave = max(1, (2 * sms) // (B * -(-args.heads // 16)))  # one wave of blocks, as body_splits caps it
            default = mdc.body_splits(B, args.heads, ctx, sms, protected=cache.window > 0)
            times = {}
            for name, n in [(str(t), min(wave, -(-ctx // t))) for t in lengths] + [("default", default)]:
                run = lambda n=n: mla_decode(qn, qp, cache, tables, lens, slots, SCALE, max_seq_len=ctx, num_splits=n)  # noqa: E731
                err = check(cache, tables, lens, slots, qn, qp, *run())
                if not ok(err):
                    sys.exit(f"B={B} context={ctx} splits={n}: error {err}")
                times[name] = {"splits": n, "us": bench(run, args)}
            del cache
            torch.cuda.empty_cache()
            rows.append({"batch": B, "context": ctx, "heads": args.heads, "format": args.format, "bf16_us": t_bf16,
                         "cuda": times})  # fmt: skip
            d = times["default"]
            print(f"{B:3d} {ctx:7d} {t_bf16:8.1f} " + " ".join(f"{times[str(n)]['us']:7.1f}" for n in lengths)
                  + f"  {d['us']:.1f} ({d['splits']})", flush=True)  # fmt: skip
    meta = {
        "card": torch.cuda.get_device_name(0),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python"] + sys.argv),
        "torch": torch.__version__,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode_kernel_splits.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    lines = [
        "# The CUDA decode kernel by split length",
        "",
        f"Card: {meta['card']}. Date: {meta['date']}. torch {meta['torch']}. Command: `{meta['command']}`. "
        f"{args.format}, {args.heads} heads, kv_lora_rank 512, rope 64, page 64. Microseconds; in brackets the body "
        "splits per sequence; default = `body_splits`.",
        "",
        "| B | context | bf16 | " + " | ".join(f"{n} tokens" for n in lengths) + " | default |",
        "|---:|---:|---:|" + "---:|" * (len(lengths) + 1),
    ]
    for r in rows:
        cells = [f"{r['cuda'][str(n)]['us']:.1f} ({r['cuda'][str(n)]['splits']})" for n in lengths]
        d = r["cuda"]["default"]
        lines.append(f"| {r['batch']} | {r['context']} | {r['bf16_us']:.1f} | " + " | ".join(cells)
                     + f" | {d['us']:.1f} ({d['splits']}) |")  # fmt: skip
    with open(os.path.join(args.out, "decode_kernel_splits.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
