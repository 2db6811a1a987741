"""Probe for a 16-head decode kernel: the scores half alone, with wgmma and the codes as register A operands.

    PYTHONPATH=src python benchmarks/wgmma_scores_probe.py [--variants regs=RING:0,ring4=RING:4]
        [--out benchmarks/results]

Builds `wgmma_scores_probe.cu` for sm_90a (nvcc, once per variant: NAME=MACRO:VALUE,... -D defines, e.g.
RING (0: the next tile's loads into registers; n: an n-slot cp.async ring) and MIN_CTAS (the launch bound that
caps registers)), checks it against a torch reference on random int4 codes, scales and
queries (both orders of the descriptor's two offsets are tried; the one that matches is kept), then times
S [tokens, 16 heads] over B * L tokens without writing S (each thread keeps a checksum), and reports SM
cycles per token (at the card's maximum clock) beside the whole CUDA decode kernel's 52.7 at B = 16 / 64 K
(benchmarks/results/decode_kernel_ncu_tokens.md, first column). What it leaves out of a decode: the zero
term, the softmax and the values. Writes wgmma_scores_probe.{json,md} (--name changes the stem).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import functools
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from quantmla.kernels.mla_decode_cuda import _check, _cu, _nvcc  # noqa: E402

SRC = os.path.join(os.path.dirname(__file__), "wgmma_scores_probe.cu")
NG, ROW, H = 9, 288, 16


STAGE_BYTES = 64 * ROW + 64 * NG * 4


def build(defines: dict, src: str = SRC) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "p.cubin")
        subprocess.run([_nvcc(), "-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                        *[f"-D{k}={v}" for k, v in defines.items()], "-o", out, src], check=True)  # fmt: skip
        return open(out, "rb").read()


def stage_q(q: torch.Tensor) -> torch.Tensor:
    """q [16, 576] fp32 -> the shared-memory image, fp16 [group, k step, n8 block, k half, 8 rows, 8]: k slot
    h * 8 + e8 of step s holds channel 16 t + 8 (s // 2) + 2 (s % 2) + 4 e (+ 1 and / 16 for h = 1), with
    t, e = divmod(e8, 2)."""
    img = torch.empty(NG, 4, 2, 2, 8, 8, dtype=torch.float32)
    for g in range(NG):
        for s in range(4):
            for h in range(2):
                for e8 in range(8):
                    t, e = divmod(e8, 2)
                    ch = 64 * g + 16 * t + 8 * (s // 2) + 2 * (s % 2) + 4 * e + h
                    for j in range(2):
                        img[g, s, j, h, :, e8] = q[8 * j:8 * j + 8, ch] / (16.0 if h else 1.0)
    return img.to(torch.float16)


def reference(codes: torch.Tensor, scale: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """S [tokens, 16] = sum_g scale[t, g] sum_{c in g} code[t, c] q[h, c] (byte i of a group: channels 2i, 2i+1)."""
    c = torch.stack([codes & 15, codes >> 4], -1).reshape(codes.shape[0], NG, 64).double()
    qq = q.double().reshape(H, NG, 64)
    return torch.einsum("tgc,hgc,tg->th", c, qq, scale.double())


def parse_variant(spec: str) -> tuple[str, dict]:
    """"NAME=MACRO:VALUE,..." -> (NAME, the -D defines)."""
    name, _, defines = spec.partition("=")
    return name, {k: int(v) for k, v in (kv.split(":") for kv in defines.split(",") if kv)}


def load(image: bytes, kernel: bytes, smem: int) -> int:
    """The CUfunction `kernel` of a cubin image, allowed `smem` bytes of dynamic shared memory."""
    cu = _cu()
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    _check(cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(image)), "cuModuleLoadData")
    _check(cu.cuModuleGetFunction(ctypes.byref(fn), mod, kernel), "cuModuleGetFunction")
    _check(cu.cuFuncSetAttribute(fn, 8, smem), "cuFuncSetAttribute(max dynamic shared memory)")
    return fn.value


def median_us(run, reps: int = 20) -> float:
    """Median of `reps` timed calls of `run` (CUDA events, after one untimed call)."""
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def launch(fn, grid, args, smem=0):
    cu = _cu()
    vals = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int(a) for a in args]
    params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    _check(cu.cuLaunchKernel(ctypes.c_void_p(fn), grid, 1, 1, 128, 1, 1, smem, stream, params, None), "cuLaunchKernel")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["regs=RING:0", "ring3=RING:3", "ring4=RING:4"],
                    help="NAME=MACRO:VALUE,... (the .cu's -D defines)")
    ap.add_argument("--tokens", default="16x16384,16x65536,64x65536", help="comma list of BxL")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--name", default="wgmma_scores_probe", help="results file stem")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("wgmma_scores_probe.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    torch.empty(1, device="cuda")
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    clock_hz = props.clock_rate * 1e3 if hasattr(props, "clock_rate") else 1.98e9
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, errs, order = [], {}, None
    for spec_v in args.variants:
        name, defines = parse_variant(spec_v)
        smem = defines.get("RING", 0) * STAGE_BYTES
        fn = load(build(defines), b"scores_probe", smem)

        # check on 64 tiles, both offset orders
        n = 64 * 64
        codes = torch.randint(0, 256, (n, ROW), dtype=torch.uint8, device="cuda", generator=g)
        scale = torch.rand(n, NG, device="cuda", generator=g) * 0.1 + 0.01
        q = torch.randn(H, 576, device="cuda", generator=g) * 64
        img = stage_q(q.cpu()).cuda()
        want = reference(codes.cpu(), scale.cpu(), q.cpu().to(torch.float16).float())
        order = None
        for lbo, sbo in ((128, 256), (256, 128)):
            out = torch.full((n, H), float("nan"), device="cuda")
            launch(fn, 64, [codes, scale, img, out, n // 64, 1, lbo, sbo], smem)
            torch.cuda.synchronize()
            err = ((out.cpu().double() - want).norm() / want.norm()).item()
            errs[f"{name}, {lbo}/{sbo}"] = err
            print(f"{name} lbo {lbo} sbo {sbo}: relative error {err:.2e}", flush=True)
            if order is None and err < 1e-3:
                order = (lbo, sbo)
        if order is None:
            continue
        for spec in args.tokens.split(","):
            B, L = (int(x) for x in spec.split("x"))
            n = B * L
            codes = torch.randint(0, 256, (n, ROW), dtype=torch.uint8, device="cuda", generator=g)
            scale = torch.rand(n, NG, device="cuda", generator=g)
            ctas = 2
            grid = ctas * sms
            out = torch.empty(grid * 128, device="cuda")
            us = median_us(functools.partial(launch, fn, grid, [codes, scale, img, out, n // 64, 0, *order], smem))
            cyc = us * 1e-6 * clock_hz * sms / n
            rows.append({"variant": spec_v, "batch": B, "context": L, "ctas_per_sm": ctas, "us": us,
                         "cycles_per_token": cyc, "GBps": n * (ROW + 4 * NG) / (us * 1e-6) / 1e9})
            print(f"{name} B={B} L={L} grid {ctas}/SM: {us:.1f} us, {cyc:.1f} SM cycles per "
                  f"token, {rows[-1]['GBps']:.0f} GB/s", flush=True)
            del codes, scale
    meta = {"card": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "clock_hz": clock_hz, "sms": sms, "errors": errs, "order": order,
            "command": "python benchmarks/wgmma_scores_probe.py " + " ".join(sys.argv[1:])}
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    lines = [f"# wgmma scores probe ({meta['card']}, {meta['date'][:19]})", "",
             f"Command: `{meta['command']}`. Relative error against the fp64 reference per descriptor offset order "
             f"(leading/stride bytes): {', '.join(f'{k}: {v:.1e}' for k, v in errs.items())}. Cycles per token at "
             f"{clock_hz / 1e9:.2f} GHz x {sms} SMs; GB/s counts the codes and the fp32 scales.", "",
             "| variant (-D defines) | B | context | grid CTAs/SM | us | SM cycles / token | GB/s |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['batch']} | {r['context']} | {r['ctas_per_sm']} | {r['us']:.1f} | "
              f"{r['cycles_per_token']:.1f} | {r['GBps']:.0f} |" for r in rows]
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
