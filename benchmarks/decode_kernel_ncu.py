"""Nsight Compute profile of the decode kernel: where its time goes, for the issue's two target shapes.

    PYTHONPATH=src python benchmarks/decode_kernel_ncu.py [--out benchmarks/results]

    PYTHONPATH=src python benchmarks/decode_kernel_ncu.py --gluon [--out ...]   # the Gluon kernel's cases
    PYTHONPATH=src python benchmarks/decode_kernel_ncu.py --cuda [--out ...]    # the CUDA kernel's cases
    PYTHONPATH=src python benchmarks/decode_kernel_ncu.py --fp8 [--out ...]     # its fp8 variant's cases
    PYTHONPATH=src python benchmarks/decode_kernel_ncu.py --heads [--out ...]   # the many-heads kernel's

Runs itself under `ncu` (which must be on PATH) with one launch of the decode kernel per case — by default
bf16 and int4/int4 at 16 and 128 heads, batch 16, 64K context, the launch configs `default_config` picks
(Triton's `_mla_decode_kernel`); with --gluon the Triton bf16 and int4/int4 kernels and the Gluon one
(`_gluon_decode_kernel`, $QUANTMLA_DECODE_KERNEL=gluon) at 16 heads, batch 16, 16K and 64K; with --cuda the
Triton bf16 kernel and the CUDA one (`mla_decode_int`) at 16 heads, batch 16, 16K and 64K; with --fp8 the
Triton bf16 kernel and the CUDA kernel on int4/int4, fp8/bf16 and fp8:0/fp8:0 at 16 heads, batch 16, 64K; with
--heads the Triton bf16 and int4/int4 kernels and the many-heads one (`_many_heads_kernel`) on int4/int4 and
fp8:0/fp8:0 at 128 heads, batch 16, 64K — and
writes decode_kernel_ncu[_gluon|_cuda|_fp8|_heads].json (every metric ncu returned) and decode_kernel_ncu.md: time, DRAM and SM
throughput, issue-slot use, warps per scheduler, shared-memory pipe use, tensor pipe use and the stall
reasons (cycles per issued instruction), i.e. what the benchmark's times are made of.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

# (format, heads, kernel, batch, context)
CASES = [("bf16", 16, "triton", 16, 65536), ("int4/int4", 16, "triton", 16, 65536), ("bf16", 128, "triton", 16, 65536),
         ("int4/int4", 128, "triton", 16, 65536)]  # fmt: skip
GLUON_CASES = [("bf16", 16, "triton", 16, 16384), ("int4/int4", 16, "triton", 16, 16384),
               ("int4/int4", 16, "gluon", 16, 16384), ("int4/int4", 16, "triton", 16, 65536),
               ("int4/int4", 16, "gluon", 16, 65536)]  # fmt: skip
CUDA_CASES = [("bf16", 16, "triton", 16, 16384), ("int4/int4", 16, "cuda", 16, 16384),
              ("int4/int4", 16, "cuda", 16, 65536)]  # fmt: skip
FP8_CASES = [("bf16", 16, "triton", 16, 65536), ("int4/int4", 16, "cuda", 16, 65536),
             ("fp8/bf16", 16, "cuda", 16, 65536), ("fp8:0/fp8:0", 16, "cuda", 16, 65536)]  # fmt: skip
HEADS_CASES = [("bf16", 128, "triton", 16, 65536), ("int4/int4", 128, "triton", 16, 65536),
               ("int4/int4", 128, "heads", 16, 65536), ("fp8:0/fp8:0", 128, "heads", 16, 65536)]  # fmt: skip
CASE_SETS = {  # --NAME: (cases, results file stem); without one, CASES and "decode_kernel_ncu"
    "heads": (HEADS_CASES, "decode_kernel_ncu_heads"),
    "gluon": (GLUON_CASES, "decode_kernel_ncu_gluon"),
    "cuda": (CUDA_CASES, "decode_kernel_ncu_cuda"),
    "fp8": (FP8_CASES, "decode_kernel_ncu_fp8"),
}
NCU_PATHS = ["/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/ncu"]
SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "Occupancy", "SchedulerStats",
            "WarpStateStats", "LaunchStats"]  # fmt: skip
STALLS = r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
PIPES = r"regex:sm__pipe_.*(tensor|shared|fma|alu|lsu).*cycles_active\.avg\.pct_of_peak_sustained_active"
SHARED = r"regex:l1tex__data_pipe_lsu_wavefronts_mem_shared(_op_ld|_op_st)?\.sum(\.pct_of_peak_sustained_elapsed)?$"


TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}  # ncu picks the unit


def run_cases(cases):
    """The profiled process: one kernel launch per case (compiled beforehand by a first call outside ncu's
    filter would still be a launch, so each case launches exactly once)."""
    import torch
    from decode_kernel import SCALE, build, queries

    from quantmla.kernels.mla_decode import mla_decode

    for fmt, heads, kernel, batch, ctx in cases:
        os.environ["QUANTMLA_DECODE_KERNEL"] = kernel
        cache, tables, seq_lens, slots = build(fmt, batch, ctx)
        qn, qp = queries(batch, heads)
        mla_decode(qn, qp, cache, tables, seq_lens, slots, SCALE, max_seq_len=ctx)
        torch.cuda.synchronize()
        del cache, tables
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--from-json", metavar="FILE", help="rewrite the markdown table from a saved JSON profile")
    sets = ap.add_mutually_exclusive_group()
    for name, (cases, _) in CASE_SETS.items():
        sets.add_argument(f"--{name}", action="store_true",
                          help="profile these cases: " + "; ".join(f"{f} {h} heads {k} B={b} {c}" for f, h, k, b, c in cases))
    ap.add_argument("--cases", action="store_true", help=argparse.SUPPRESS)  # the process ncu profiles
    args = ap.parse_args()
    chosen = next((n for n in CASE_SETS if getattr(args, n)), None)
    cases, out_name = CASE_SETS[chosen] if chosen else (CASES, "decode_kernel_ncu")
    if args.cases:
        return run_cases(cases)
    if args.from_json:
        with open(args.from_json) as fh:
            saved = json.load(fh)
        return write_table(args.out, saved["meta"], saved["kernels"], os.path.basename(args.from_json)[:-5])
    ncu = shutil.which("ncu") or next((p for p in NCU_PATHS if os.path.exists(p)), None)
    if ncu is None:
        sys.exit("ncu (Nsight Compute) is not on PATH")
    cmd = [ncu, "--target-processes", "all", "-k", "regex:^(_mla_decode_kernel|_gluon_decode_kernel|_many_heads_kernel|mla_decode_int)", "--launch-count", str(len(cases)),
           "--csv", "--page", "raw", "--cache-control", "all", "--clock-control", "none"]  # fmt: skip
    for s in SECTIONS:
        cmd += ["--section", s]
    cmd += ["--metrics", ",".join([STALLS, PIPES, SHARED])]
    cmd += [sys.executable, os.path.abspath(__file__), "--cases"]
    cmd += [f"--{chosen}"] if chosen else []
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    text = res.stdout
    start = text.find('"ID"')
    if res.returncode != 0 or start < 0:
        sys.exit(f"ncu failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    rows = list(csv.reader(io.StringIO(text[start:])))
    header, units, data = rows[0], rows[1], rows[2:]
    kernels = []
    for (fmt, heads, kernel, batch, ctx), row in zip(cases, data):
        metrics = {}
        for name, unit, value in zip(header, units, row):
            try:
                metrics[name] = float(value.replace(",", ""))
            except ValueError:
                metrics[name] = value
        kernels.append({"format": fmt, "heads": heads, "kernel": kernel, "batch": batch, "context": ctx,
                        "units": dict(zip(header, units)), "metrics": metrics})  # fmt: skip
    import torch

    meta = {
        "card": torch.cuda.get_device_name(0),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python"] + sys.argv),
        "ncu": subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1],
        "ncu_command": " ".join(cmd[1:cmd.index(sys.executable)]),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{out_name}.json"), "w") as fh:
        json.dump({"meta": meta, "kernels": kernels}, fh, indent=1)
    write_table(args.out, meta, kernels, out_name)


def write_table(out_dir, meta, kernels, name="decode_kernel_ncu"):
    md = table(meta, kernels)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as fh:
        fh.write(md)
    print(md)


SUMMARY = [  # (label, metric) — the figures the table shows, when ncu returned them
    ("time (us)", "gpu__time_duration.sum"),
    ("DRAM throughput, % of peak", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("registers / thread", "launch__registers_per_thread"),
    ("shared memory / block (KiB)", "launch__shared_mem_per_block_dynamic"),
    ("blocks / SM (registers, shared-memory limit)", "launch__occupancy_limit_registers"),
    ("active warps / scheduler", "smsp__warps_active.avg.per_cycle_active"),
    ("eligible warps / scheduler", "smsp__warps_eligible.avg.per_cycle_active"),
    ("issue slots busy, %", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("cycles between a warp's instructions", "smsp__average_warp_latency_per_inst_issued.ratio"),
    ("tensor pipe busy, %", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
    ("bf16 FMA pipe (dequantization), %", "sm__inst_executed_pipe_fma_type_fp16.avg.pct_of_peak_sustained_active"),
    ("shared wavefronts, % peak", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed"),
]
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"


def per_token(k, sms: int) -> dict[str, float]:
    """The profile in units of one cached token (all heads): an SM handles batch * context / SMs of them."""
    m, tokens = k["metrics"], k["batch"] * k["context"]
    return {
        "SM cycles per token": m["gpc__cycles_elapsed.max"] * sms / tokens,
        "warp instructions per token": m["inst_executed"] / tokens,
        "shared-memory wavefronts per token (an SM serves 1 per cycle)":
            m["l1tex__data_pipe_lsu_wavefronts_mem_shared.sum"] / tokens,
    }  # fmt: skip


def table(meta, kernels) -> str:
    cols = [f"{k['format']} H={k['heads']}" + (f" {k['kernel']} {k['context'] // 1024}K" if "kernel" in k else "")
            for k in kernels]  # saved profiles before --gluon have no kernel / shape per case
    sms = int(kernels[0]["metrics"].get("device__attribute_multiprocessor_count", 132))
    lines = [
        "# Nsight Compute profile of the decode kernel",
        "",
        f"Card: {meta['card']} ({sms} SMs). Date: {meta['date']}. Nsight Compute {meta['ncu']}. Command: "
        f"`{meta['command']}` (ncu {meta['ncu_command']}). Batch {kernels[0]['batch']}, context "
        f"{kernels[0]['context']} unless a column says otherwise, kv_lora_rank 512, rope 64, launch configs of "
        "`default_config`; one launch per case, caches flushed, clocks not locked.",
        "",
        "| metric | " + " | ".join(cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]

    def fmt(v):
        return (f"{v:.0f}" if v >= 1000 else f"{v:.3g}") if isinstance(v, float) else str(v)

    for label, name in SUMMARY:
        vals = [k["metrics"].get(name, "") for k in kernels]
        if name == "gpu__time_duration.sum":
            vals = [v * TO_US[k["units"][name]] for v, k in zip(vals, kernels)]
        if name == "launch__shared_mem_per_block_dynamic":
            vals = [v / 1024 if isinstance(v, float) else v for v in vals]
        if name == "launch__occupancy_limit_registers":
            vals = [f"{fmt(v)}, {fmt(k['metrics'].get('launch__occupancy_limit_shared_mem', ''))}"
                    for v, k in zip(vals, kernels)]  # fmt: skip
        lines.append(f"| {label} | " + " | ".join(fmt(v) for v in vals) + " |")
    derived = [per_token(k, sms) for k in kernels]
    for label in derived[0]:
        lines.append(f"| {label} | " + " | ".join(fmt(d[label]) for d in derived) + " |")
    stalls = sorted(
        {n for k in kernels for n in k["metrics"] if n.startswith(STALL_PREFIX) and n.endswith(STALL_SUFFIX)},
        key=lambda n: -max(float(k["metrics"].get(n, 0) or 0) for k in kernels),
    )
    lines += ["", "Why warps wait: stall reasons in cycles per issued instruction (those above 0.1 anywhere):", "",
              "| stall | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]  # fmt: skip
    for name in stalls:
        vals = [float(k["metrics"].get(name, 0) or 0) for k in kernels]
        if max(vals) >= 0.1:
            short = name.removeprefix(STALL_PREFIX).removesuffix(STALL_SUFFIX)
            lines.append(f"| {short} | " + " | ".join(fmt(v) for v in vals) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
