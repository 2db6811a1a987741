"""Compile a decode kernel for sm_90 offline (no GPU needed) and count its SASS, per loop.

    PYTHONPATH=src python benchmarks/kernel_sass.py --kernel gluon            # the Gluon INT4/INT4 kernel
    PYTHONPATH=src python benchmarks/kernel_sass.py --kernel triton --format int8r128/int4 --heads 16
    PYTHONPATH=src python benchmarks/kernel_sass.py --kernel cuda --format int4/int4 --lines 12

`--kernel triton` compiles the very launch `mla_decode` makes for that cache and head count
(`quantmla.kernels.offline.compile_decode`); `--const NAME=VALUE` changes one of its constexprs.
`--kernel cuda` compiles `mla_decode_int.cu` with nvcc and the launcher's options (-D defines from --format,
512 / 64 dims, 3 stages; --const changes one, e.g. DC=256 or STAGES=2); `--lines N` also attributes each loop's
instructions to the N source lines with the most of them (compiled with -lineinfo, which leaves the code as is).

Needs a Triton whose NVIDIA backend ships `nvdisasm` and `cuobjdump` (the pip wheels do) and, for
`--kernel gluon`, `triton.experimental.gluon` (Triton 3.6-3.9). Prints registers, stack / local memory, shared
memory, the total static instruction count, and for every loop (a backward branch, in address order; for the
Gluon kernel the first is the body-tile loop and the last the protected-rows loop) its instruction count and
its memory operations (LDG / LDS / LDSM / LDGSTS / STS / LDL / STL / HGMMA by full opcode). Counts are static
(per warp, one pass through the loop; a branch inside the loop, such as the accumulators' rescale, is counted).
A script, not imported by the tests.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

MEM_OPS = ("LDG", "LDS", "LDSM", "LDGSTS", "STS", "STSM", "STG", "LDL", "STL", "HGMMA", "LDC", "ATOMS")


def _tool(name):
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass_and_resources(cubin: bytes, lines: bool = False) -> tuple[str, str]:
    d = tempfile.mkdtemp()
    p = os.path.join(d, "k.cubin")
    with open(p, "wb") as f:
        f.write(cubin)
    cmd = [_tool("nvdisasm"), "-c"] + (["-g"] if lines else []) + [p]
    sass = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    res = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", p], capture_output=True, text=True).stdout
    res = " ".join(re.findall(r"(REG:\d+|STACK:\d+|SHARED:\d+|LOCAL:\d+)", res))
    return sass, res


def _instructions(sass):
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out.append((int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2).strip())))
    return out


def _opcode(text, full=False):
    op = text.split()[0]
    return op if full else op.split(".")[0]


def loops(sass):
    """[(start, end, instructions)] of each backward branch, in address order of the branch."""
    lines = sass.splitlines()
    lab = {}
    for i, line in enumerate(lines):
        m = re.match(r"\.(L_x_\d+):", line.strip())
        if m:
            for l2 in lines[i + 1:]:
                m2 = re.match(r"\s+/\*([0-9a-f]{4,})\*/", l2)
                if m2:
                    lab[m.group(1)] = int(m2.group(1), 16)
                    break
    ins = _instructions(sass)
    out = []
    for a, t in ins:
        m = re.search(r"BRA\s+(?:`\()?\.?(L_x_\d+)", t)
        if m and m.group(1) in lab and lab[m.group(1)] < a:
            st = lab[m.group(1)]
            out.append((st, a, [x for aa, x in ins if st <= aa <= a]))
    return out


def _mem_counts(body):
    c = collections.Counter(_opcode(x, full=True) for x in body if _opcode(x) in MEM_OPS)
    return ", ".join(f"{o}:{n}" for o, n in sorted(c.items()))


def source_lines(sass, start, end):
    """{(file, line): Counter of opcodes} of the instructions in [start, end] (SASS from nvdisasm -g)."""
    cur, out = None, collections.defaultdict(collections.Counter)
    for line in sass.splitlines():
        m = re.search(r'File "([^"]+)", line (\d+)', line)
        if m:
            cur = (os.path.basename(m.group(1)), int(m.group(2)))
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and start <= int(m.group(1), 16) <= end:
            out[cur][_opcode(re.sub(r"^@!?U?P\w+\s+", "", m.group(2).strip()))] += 1
    return out


def report(cubin, label, shared, top=20, dump=None, lines=0, src=None):
    sass, res = sass_and_resources(cubin, lines=lines > 0)
    if dump:
        with open(dump, "w") as f:
            f.write(sass)
    ins = _instructions(sass)
    ops = collections.Counter(_opcode(x) for _, x in ins)
    print(f"{label}: {res} | shared {shared} | static instructions {len(ins)}")
    print("  top:", ", ".join(f"{o}:{n}" for o, n in ops.most_common(top)))
    print("  memory ops (whole kernel):", _mem_counts([x for _, x in ins]))
    for i, (st, en, body) in enumerate(loops(sass)):
        lops = collections.Counter(_opcode(x) for x in body)
        print(f"  loop {i} [{st:#x}-{en:#x}]: {len(body)} instructions")
        print("    memory:", _mem_counts(body))
        print("    top:", ", ".join(f"{o}:{n}" for o, n in lops.most_common(top)))
        if lines:
            text = open(src).read().splitlines() if src else []
            by_line = source_lines(sass, st, en)
            for (f, n), c in sorted(by_line.items(), key=lambda kv: -sum(kv[1].values()))[:lines]:
                what = text[n - 1].strip()[:60] if src and f == os.path.basename(src) else f"{f}:{n}"
                print(f"    {sum(c.values()):5d}  line {n}: {what}  ({', '.join(f'{o}:{k}' for o, k in c.most_common(3))})")


def _gluon(args):
    """The launch `mla_decode_gluon` makes (`quantmla.kernels.offline.compile_gluon`), with --stages,
    --prot-gather, --no-prefetch, --no-denorm and --const applied."""
    from quantmla.cache.paged import PagedMLACache
    from quantmla.config import CacheConfig
    from quantmla.kernels import mla_decode_gluon as mg
    from quantmla.kernels.offline import compile_gluon

    if mg.gluon is None:
        sys.exit(f"no Gluon in this Triton: {mg._GLUON_ERROR}")
    config = CacheConfig("int4", "int4", sink=args.sink, recent=args.recent)
    cache = PagedMLACache.allocate(config, 512, 64, 4, 2, block_size=args.page)
    consts = {**dict(DENORM=not args.no_denorm, STAGES=args.stages, PROT_VEC=not args.prot_gather,
                     PROT_PREFETCH=not args.no_prefetch), **args.const}
    unknown = set(args.const) - {p.name for p in mg._gluon_decode_kernel.params if p.is_constexpr}
    if unknown:
        sys.exit(f"not constexprs of the kernel: {', '.join(sorted(unknown))}")
    return compile_gluon(cache, consts=consts)


def _triton(args):
    """The launch `mla_decode` makes for --format at --heads (`quantmla.kernels.offline`), --const applied."""
    from quantmla.cache.paged import PagedMLACache
    from quantmla.config import CacheConfig
    from quantmla.kernels.offline import compile_decode

    content, _, rope = args.format.partition("/")
    config = CacheConfig(content, rope or content, sink=args.sink, recent=args.recent)
    cache = PagedMLACache.allocate(config, 512, 64, 4, 2, block_size=args.page)
    return compile_decode(cache, args.heads, overrides=args.const)


def _cuda(args):
    """(cubin, label) of mla_decode_int.cu for --format with the launcher's defines and nvcc options, plus
    -lineinfo."""
    from quantmla.cache.paged import PagedMLACache
    from quantmla.config import CacheConfig
    from quantmla.kernels import mla_decode_cuda as mdc

    content, _, rope = args.format.partition("/")
    cache = PagedMLACache.allocate(CacheConfig(content, rope or content), 512, 64, 2, 1, device="meta")
    if (why := mdc._fmt_reason(cache)) is not None:
        sys.exit(f"--kernel cuda: the kernel {why}")
    defines = {**mdc._defines(cache), "STAGES": 3, **args.const}
    nvcc = mdc._nvcc()
    if nvcc is None:
        sys.exit("nvcc not found")
    out = os.path.join(tempfile.mkdtemp(), "k.cubin")
    subprocess.run([nvcc, "-cubin", *mdc.nvcc_options(defines, "90"), "-lineinfo", "-o", out, str(mdc.SRC)], check=True)
    with open(out, "rb") as f:
        return f.read(), "cuda " + " ".join(f"{k}={v}" for k, v in sorted(defines.items()))


def _const(s):
    k, _, v = s.partition("=")
    if not _:
        raise argparse.ArgumentTypeError("--const takes NAME=VALUE")
    return k, (v == "True") if v in ("True", "False") else int(v)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--kernel", choices=("triton", "gluon", "cuda"), default="gluon")
    ap.add_argument("--format", default="int4/int4",
                    help="cache format CONTENT/ROPE, e.g. bf16, int4/int4, int8r128/int4 (--kernel triton only; the "
                    "Gluon kernel is INT4/INT4)")
    ap.add_argument("--heads", type=int, default=16, help="query heads (--kernel triton: picks the launch config)")
    ap.add_argument("--stages", type=int, default=3, help="Gluon codes-ring depth (STAGES)")
    ap.add_argument("--prot-gather", action="store_true", help="Gluon PROT_VEC=False (the old protected loads)")
    ap.add_argument("--no-prefetch", action="store_true", help="Gluon PROT_PREFETCH=False")
    ap.add_argument("--no-denorm", action="store_true", help="Gluon DENORM=False")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--recent", type=int, default=128)
    ap.add_argument("--const", type=_const, action="append", default=[], metavar="NAME=VALUE",
                    help="override / add a kernel constexpr (int, True or False)")
    ap.add_argument("--top", type=int, default=20, help="opcodes listed per loop")
    ap.add_argument("--dump", help="write the SASS to this file")
    ap.add_argument("--lines", type=int, default=0, help="per loop, the N source lines with the most instructions")
    args = ap.parse_args(argv)
    args.const = dict(args.const)
    if args.kernel == "cuda":
        from quantmla.kernels.mla_decode_cuda import SRC

        cubin, label = _cuda(args)
        report(cubin, f"{label} sm_90", "sizeof(Smem), dynamic", top=args.top, dump=args.dump, lines=args.lines,
               src=str(SRC))  # fmt: skip
        return
    k = _gluon(args) if args.kernel == "gluon" else _triton(args)
    label = "gluon int4/int4" if args.kernel == "gluon" else f"triton {args.format}"
    report(k.asm["cubin"], f"{label} sm_90", f"{k.metadata.shared} B", top=args.top, dump=args.dump,
           lines=args.lines)  # fmt: skip


if __name__ == "__main__":
    main()
