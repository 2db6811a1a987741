"""GPU benchmark of the absorbed-MLA decode kernel over the paged, packed cache.

    PYTHONPATH=src python benchmarks/decode_kernel.py [--out benchmarks/results] [--batches 1,16,64]
        [--contexts 4096,16384,65536] [--heads 16,128] [--formats bf16,int4/int4,...] [--no-tune]
        [--kernels triton,cuda,gluon,heads] [--name decode_kernel]

Grid: batch {1, 16, 64} x context {4K, 16K, 64K} x heads {16, 128}, kv_lora_rank 512, rope 64, page 64,
sink 4 + recent 128 BF16 tokens for the quantized formats. Formats: bf16 (the baseline kernel: same design,
bf16 body, no protected rows), int4/int4, int2-content/int4-rope, fp8-content/bf16-rope (FlashMLA's 656 B
layout), fp8:0/fp8:0 (vLLM's 576 B FP8 cache: e4m3 with scale 1.0 on both paths and no BF16 window).

For every row: a correctness check of the kernel (first and last sequence) against the fp64 reference on
the dequantized cache, then the median GPU time of the call replayed as a CUDA graph (CUDA events, L2
flushed before each replay), the bytes the call must read (cache body + protected rows + queries + block
table; the split partials are listed apart), achieved GB/s against the card's device-to-device copy
bandwidth measured here, TFLOP/s (2*H*L*(dc+dr) + 2*H*L*dc per sequence), the speedup over the bf16
kernel, and a plain-torch decode (bf16 matmuls + fp32 softmax) on the dequantized, contiguous cache.

--kernels: which decode kernels get rows: "triton" (quantmla.kernels.mla_decode's Triton kernel, with the
tuned or default launch config) and/or "cuda" (quantmla.kernels.mla_decode_cuda, integer and fp8 formats where it
is supported) and/or "gluon" (quantmla.kernels.mla_decode_gluon, the
Hopper kernel for int4/int4 and few heads, where it is supported) and/or "heads"
(quantmla.kernels.mla_decode_many_heads, the Hopper kernel for 64 heads per CTA); the `kernel` column names it, `auto` says which one `mla_decode` itself would pick
(`decode_kernel_name`). The speedup is always over the Triton bf16 kernel. --name: the results' file stem.

Before the grid, each (format, heads) picks its launch config from a few candidates on B=16, L=64K (the
candidates are compiled in parallel processes first, to keep the run short). Writes decode_kernel.json and
decode_kernel.md to --out and prints the table.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import math
import multiprocessing as mp
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from quantmla.cache.paged import PagedMLACache  # noqa: E402
from quantmla.config import CacheConfig  # noqa: E402
from quantmla.kernels import mla_decode_cuda as mdc  # noqa: E402
from quantmla.kernels import mla_decode_gluon as mdg  # noqa: E402
from quantmla.kernels import mla_decode_many_heads as mdh  # noqa: E402
from quantmla.kernels.mla_decode import (  # noqa: E402
    KernelConfig,
    default_config,
    mla_decode,
    mla_decode_reference,
    num_splits_for,
)

DC, DR, PAGE, SCALE = 512, 64, 64, 1 / math.sqrt(192)
FORMATS = {
    "bf16": ("bf16", "bf16"),
    "int4/int4": ("int4", "int4"),
    "int2/int4": ("int2", "int4"),
    "fp8/bf16": ("fp8", "bf16"),
    "fp8:0/fp8:0": ("fp8:0", "fp8:0", 0, 0),  # vLLM's 576 B FP8 cache: scale 1.0, no BF16 window
}
K = KernelConfig
# Launch candidates per head class: (block_h, block_n, num_warps, num_stages, ...).
CANDIDATES = {
    "few": [
        K(16, 64, 4, 2),
        K(16, 64, 4, 1),  # one stage: what default_config gives token-axis content (shared memory)
        K(16, 64, 4, 2, maxnreg=168),
        K(16, 64, 8, 2, values_t=True),
        K(16, 32, 4, 2, maxnreg=128),
        K(16, 32, 4, 3),
        K(16, 32, 4, 3, maxnreg=128),
        K(16, 32, 4, 4, values_t=True),
        K(16, 32, 8, 3),
    ],
    "many": [
        K(64, 64, 8, 2),
        K(64, 64, 8, 1),  # likewise for any token-axis path at many heads
        K(64, 32, 8, 3),
        K(32, 64, 8, 2),
        K(16, 64, 4, 2),
    ],
}


def head_class(h: int) -> str:
    return "few" if h <= 16 else "many"


# --- building caches ---------------------------------------------------------------------------------------


def build(fmt: str, batch: int, ctx: int, seed: int = 0, window: bool = True) -> tuple:
    """A full cache of `batch` sequences of `ctx` tokens: random latents quantized by the real writer's
    quantize(), shuffled block tables, protected rows filled (window=False: no BF16 rows, every token
    quantized). Returns (cache, tables, seq_lens, slots)."""
    torch.manual_seed(seed)
    cfg = CacheConfig(*FORMATS.get(fmt, fmt.split("/")))  # a named format or any CONTENT/ROPE spec
    if not window:
        cfg = replace(cfg, sink=0, recent=0)
    per_seq = -(-ctx // PAGE)
    nb = batch * per_seq
    cache = PagedMLACache.allocate(cfg, DC, DR, nb, batch, block_size=PAGE, device="cuda")
    rows = nb * PAGE
    step = 1 << 19
    for r0 in range(0, rows, step):
        idx = torch.arange(r0, min(rows, r0 + step), device="cuda")
        for path, std in ((cache.content, 2.0), (cache.rope, 1.0)):  # token-axis: scales per block of rows
            blocks = idx[:: path.block] // path.block if path.block > 1 else None
            path.write(idx, (torch.randn(len(idx), path.dim, device="cuda") * std).bfloat16(), scale_rows=blocks)
    cache.protected_content.normal_().mul_(2)
    cache.protected_rope.normal_()
    tables = torch.randperm(nb, device="cuda").to(torch.int32).view(batch, per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    slots = torch.arange(batch, dtype=torch.int32, device="cuda")
    return cache, tables, seq_lens, slots


def queries(batch: int, heads: int, seed: int = 1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qn = torch.randn(batch, heads, DC, device="cuda", generator=g).bfloat16()
    qp = torch.randn(batch, heads, DR, device="cuda", generator=g).bfloat16()
    return qn, qp


def check(cache, tables, seq_lens, slots, qn, qp, out, lse) -> tuple[float, float]:
    """Errors of the first and last sequence against the fp64 reference: the output's relative RMS error
    and the log-sum-exp's max absolute error. (bf16 operands give ~1e-3 and ~1e-2.)"""
    idx = torch.tensor(sorted({0, len(seq_lens) - 1}), device="cuda")
    ro, rl = mla_decode_reference(qn[idx], qp[idx], cache, tables[idx], seq_lens[idx], slots[idx], SCALE)
    rms = ((out[idx].double() - ro).norm() / ro.norm()).item()
    return rms, (lse[idx].double() - rl).abs().max().item()


def ok(err) -> bool:
    return err[0] < 1e-2 and err[1] < 5e-2


def cache_bytes(cache: PagedMLACache, ctx: int, batch: int) -> int:
    n_q = max(ctx - cache.window, 0)
    return batch * (n_q * cache.body_bytes_per_token + min(ctx, cache.window) * (DC + DR) * 2)


# --- compile the candidates in parallel ----------------------------------------------------------------------


def _compile_one(job):
    fmt, heads, cfg = job
    try:
        cache, tables, seq_lens, slots = build(fmt, 2, 700)
        qn, qp = queries(2, heads)
        out, lse = mla_decode(qn, qp, cache, tables, seq_lens, slots, SCALE, config=KernelConfig(**cfg), num_splits=2)
        torch.cuda.synchronize()
        return job, check(cache, tables, seq_lens, slots, qn, qp, out, lse), None
    except Exception as e:  # a candidate that does not compile or run is dropped, with its reason
        return job, None, f"{type(e).__name__}: {str(e)[:300]}"


def precompile(jobs, workers):
    """Compile every (format, heads, config) in worker processes; Triton's file cache keeps the binaries."""
    t0 = time.time()
    res = {}
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for job, err, fail in ex.map(_compile_one, jobs):
            res[(job[0], job[1], json.dumps(job[2], sort_keys=True))] = (err, fail)
    print(f"compiled {len(jobs)} variants in {time.time() - t0:.0f} s", flush=True)
    return res


# --- timing ------------------------------------------------------------------------------------------------


def bench(fn, args, flush_l2: bool = True, before=None) -> float:
    """Median GPU time (us) of fn, replayed as a CUDA graph (no launch overhead in the timing) with L2
    flushed before every replay (a decode step reads each layer's cache once: nothing stays in L2).
    flush_l2=False keeps L2 as the previous replay left it; `before`, a callable, runs (as a CUDA graph of its
    own) after the flush and before each timed replay, untimed (decode_kernel_floor: a twin launch that brings
    the kernel's code into L2 but not this call's data)."""
    graphs = []
    for f in (fn, before):
        if f is None:
            continue
        f()
        torch.cuda.synchronize()
        graphs.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(graphs[-1]):
            f()
    graph, warm = graphs[0], (graphs[1] if before is not None else None)
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for _ in range(2):
        graph.replay()
    ev[0].record()
    for _ in range(3):
        graph.replay()
    ev[1].record()
    torch.cuda.synchronize()
    n = int(min(max(args.rep / max(ev[0].elapsed_time(ev[1]) / 3, 1e-3), 5), 200))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        if flush_l2:
            flush.zero_()  # the GPU is busy with this while the CPU queues the replay: no idle gap is timed
        if warm is not None:
            warm.replay()
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(starts, ends))
    del graph, warm, graphs
    return times[n // 2] * 1e3


def bf16_us(qn, qp, batch: int, ctx: int, args) -> float:
    """Median time (us, as `bench`) of the BF16 Triton kernel over a full BF16 cache of this shape: the baseline
    the other scripts' speed-ups are taken against. The cache is freed again."""
    cache, tables, seq_lens, slots = build("bf16", batch, ctx)
    os.environ[mdc.ENV] = "triton"
    t = bench(lambda: mla_decode(qn, qp, cache, tables, seq_lens, slots, SCALE, max_seq_len=ctx), args)
    del cache
    torch.cuda.empty_cache()
    return t


def write_results(out_dir: str, name: str, meta: dict, rows: list, lines: list[str]) -> None:
    """Write {name}.json (meta and rows) and {name}.md (lines) to out_dir, and print the markdown."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def run_meta() -> dict:
    """Card, UTC date, command line and torch version: the header of a result file."""
    return {
        "card": torch.cuda.get_device_name(0),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python"] + sys.argv),
        "torch": torch.__version__,
    }


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, timed by triton's do_bench (a graph would turn it into a copy-engine
    memcpy node, slower than the copy kernel a plain launch runs). GB/s of bytes read + written."""
    from triton.testing import do_bench

    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = do_bench(lambda: dst.copy_(src), warmup=5, rep=50, return_mode="median") * 1e-3
    return 2 * n / t / 1e9


def torch_decode(qn, qp, c, k):
    """Plain torch on a dequantized contiguous cache c [B, L, dc], k [B, L, dr] (bf16)."""
    s = (torch.matmul(qn, c.transpose(1, 2)) + torch.matmul(qp, k.transpose(1, 2))).float() * SCALE
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).to(c.dtype)
    return torch.matmul(p, c), lse


def dequantized(cache, tables, ctx):
    """Contiguous bf16 copy of the whole cache in position order, for the torch baseline."""
    B = tables.shape[0]
    rows = (tables.long()[:, :, None] * PAGE + torch.arange(PAGE, device="cuda")).view(B, -1)[:, :ctx]
    c = cache.content.read(rows.reshape(-1), torch.bfloat16).view(B, ctx, DC)
    k = cache.rope.read(rows.reshape(-1), torch.bfloat16).view(B, ctx, DR)
    return c, k


def require_cuda() -> None:
    """Exit with one line, naming the script run, where there is no CUDA GPU (these scripts time GPU kernels)."""
    if not torch.cuda.is_available():
        sys.exit(f"{os.path.basename(sys.argv[0])} needs a CUDA GPU (torch.cuda.is_available() is False)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="4096,16384,65536")
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help="comma-separated names of FORMATS or any CONTENT/ROPE pair, e.g. int4:128/int8")
    ap.add_argument("--rep", type=float, default=20, help="timed replays per row: about this many ms")
    ap.add_argument("--no-tune", action="store_true", help="use default_config instead of the candidates")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--kernels", default="triton", help="comma list of triton, cuda, gluon, heads")
    ap.add_argument("--name", default="decode_kernel", help="results file stem")
    args = ap.parse_args()
    require_cuda()
    kernels = args.kernels.split(",")
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    heads = [int(x) for x in args.heads.split(",")]
    fmts = args.formats.split(",")
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    props = torch.cuda.get_device_properties(0)
    import triton

    meta = {
        "card": props.name,
        "sms": props.multi_processor_count,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python"] + sys.argv),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dims": {"kv_lora_rank": DC, "rope": DR, "page": PAGE, "sink": 4, "recent": 128},
        "kernels": kernels,
        "name": args.name,
    }
    try:
        meta["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    bw = copy_bandwidth()
    meta["copy_GBps"] = bw
    print(f"{props.name}: device-to-device copy {bw:.0f} GB/s (read + write)", flush=True)

    # 1. Pick a launch config per (format, head class): compile all candidates in parallel, check, time.
    chosen, tuning = {}, []
    classes = sorted({head_class(h) for h in heads})
    rep_heads = {c: max(h for h in heads if head_class(h) == c) for c in classes}
    if args.no_tune:
        for f in fmts:
            for c in classes:
                chosen[(f, c)] = None
    else:
        jobs = [(f, rep_heads[c], asdict(cfg)) for f in fmts for c in classes for cfg in CANDIDATES[c]]
        compiled = precompile(jobs, args.workers)
        for f in fmts:
            cache, tables, seq_lens, slots = build(f, 16, 65536)
            for c in classes:
                h = rep_heads[c]
                qn, qp = queries(16, h)
                best = None
                for cfg in CANDIDATES[c]:
                    err, fail = compiled[(f, h, json.dumps(asdict(cfg), sort_keys=True))]
                    if fail or err is None or not ok(err):
                        tuning.append({"format": f, "heads": h, "config": asdict(cfg), "error": fail or err})
                        continue
                    for cps in (1, 2, 4):
                        cand = replace(cfg, ctas_per_sm=cps)
                        t = bench(lambda: mla_decode(
                            qn, qp, cache, tables, seq_lens, slots, SCALE, max_seq_len=65536, config=cand
                        ), args)  # fmt: skip
                        tuning.append({"format": f, "heads": h, "config": asdict(cand), "us": t})
                        if best is None or t < best[0]:
                            best = (t, cand)
                chosen[(f, c)] = best[1] if best else None
                took = f"{best[0]:.1f} us" if best else "(none passed: default_config)"
                print(f"tuned {f:9s} H={h:3d}: {best[1] if best else ''} {took}", flush=True)
            cache = tables = None  # free the pools before the next format
            torch.cuda.empty_cache()
    meta["tuning"] = tuning
    meta["chosen"] = {f"{f}|{c}": (asdict(v) if v else None) for (f, c), v in chosen.items()}

    # 2. The grid.
    rows = []
    for B in batches:
        for L in contexts:
            free = torch.cuda.mem_get_info()[0]
            need = B * L * (DC + DR) * 2 * 3 + B * max(heads) * L * 4 * 3  # bf16 pool + torch copy + scores
            if need > 0.8 * free:
                print(f"skip B={B} L={L}: needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free", flush=True)
                rows.append({"batch": B, "context": L, "skipped": f"needs ~{need / 2**30:.1f} GiB"})
                continue
            base = {}
            for f in fmts:
                cache, tables, seq_lens, slots = build(f, B, L)
                cb = cache_bytes(cache, L, B)
                # bf16 is the baseline: always the Triton kernel
                for H, kern in [(h, k) for h in heads for k in (["triton"] if f == "bf16" else kernels)]:
                    qn, qp = queries(B, H)
                    auto = mdc.decode_kernel_name(cache, H, qn.device, batch=B)
                    unsupported = {"gluon": mdg.unsupported_reason, "cuda": mdc.unsupported_reason,
                                   "heads": mdh.unsupported_reason}.get(kern)
                    why = unsupported and unsupported(cache, H, qn.device)
                    if why:
                        print(f"B={B:3d} L={L:6d} H={H:3d} {f:9s} {kern}: not run ({why})", flush=True)
                        continue
                    if kern == "gluon":
                        cfg = None
                        splits = mdg.default_splits(B, L, props.multi_processor_count)
                        fn = lambda: mdg.mla_decode_gluon(qn, qp, cache, tables, seq_lens, slots, SCALE, max_seq_len=L,
                                                          num_sms=props.multi_processor_count)  # fmt: skip
                    elif kern == "heads":
                        cfg = None
                        splits = mdh.default_splits(B, H, L, props.multi_processor_count, sink=cache.sink,
                                                    recent=cache.recent)
                        fn = lambda: mdh.mla_decode_many_heads(qn, qp, cache, tables, seq_lens, slots, SCALE,
                                                               max_seq_len=L, num_sms=props.multi_processor_count)
                    elif kern == "cuda":
                        cfg = None
                        splits = mdc.body_splits(B, H, L, props.multi_processor_count, protected=cache.window > 0) + (1 if cache.window else 0)
                        fn = lambda: mdc.mla_decode_cuda(qn, qp, cache, tables, seq_lens, slots, SCALE, max_seq_len=L,
                                                         num_sms=props.multi_processor_count)
                    else:
                        cfg = chosen.get((f, head_class(H))) or default_config(cache, H)
                        splits = num_splits_for(B, H, L, cfg, props.multi_processor_count)
                        fn = lambda: mla_decode(qn, qp, cache, tables, seq_lens, slots, SCALE, max_seq_len=L, config=cfg)
                    out, lse = fn()
                    err = check(cache, tables, seq_lens, slots, qn, qp, out, lse)
                    t = bench(fn, args) if ok(err) else float("nan")
                    moved = cb + B * H * (DC + DR) * 2 + tables.numel() * 4 + B * H * DC * 4
                    flops = 2 * B * H * L * (DC + DR) + 2 * B * H * L * DC
                    row = {
                        "batch": B, "context": L, "heads": H, "format": f, "kernel": kern, "auto": auto, "us": t,
                        "rms_err": err[0], "lse_err": err[1],
                        "cache_bytes": cb, "bytes": moved, "GBps": moved / (t * 1e-6) / 1e9,
                        "pct_copy_bw": 100 * moved / (t * 1e-6) / 1e9 / bw, "TFLOPs": flops / (t * 1e-6) / 1e12,
                        "splits": splits, "partial_bytes": 2 * B * splits * H * (DC + 1) * 4 if splits > 1 else 0,
                        "config": asdict(cfg) if cfg else None,
                    }  # fmt: skip
                    if f == "bf16" and kern == "triton":
                        base[H] = t
                        c, k = dequantized(cache, tables, L)
                        to, tl_ = torch_decode(qn, qp, c, k)
                        row["torch_rel_err"] = check(cache, tables, seq_lens, slots, qn, qp, to, tl_)
                        row["torch_us"] = bench(lambda: torch_decode(qn, qp, c, k), args)
                        del c, k
                    row["speedup_vs_bf16"] = base.get(H, float("nan")) / t
                    rows.append(row)
                    print(
                        f"B={B:3d} L={L:6d} H={H:3d} {f:9s} {kern:6s} {t:9.1f} us {row['GBps']:7.0f} GB/s "
                        f"({row['pct_copy_bw']:5.1f} %) {row['TFLOPs']:6.1f} TFLOP/s x{row['speedup_vs_bf16']:.2f} "
                        f"err {err[0]:.1e}/{err[1]:.1e}"
                        + (f"  torch {row['torch_us']:.1f} us" if "torch_us" in row else ""),
                        flush=True,
                    )
                cache = tables = None
                torch.cuda.empty_cache()
            save(args.out, meta, rows, t_start)  # after every shape: a cut-short run still leaves results
    print(save(args.out, meta, rows, t_start))


def save(out_dir, meta, rows, t_start) -> str:
    meta["seconds"] = round(time.time() - t_start, 1)
    name = meta.get("name", "decode_kernel")
    with open(os.path.join(out_dir, f"{name}.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    md = table(meta, rows)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as fh:
        fh.write(md)
    return md


def table(meta, rows) -> str:
    lines = [
        "# MLA decode kernel on the paged cache",
        "",
        f"Card: {meta['card']} ({meta['sms']} SMs); measured device-to-device copy {meta['copy_GBps']:.0f} GB/s "
        f"(read + write). Date: {meta['date']}. torch {meta['torch']}, triton {meta['triton']}.",
        f"Command: `{meta['command']}`. kv_lora_rank 512, rope 64, page 64, sink 4 + recent 128 BF16 tokens "
        "(quantized formats, fp8:0/fp8:0 none). Median of CUDA-graph replays timed by CUDA events, L2 flushed. "
        "GB/s counts cache + queries + "
        "block table + output bytes; TFLOP/s counts 2*H*L*(dc+dr) + 2*H*L*dc per sequence; x = speedup over "
        "the Triton bf16 kernel; torch = plain-torch decode on the dequantized contiguous bf16 cache; kernel = the "
        "decode kernel timed (triton: quantmla.kernels.mla_decode, cuda: quantmla.kernels.mla_decode_cuda, "
        "gluon: quantmla.kernels.mla_decode_gluon, heads: quantmla.kernels.mla_decode_many_heads), auto = "
        "the one mla_decode picks by default (decode_kernel_name).",
        "",
        "| B | context | H | format | kernel | auto | us | GB/s | % copy BW | TFLOP/s | x bf16 | torch us | splits | rms err |",
        "|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['batch']} | {r['context']} | | skipped: {r['skipped']} | | | | | | | | | | |")
            continue
        torch_us = f"{r['torch_us']:.1f}" if "torch_us" in r else ""
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['heads']} | {r['format']} | {r.get('kernel', 'triton')} | "
            f"{r.get('auto', '')} | {r['us']:.1f} | {r['GBps']:.0f} | "
            f"{r['pct_copy_bw']:.1f} | {r['TFLOPs']:.1f} | {r['speedup_vs_bf16']:.2f} | {torch_us} | {r['splits']} | "
            f"{r['rms_err']:.1e} |"
        )
    lines += ["", "Targets:", ""] + targets(rows)
    lines += ["", "Launch configs chosen (per format, head class):", ""]
    for k, v in meta["chosen"].items():
        lines.append(f"- {k}: {v}")
    return "\n".join(lines) + "\n"


def targets(rows) -> list[str]:
    """The issue's three targets, read off the rows."""
    got = {(r["batch"], r["context"], r["heads"], r["format"], r.get("kernel", "triton")): r for r in rows if "us" in r}
    out = []
    r = got.get((16, 65536, 16, "bf16", "triton"))
    if r:
        pct = r["pct_copy_bw"]
        out.append(f"- bf16 kernel, 16 heads, 64K, batch 16: {pct:.1f} % of copy bandwidth (target >= 80 %)")
    for (B, L, H, f, k), r in sorted(got.items()):
        if f == "int4/int4" and H <= 16 and L >= 16384:
            x = r["speedup_vs_bf16"]
            out.append(f"- int4/int4 ({k}), 16 heads, B={B}, {L // 1024}K: {x:.2f}x the bf16 kernel (target >= 2.5x)")
    for (B, L, H, f, k), r in sorted(got.items()):
        if f == "int2/int4" and H <= 16 and L >= 16384 and (B, L, H, "int4/int4", k) in got:
            x = got[(B, L, H, "int4/int4", k)]["us"] / r["us"]
            out.append(f"- int2/int4 ({k}), 16 heads, B={B}, {L // 1024}K: {x:.2f}x the int4/int4 time (target >= 1.0x)")
    for (B, L, H, f, k), r in sorted(got.items()):
        if f == "int4/int4" and H > 16:
            x = r["speedup_vs_bf16"]
            out.append(f"- int4/int4 ({k}), {H} heads, B={B}, {L // 1024}K: {x:.2f}x the bf16 kernel (target >= 1.0x)")
    return out


if __name__ == "__main__":
    main()
