"""How much of each layer's content latent a ranked format can drop: the energy spectrum of c.

    PYTHONPATH=src python benchmarks/latent_spectrum.py [--model DIR] --out OUT     (CPU, seconds)

Per MLA layer, on calibration windows of the built-in text: the eigenvalues of the second moment E[c c^T]
of the cached content latent (c as the model caches it, kv_a_layernorm and latent scale applied), and
- the fraction of the energy in the leading 64 / 128 / 256 principal axes (what int8r64 / r128 / r256 keep),
- the effective rank exp(entropy of the normalised eigenvalues),
- the gain of ideal transform coding over spreading the bits evenly (arithmetic over geometric mean of the
  eigenvalues, floored at 1e-12 of the largest): 1 for a flat spectrum, large where few axes carry the signal.
The same for k_pe (RoPE keys) for comparison, though a ranked format is offered for the content path only
(RoPE's pairs cannot be rotated into principal axes: the rotation must commute with RoPE).
Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from quantmla.capture import capture
from quantmla.data import encode, read_text, resolve_model_dir, token_windows, tokenizer_for
from quantmla.models import describe, load_model

KEEP = (64, 128, 256)


def spectrum_stats(x: torch.Tensor) -> dict:
    """x [..., d]: energy fractions of the leading principal axes, effective rank, AM/GM of the spectrum."""
    flat = x.double().reshape(-1, x.shape[-1])
    ev = torch.linalg.eigvalsh(flat.T @ flat / flat.shape[0]).flip(0).clamp_min(0)
    p = ev / ev.sum()
    floored = ev.clamp_min(ev[0] * 1e-12)
    return {
        "dim": x.shape[-1],
        "keep": {k: float(p[:k].sum()) for k in KEEP if k < x.shape[-1]},
        "effective_rank": float(torch.exp(-(p[p > 0] * p[p > 0].log()).sum())),
        "am_over_gm": float(floored.mean() / floored.log().mean().exp()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: the shipped default model)")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--out", required=True, help="output path without extension")
    args = ap.parse_args()
    md = resolve_model_dir(args.model)
    tok, model = tokenizer_for(md), load_model(md)
    layers = describe(model)
    ids = token_windows(encode(read_text(None), tok, model.config.vocab_size), args.length, args.samples)
    store = capture(model, layers, ids)
    rows = [{"layer": layer.cache_idx, "content": spectrum_stats(store[layer.cache_idx].c),
             "rope": spectrum_stats(store[layer.cache_idx].k_pe)} for layer in layers]
    result = {"model": str(md), "tokens": list(ids.shape), "date": time.strftime("%Y-%m-%d"), "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    keep = [k for k in KEEP if k < layers[0].kv_lora_rank]
    command = "PYTHONPATH=src python benchmarks/latent_spectrum.py" + "".join(f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v != ap.get_default(k))
    lines = [f"# Content-latent spectrum: {md.name}", "",
             f"`{command} --out {args.out}`, {ids.shape[0]} x {ids.shape[1]} tokens of the built-in calibration "
             f"text, {result['date']}, CPU. Energy: share of E[|c|^2] in the leading principal axes.",
             "",
             "| layer | " + " | ".join(f"content energy in {k} axes" for k in keep)
             + " | content effective rank | content AM/GM | k_pe effective rank | k_pe AM/GM |",
             "|---:|" + "---:|" * (len(keep) + 4)]
    for r in rows:
        c, k = r["content"], r["rope"]
        lines.append(f"| {r['layer']} | " + " | ".join(f"{100 * c['keep'][n]:.3f} %" for n in keep)
                     + f" | {c['effective_rank']:.1f} of {c['dim']} | {c['am_over_gm']:.3g} | "
                     f"{k['effective_rank']:.1f} of {k['dim']} | {k['am_over_gm']:.3g} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
