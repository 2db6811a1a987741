"""Where the CUDA decode kernel's time goes, by source line: Nsight Compute's per-instruction counters mapped
to lines of `mla_decode_int.cu`.

    PYTHONPATH=src python benchmarks/decode_kernel_ncu_source.py [--format int4/int4] [--batch 16]
        [--context 16384] [--heads 16] [--top 30] [--out benchmarks/results]

Runs itself under `ncu` (on PATH, or /usr/local/cuda/bin) with one launch of `mla_decode_int`, built with the
launcher's nvcc options plus -lineinfo (which leaves the code as is), and the SourceCounters section: each
SASS instruction's executions and warp-state samples (where warps stood, and why they waited). The same
cubin (from the launcher's on-disk cache), disassembled with `nvdisasm -g`, gives each instruction's
source line. Writes decode_kernel_ncu_source.{json,md}:
  - the share of samples and instructions in the prologue (before the body-tile loop), the body-tile loop
    (the smallest loop that issues cp.async copies) and the rest (protected rows, epilogue);
  - the body loop's dynamic instructions per warp and tile, by source line;
  - the lines where warps wait most, with their main stall reasons.
Needs a GPU, ncu, and Triton's NVIDIA backend for nvdisasm (see kernel_sass.py).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

NCU_PATHS = ["/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/ncu"]
SAMPLES, EXECUTED = "Warp Stall Sampling (All Samples)", "Instructions Executed"


def _lineinfo():
    """Make the launcher build with -lineinfo (this process only)."""
    from quantmla.kernels import mla_decode_cuda as mdc

    plain = mdc.nvcc_options
    mdc.nvcc_options = lambda defines, arch: plain(defines, arch) + ["-lineinfo"]
    return mdc


def run_case(args):
    """The profiled process: one launch of the CUDA kernel."""
    import torch
    from decode_kernel import SCALE, build, queries

    from quantmla.kernels.mla_decode_cuda import mla_decode_cuda

    _lineinfo()
    cache, tables, seq_lens, slots = build(args.format, args.batch, args.context)
    qn, qp = queries(args.batch, args.heads)
    mla_decode_cuda(qn, qp, cache, tables, seq_lens, slots, SCALE, max_seq_len=args.context)
    torch.cuda.synchronize()


def line_map(fmt: str):
    """{offset: source line ("123", or "header:line" for inlined library code)} of the cubin the profiled process
    ran, and the body-tile loop's (start, end)."""
    import torch

    import kernel_sass as ks
    from quantmla.cache.paged import PagedMLACache
    from quantmla.config import CacheConfig

    mdc = _lineinfo()
    content, _, rope = fmt.partition("/")
    cache = PagedMLACache.allocate(CacheConfig(content, rope or content), 512, 64, 2, 1, device="meta")
    major, minor = torch.cuda.get_device_capability()
    image = None
    for stages in (3, 2):  # the ring the launcher loaded: the deepest that fits (cached on disk by the run)
        got = mdc._load(torch.cuda.current_device(), {**mdc._defines(cache), "STAGES": stages})
        if not isinstance(got, str):
            image = mdc.build_cubin({**mdc._defines(cache), "STAGES": stages}, f"{major}{minor}")
            break
    sass, _ = ks.sass_and_resources(image, lines=True)
    cur, lines = None, {}
    for text in sass.splitlines():
        m = re.search(r'File "([^"]+)", line (\d+)', text)
        if m:
            name = os.path.basename(m.group(1))  # a kernel line, or header:line for inlined library code
            cur = m.group(2) if name == mdc.SRC.name else f"{name}:{m.group(2)}"
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", text)
        if m:
            lines[int(m.group(1), 16)] = cur
    copying = [(st, en, body) for st, en, body in ks.loops(sass) if any(x.startswith("LDGSTS") for x in body)]
    st, en, _ = min(copying, key=lambda lp: len(lp[2]))
    return lines, (st, en)


def profile(args) -> dict:
    ncu = shutil.which("ncu") or next((p for p in NCU_PATHS if os.path.exists(p)), None)
    if ncu is None:
        sys.exit("ncu (Nsight Compute) is not on PATH")
    rep = os.path.join(args.out, "decode_kernel_ncu_source")
    case = ["--format", args.format, "--batch", str(args.batch), "--context", str(args.context), "--heads", str(args.heads)]
    cmd = [ncu, "--target-processes", "all", "-k", "regex:^mla_decode_int", "--launch-count", "1", "--import-source",
           "yes", "--section", "SourceCounters", "-f", "-o", rep, sys.executable, os.path.abspath(__file__), "--case", *case]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if res.returncode or not os.path.exists(rep + ".ncu-rep"):
        sys.exit(f"ncu failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    page = subprocess.run([ncu, "-i", rep + ".ncu-rep", "--page", "source", "--csv", "--print-source", "sass"],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    os.remove(rep + ".ncu-rep")
    return parse(page, *line_map(args.format))


def parse(page: str, lines: dict, body_loop: tuple[int, int]) -> dict:
    """Per region, per body-loop line and per line overall: samples, instructions and stall reasons, from ncu's
    SASS source page (CSV) and the {offset: line} map of the same cubin."""
    b0, b1 = body_loop
    rows = list(csv.reader(io.StringIO(page[page.find('"Address"'):])))
    head, rows = rows[0], [r for r in rows[1:] if r and r[0].startswith("0x")]
    col = {n: i for i, n in enumerate(head)}
    stalls = [n for n in head if n.startswith("stall_") and "Not Issued" not in n]
    base = min(int(r[0], 16) for r in rows)

    def num(r, n):
        try:
            return float(r[col[n]].replace(",", ""))
        except ValueError:
            return 0.0

    regions = defaultdict(lambda: defaultdict(float))
    body = defaultdict(lambda: defaultdict(float))
    waits = defaultdict(lambda: defaultdict(float))
    warp_tiles = 0.0
    for r in rows:
        off = int(r[0], 16) - base
        where = "body loop" if b0 <= off <= b1 else "prologue" if off < b0 else "protected rows, epilogue"
        regions[where]["samples"] += num(r, SAMPLES)
        regions[where]["instructions"] += num(r, EXECUTED)
        line = lines.get(off) or "?"
        waits[line]["samples"] += num(r, SAMPLES)
        for s in stalls:
            waits[line][s[6:]] += num(r, s)
        if where == "body loop":
            body[line]["instructions"] += num(r, EXECUTED)
            warp_tiles = max(warp_tiles, num(r, EXECUTED))  # the loop's first instruction: once per warp and tile
    return {"regions": regions, "body": body, "waits": waits, "warp_tiles": warp_tiles}


def report(meta, prof, src_lines, top: int) -> str:
    tot_s = sum(v["samples"] for v in prof["regions"].values()) or 1.0
    tot_i = sum(v["instructions"] for v in prof["regions"].values()) or 1.0
    wt = prof["warp_tiles"] or 1.0
    def text(n: str) -> str:
        if not n.isdigit() or not 0 < int(n) <= len(src_lines):
            return "(inlined library code)" if ":" in n else "(no line)"
        return "`" + src_lines[int(n) - 1].strip()[:64].replace("|", "/") + "`"
    out = [
        "# The CUDA decode kernel by source line (Nsight Compute SourceCounters)",
        "",
        f"Card: {meta['card']}. Date: {meta['date']}. Command: `{meta['command']}`. "
        f"{meta['case']}; one launch, -lineinfo build.",
        "",
        "| region | % of warp samples | % of instructions |",
        "|---|---:|---:|",
    ]
    for name, v in sorted(prof["regions"].items(), key=lambda kv: -kv[1]["samples"]):
        out.append(f"| {name} | {100 * v['samples'] / tot_s:.1f} | {100 * v['instructions'] / tot_i:.1f} |")
    per = sum(v["instructions"] for v in prof["body"].values()) / wt
    out += ["", f"Body-tile loop: {per:.0f} dynamic instructions per warp and tile, by line (top {top}):", "",
            "| line | per warp and tile | source |", "|---:|---:|---|"]  # fmt: skip
    for n, v in sorted(prof["body"].items(), key=lambda kv: -kv[1]["instructions"])[:top]:
        out.append(f"| {n} | {v['instructions'] / wt:.1f} | {text(n)} |")
    out += ["", f"Where warps wait (top {top} lines by warp samples; main stall reasons, % of that line's samples):", "",
            "| line | % of samples | main reasons | source |", "|---:|---:|---|---|"]  # fmt: skip
    for n, v in sorted(prof["waits"].items(), key=lambda kv: -kv[1]["samples"])[:top]:
        why = sorted(((k, x) for k, x in v.items() if k != "samples" and x > 0), key=lambda kx: -kx[1])[:3]
        reasons = ", ".join(f"{k} {100 * x / v['samples']:.0f}" for k, x in why) if v["samples"] else ""
        out.append(f"| {n} | {100 * v['samples'] / tot_s:.1f} | {reasons} | {text(n)} |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="int4/int4")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--top", type=int, default=30, help="lines per table")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--case", action="store_true", help=argparse.SUPPRESS)  # the process ncu profiles
    args = ap.parse_args()
    if args.case:
        return run_case(args)
    import torch

    from quantmla.kernels import mla_decode_cuda as mdc

    os.makedirs(args.out, exist_ok=True)
    prof = profile(args)
    meta = {
        "card": torch.cuda.get_device_name(0),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python"] + sys.argv),
        "case": f"{args.format}, batch {args.batch}, context {args.context}, {args.heads} heads, kv_lora_rank 512, rope 64",
    }
    md = report(meta, prof, mdc.SRC.read_text().splitlines(), args.top)
    with open(os.path.join(args.out, "decode_kernel_ncu_source.md"), "w") as fh:
        fh.write(md)
    with open(os.path.join(args.out, "decode_kernel_ncu_source.json"), "w") as fh:
        json.dump({"meta": meta, **prof}, fh, indent=1)
    print(md)


if __name__ == "__main__":
    main()
