"""Probe for a 16-head decode kernel: the values half alone, with wgmma, the codes as register A operands and
each group's scale folded into P (the other half: wgmma_scores_probe.py).

    PYTHONPATH=src python benchmarks/wgmma_values_probe.py [--variants ring2=RING:2 pmn=RING:2,PMN:1]
        [--out benchmarks/results]

Builds `wgmma_values_probe.cu` for sm_90a (once per variant: NAME=MACRO:VALUE,... -D defines, e.g. RING, PMN,
LBO, SBO), checks O [16 heads, 512] against an fp64
reference on random int4 codes, P and scales (P * scale rounded to fp16 as the kernel does), then times it over
B * L tokens and reports SM cycles per token (at the card's maximum clock). The input is the codes
byte-transposed within each 64-token tile (what the kernel's A fragments want; the cache stores rows), plus P
and scales in fp32. Not included: the zero term, the softmax, the scores. Writes wgmma_values_probe.{json,md} (--name changes the stem).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from wgmma_scores_probe import build, launch, load, median_us, parse_variant  # noqa: E402

SRC = os.path.join(os.path.dirname(__file__), "wgmma_values_probe.cu")
NGC, H = 8, 16
TILE_BYTES = NGC * 32 * 64


def smem_bytes(ring: int) -> int:
    return ring * (TILE_BYTES + 64 * H * 4 + 64 * NGC * 4) + 2 * NGC * 4 * 512


def transpose_tiles(codes: torch.Tensor) -> torch.Tensor:
    """codes [tokens, 256] (row layout: group g's byte b holds channels 64 g + 2 b, + 1) -> [tiles, 8, 32, 64]."""
    return codes.reshape(-1, 64, NGC, 32).permute(0, 2, 3, 1).contiguous()


def reference(codes: torch.Tensor, p: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """O [16, 512] = sum_t fp16(P[t, h] * scale[t, g(c)]) * code[t, c]."""
    c = torch.stack([codes & 15, codes >> 4], -1).reshape(codes.shape[0], NGC, 64).double()
    pp = (p[:, None, :] * scale[:, :, None]).to(torch.float16).double()  # [t, g, h]
    return torch.einsum("tgc,tgh->hgc", c, pp).reshape(H, 512)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["ring2=RING:2", "pmn=RING:2,PMN:1"],
                    help="NAME=MACRO:VALUE,... (the .cu's -D defines)")
    ap.add_argument("--name", default="wgmma_values_probe", help="results file stem")
    ap.add_argument("--tokens", default="16x16384,16x65536,64x65536", help="comma list of BxL")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("wgmma_values_probe.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    torch.empty(1, device="cuda")
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    clock_hz = props.clock_rate * 1e3 if hasattr(props, "clock_rate") else 1.98e9
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, errs = [], {}
    for spec_v in args.variants:
        name, defines = parse_variant(spec_v)
        smem = smem_bytes(defines.setdefault("RING", 3))
        fn = load(build(defines, SRC), b"values_probe", smem)
        n, grid = 64 * 64, 8
        codes = torch.randint(0, 256, (n, NGC * 32), dtype=torch.uint8, device="cuda", generator=g)
        p = torch.rand(n, H, device="cuda", generator=g)
        scale = torch.rand(n, NGC, device="cuda", generator=g) * 0.1 + 0.01
        out = torch.zeros(grid, H, 512, device="cuda")
        launch(fn, grid, [transpose_tiles(codes), p, scale, out, n // 64], smem)
        torch.cuda.synchronize()
        want = reference(codes.cpu(), p.cpu(), scale.cpu())
        got = out.sum(0).cpu().double()
        err = ((got - want).norm() / want.norm()).item()
        errs[name] = err
        print(f"{name}: relative error {err:.2e}", flush=True)
        if err > 1e-3:
            continue
        for spec in args.tokens.split(","):
            B, L = (int(x) for x in spec.split("x"))
            n = B * L
            vt = torch.randint(0, 256, (n // 64, NGC, 32, 64), dtype=torch.uint8, device="cuda", generator=g)
            p = torch.rand(n, H, device="cuda", generator=g)
            scale = torch.rand(n, NGC, device="cuda", generator=g)
            grid = 2 * sms
            out = torch.empty(grid, H, 512, device="cuda")
            us = median_us(functools.partial(launch, fn, grid, [vt, p, scale, out, n // 64], smem))
            cyc = us * 1e-6 * clock_hz * sms / n
            per_token = NGC * 32 + H * 4 + NGC * 4
            rows.append({"variant": spec_v, "batch": B, "context": L, "us": us, "cycles_per_token": cyc,
                         "GBps": n * per_token / (us * 1e-6) / 1e9})
            print(f"{name} B={B} L={L}: {us:.1f} us, {cyc:.1f} SM cycles per token, {rows[-1]['GBps']:.0f} GB/s",
                  flush=True)
            del vt, p, scale
    meta = {"card": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "clock_hz": clock_hz, "sms": sms, "errors": errs,
            "command": "python benchmarks/wgmma_values_probe.py " + " ".join(sys.argv[1:])}
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    lines = [f"# wgmma values probe ({meta['card']}, {meta['date'][:19]})", "",
             f"Command: `{meta['command']}`. Relative error against the fp64 reference: "
             f"{', '.join(f'{k}: {v:.1e}' for k, v in errs.items())}. Cycles per token at {clock_hz / 1e9:.2f} GHz "
             f"x {sms} SMs, 2 CTAs per SM; GB/s counts the codes (256 B), P (64 B) and the scales (32 B) per token.",
             "", "| variant (-D defines) | B | context | us | SM cycles / token | GB/s |", "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['batch']} | {r['context']} | {r['us']:.1f} | {r['cycles_per_token']:.1f} | "
              f"{r['GBps']:.0f} |" for r in rows]
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
