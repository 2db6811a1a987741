"""Compile a decode kernel for sm_90 offline (no GPU needed) and count its SASS, per loop.

    PYTHONPATH=src python benchmarks/kernel_sass.py --kernel gluon            # the Gluon INT4/INT4 kernel
    PYTHONPATH=src python benchmarks/kernel_sass.py --kernel triton --format bf16

Needs a Triton whose NVIDIA backend ships `nvdisasm` and `cuobjdump` (the pip wheels do) and, for
`--kernel gluon`, `triton.experimental.gluon` (Triton 3.6). Prints registers, stack / local memory, shared
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


def _compile(fn, ptrs, consts, *, gluon_kernel, num_warps=4, num_stages=2, floats=()):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, cx, attrs = {}, {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in consts:
            sig[n], cx[n] = "constexpr", consts[n]
        elif n in ptrs:
            sig[n] = "*" + ptrs[n]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in floats:
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    if gluon_kernel:
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(fn, sig, cx, attrs)
    else:
        src = ASTSource(fn, sig, cx, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=num_warps,
                                                                               num_stages=num_stages))


def _tool(name):
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass_and_resources(k) -> tuple[str, str]:
    d = tempfile.mkdtemp()
    p = os.path.join(d, "k.cubin")
    with open(p, "wb") as f:
        f.write(k.asm["cubin"])
    sass = subprocess.run([_tool("nvdisasm"), "-c", p], capture_output=True, text=True, check=True).stdout
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


def report(k, label, top=20, dump=None):
    sass, res = sass_and_resources(k)
    if dump:
        with open(dump, "w") as f:
            f.write(sass)
    ins = _instructions(sass)
    ops = collections.Counter(_opcode(x) for _, x in ins)
    print(f"{label}: {res} | metadata shared {k.metadata.shared} B | static instructions {len(ins)}")
    print("  top:", ", ".join(f"{o}:{n}" for o, n in ops.most_common(top)))
    print("  memory ops (whole kernel):", _mem_counts([x for _, x in ins]))
    for i, (st, en, body) in enumerate(loops(sass)):
        lops = collections.Counter(_opcode(x) for x in body)
        print(f"  loop {i} [{st:#x}-{en:#x}]: {len(body)} instructions")
        print("    memory:", _mem_counts(body))
        print("    top:", ", ".join(f"{o}:{n}" for o, n in lops.most_common(top)))


def _gluon(args):
    from quantmla.kernels import mla_decode_gluon as mg

    if mg.gluon is None:
        sys.exit(f"no Gluon in this Triton: {mg._GLUON_ERROR}")
    ptrs = dict(qn_ptr="bf16", qp_ptr="bf16", cc_ptr="u8", cs_ptr="fp16", cz_ptr="fp16", rc_ptr="u8",
                rs_ptr="fp16", rz_ptr="fp16", pc_ptr="bf16", pr_ptr="bf16", bt_ptr="i32", lens_ptr="i32",
                slots_ptr="i32", o_ptr="fp32", lse_ptr="fp32")
    consts = dict(C_ROW=256, C_SZ_ROW=8, R_ROW=32, R_SZ_ROW=1, PAGE=args.page, SINK=args.sink, RECENT=args.recent,
                  C_RING=args.recent, R_RING=args.recent, DENORM=not args.no_denorm, STAGES=args.stages,
                  PROT_VEC=not args.prot_gather, PROT_PREFETCH=not args.no_prefetch)
    consts.update(args.const)
    fn = mg._gluon_decode_kernel
    for name in (p.name for p in fn.params if p.is_constexpr):
        if name not in consts:
            sys.exit(f"kernel constexpr {name} unknown to this script: give it with --const {name}=VALUE")
    return _compile(fn, ptrs, consts, gluon_kernel=True, num_warps=mg.NUM_WARPS, floats=("qk_scale",))


def _triton(args):
    import importlib

    md = importlib.import_module("quantmla.kernels.mla_decode")  # the package's `mla_decode` is the function

    q = args.format != "bf16"
    cd = "u8" if q else "bf16"
    sd = "fp16" if q else "bf16"
    ptrs = dict(qn_ptr="bf16", qp_ptr="bf16", cc_ptr=cd, cs_ptr=sd, cz_ptr=sd, rc_ptr=cd, rs_ptr=sd, rz_ptr=sd,
                pc_ptr="bf16", pr_ptr="bf16", bt_ptr="i32", lens_ptr="i32", slots_ptr="i32", o_ptr="fp32",
                lse_ptr="fp32")
    K = 2 if q else 0
    consts = dict(DC=512, DR=64, C_KIND=K, C_BITS=4 if K else 16, C_GROUP=64 if K else 512, C_SCALED=bool(K),
                  C_ROW=256 if K else 512, C_SZ_ROW=8 if K else 0, R_KIND=K, R_BITS=4 if K else 16,
                  R_GROUP=64, R_SCALED=bool(K), R_ROW=32 if K else 64, R_SZ_ROW=1 if K else 0, C_BLK=1, R_BLK=1,
                  PAGE=args.page, SINK=args.sink, RECENT=args.recent, C_RING=args.recent, R_RING=args.recent,
                  BLOCK_H=16, BLOCK_N=64, S_T=False, V_T=False, USE_ASM=True, F32_DOT=False,
                  C_NGS=8 if K else 1, R_NGS=1, DCB=512)
    if args.format == "int8r128/int4":  # the body tiles 128 channels wide (DCB; --const DCB=512: all of them)
        consts.update(C_BITS=8, C_ROW=128, C_SZ_ROW=2, C_NGS=2, DCB=128)
    consts.update(args.const)
    return _compile(md._mla_decode_kernel, ptrs, consts, gluon_kernel=False, floats=("qk_scale",))


def _const(s):
    k, _, v = s.partition("=")
    if not _:
        raise argparse.ArgumentTypeError("--const takes NAME=VALUE")
    return k, (v == "True") if v in ("True", "False") else int(v)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--kernel", choices=("triton", "gluon"), default="gluon")
    ap.add_argument("--format", choices=("bf16", "int4/int4", "int8r128/int4"), default="int4/int4",
                    help="cache format (--kernel triton only; the Gluon kernel is INT4/INT4)")
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
    args = ap.parse_args(argv)
    args.const = dict(args.const)
    k = _gluon(args) if args.kernel == "gluon" else _triton(args)
    label = "gluon int4/int4" if args.kernel == "gluon" else f"triton {args.format}"
    report(k, f"{label} sm_90", top=args.top, dump=args.dump)


if __name__ == "__main__":
    main()
