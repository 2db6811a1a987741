"""The CUDA decode kernel of the working tree against the one of another git revision, in one process.

    PYTHONPATH=src python benchmarks/decode_kernel_ab.py --base REV|FILE[.patch] [--variant NAME=FILE ...]
        [--batches 1,16,64] [--contexts 4096,16384,65536] [--formats int4/int4,int2/int4] [--heads 16]
        [--out benchmarks/results] [--prebuild]

For each shape it fills one cache (decode_kernel.build), times the BF16 Triton kernel on a BF16 cache of the
same shape, then `mla_decode_int.cu` as it was at REV (or as FILE holds it), each --variant file, and the file
as it is now, through the same launcher (the source swapped under `mla_decode_cuda.SRC`), each checked against
the fp64 reference (decode_kernel.check) and timed as decode_kernel.bench does (CUDA-graph replays, L2 flushed,
median). A change's effect is measured on the same machine, caches and clocks, which a comparison across result
files cannot promise. (A base whose kernel takes other arguments than the launcher passes, e.g. one from before
the per-sequence split count (226f1b4) or before the protected splits' count (e48bcda), fails its check.) A
FILE ending in `.patch` is a diff of the kernel source (`git diff` of `mla_decode_int.cu`; its other files are
left out, so the variant runs under the current launcher), applied to the current source where its context
matches exactly. Writes decode_kernel_ab.{json,md} (--name changes the stem). Needs a GPU, nvcc, and git for a
revision.

--prebuild compiles every version's cubins for --formats (sm_90, both ring depths) into the launcher's cache
and exits, without a GPU: run it where nvcc is, carry $QUANTMLA_CACHE_DIR to the GPU machine, and the timed
run spends no time in nvcc.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))


def source_at(rev: str, path: Path) -> Path:
    """The file at git revision rev, written to a temporary file."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True).stdout.strip()
    rel = path.resolve().relative_to(Path(root).resolve())
    text = subprocess.run(["git", "show", f"{rev}:{rel.as_posix()}"], capture_output=True, text=True, cwd=root)
    if text.returncode:
        sys.exit(f"git show {rev}:{rel} failed: {text.stderr.strip()}")
    out = Path(tempfile.mkdtemp()) / path.name
    out.write_text(text.stdout)
    return out


def apply_patch(text: str, patch: str, name: str) -> str:
    """text with the hunks of a unified diff (`git diff`) for the file whose path ends in `name` applied, each at
    its line number and only where its context matches exactly (no git needed: the GPU machine may have none).
    Raises ValueError naming the first hunk that does not apply, or when the diff has none for `name`."""
    lines, out, pos, hunks = text.splitlines(keepends=True), [], 0, []
    it, in_file = iter(patch.splitlines(keepends=True)), False
    for line in it:
        if line.startswith("+++ "):
            in_file = line[4:].strip().split("/")[-1] == name
        elif in_file and (m := re.match(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,(\d+))? @@", line)):
            start, n_old = int(m.group(1)), int(m.group(2) or 1)
            n_new, old, new = int(m.group(3) or 1), [], []
            while len(old) < n_old or len(new) < n_new:
                body = next(it)
                if body.startswith("\\"):  # "\ No newline at end of file"
                    continue
                if body[:1] in (" ", "-"):
                    old.append(body[1:])
                if body[:1] in (" ", "+"):
                    new.append(body[1:])
            hunks.append((start - 1 if n_old else start, old, new))
    if not hunks:
        raise ValueError(f"no change to {name} in it")
    for at, old, new in hunks:
        if at < pos or lines[at:at + len(old)] != old:
            raise ValueError(f"the hunk at line {at + 1} does not match {name} as it is now")
        out += lines[pos:at] + new
        pos = at + len(old)
    return "".join(out + lines[pos:])


def patched(patch: Path, current: Path) -> Path:
    """The current kernel source with patch's changes to it applied (apply_patch), as a temporary file."""
    try:
        text = apply_patch(current.read_text(), patch.read_text(), current.name)
    except ValueError as e:
        sys.exit(f"{patch} does not apply: {e}")
    out = Path(tempfile.mkdtemp()) / current.name
    out.write_text(text)
    return out


@contextlib.contextmanager
def cuda_source(src: Path):
    """Within: `mla_decode` builds and runs the CUDA kernel from `src` instead of the launcher's own source."""
    from quantmla.kernels import mla_decode_cuda as mdc

    current = mdc.SRC
    mdc.SRC = src
    mdc._kernels.clear()  # built and loaded again from this source
    try:
        yield
    finally:
        mdc.SRC = current
        mdc._kernels.clear()


def versions(base: str, variants: list[str]) -> dict[str, Path]:
    """{"base": ..., each --variant NAME: ..., "current": ...} -> the kernel source file each one runs."""
    from quantmla.kernels import mla_decode_cuda as mdc

    current = mdc.SRC
    if base.endswith(".patch") and os.path.isfile(base):
        out = {"base": patched(Path(base), current)}
    else:
        out = {"base": Path(base) if os.path.isfile(base) else source_at(base, current)}
    for spec in variants:
        name, _, path = spec.partition("=")
        if name in ("", "base", "current") or name in out or not os.path.isfile(path):
            sys.exit(f"--variant {spec}: needs NAME=FILE with a new name (not base / current) and an existing file")
        out[name] = patched(Path(path), current) if path.endswith(".patch") else Path(path)
    return {**out, "current": current}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True,
                    help="git revision whose mla_decode_int.cu is the baseline, a path to such a file, or a .patch "
                         "of the current one")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="4096,16384,65536")
    ap.add_argument("--formats", default="int4/int4,int2/int4")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FILE",
                    help="another version of mla_decode_int.cu to time beside base and current (repeatable)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--rep", type=float, default=10, help="timed replays per row: about this many ms")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--name", default="decode_kernel_ab", help="results file stem")
    ap.add_argument("--prebuild", action="store_true",
                    help="only compile every version's cubins for --formats (no GPU needed), then exit")
    args = ap.parse_args()
    variants = versions(args.base, args.variant)
    if args.prebuild:
        import build_cuda_kernels

        for name, src in variants.items():
            with cuda_source(src):
                n = build_cuda_kernels.build([f"{f}:512:64" for f in args.formats.split(",")])
            print(f"{name}: {n} cubins ({src})")
        return

    import torch
    from decode_kernel import SCALE, bench, bf16_us, build, check, queries, require_cuda

    require_cuda()

    from quantmla.kernels import mla_decode_cuda as mdc
    from quantmla.kernels.mla_decode import mla_decode

    extra = {k: v for k, v in variants.items() if k not in ("base", "current")}
    rows = []
    head = f"{'B':>3} {'context':>7} {'format':>10} {'bf16 us':>8} {'base us':>8} {'x':>5} {'now us':>8} {'x':>5} {'now/base':>8}"
    head += "".join(f" {name[:12]:>12}" for name in extra)
    print(head)
    for B in map(int, args.batches.split(",")):
        for ctx in map(int, args.contexts.split(",")):
            qn, qp = queries(B, args.heads)
            t_bf16 = bf16_us(qn, qp, B, ctx, args)
            for fmt in args.formats.split(","):
                cache, tables, lens, slots = build(fmt, B, ctx)
                os.environ[mdc.ENV] = "cuda"
                res = {}
                for name, src in variants.items():
                    with cuda_source(src):
                        run = lambda: mla_decode(qn, qp, cache, tables, lens, slots, SCALE, max_seq_len=ctx)  # noqa: E731
                        err = check(cache, tables, lens, slots, qn, qp, *run())
                        res[name] = {"us": bench(run, args), "rms_err": err[0], "lse_err": err[1]}
                del cache
                torch.cuda.empty_cache()
                b, c = res["base"]["us"], res["current"]["us"]
                rows.append({"batch": B, "context": ctx, "format": fmt, "heads": args.heads, "bf16_us": t_bf16, **res})
                print(f"{B:3d} {ctx:7d} {fmt:>10} {t_bf16:8.1f} {b:8.1f} {t_bf16 / b:5.2f} {c:8.1f} {t_bf16 / c:5.2f} "
                      f"{b / c:8.3f}" + "".join(f" {b / res[n]['us']:12.3f}" for n in extra), flush=True)  # fmt: skip
    meta = {
        "card": torch.cuda.get_device_name(0),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python"] + sys.argv),
        "base": args.base,
        "variants": dict(v.split("=", 1) for v in args.variant),
        "torch": torch.__version__,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    lines = [
        "# The CUDA decode kernel: working tree against a base revision",
        "",
        f"Card: {meta['card']}. Date: {meta['date']}. torch {meta['torch']}. Command: `{meta['command']}`. "
        f"{args.heads} heads, kv_lora_rank 512, rope 64, page 64; x = speed over the BF16 Triton kernel; "
        "now/base > 1: the working tree is faster; a variant's column is base us / its us. Median of CUDA-graph "
        "replays, L2 flushed.",
        "",
        "| B | context | format | bf16 us | base us | x | now us | x | now/base |" + "".join(f" {n}/base |" for n in extra),
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(extra),
    ]
    for r in rows:
        b, c = r["base"]["us"], r["current"]["us"]
        lines.append(f"| {r['batch']} | {r['context']} | {r['format']} | {r['bf16_us']:.1f} | {b:.1f} | "
                     f"{r['bf16_us'] / b:.2f} | {c:.1f} | {r['bf16_us'] / c:.2f} | {b / c:.3f} |"
                     + "".join(f" {b / r[n]['us']:.3f} |" for n in extra))  # fmt: skip
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
