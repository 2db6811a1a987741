"""How far the byte budget's common currency (attention-output NMSE, summed over paths and layers) is from the
model's output error.

    PYTHONPATH=src python benchmarks/budget_sensitivity.py [--model DIR] --out OUT.json   (CPU: ~6-15 min)

Per (layer, path, candidate format): the RTN NMSE that `calibrate.budget.format_errors` scores, and the
next-token KL to BF16 with only that path of that layer quantized (RTN, serving semantics, `eval.serving`),
both on the fit + select calibration sequences (16 x 512 tokens of the built-in text, as benchmarks/budget.py),
the KL at positions from sink + 2 * recent on (where format_errors draws its queries). The KL's reference is a
plain forward, so it includes a small floor (reported as kl_bf16). Then the joint KL (every path of every
layer quantized) against the sum of the single-path KLs, for four uniform format pairs.
benchmarks/results/budget_sensitivity.{json,md} hold its output for both shipped models.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from quantmla.calibrate.budget import format_errors
from quantmla.calibrate.search import Splits
from quantmla.config import CacheConfig, QuantFormat
from quantmla.data import encode, read_text, resolve_model_dir, token_windows, tokenizer_for
from quantmla.eval import perplexity
from quantmla.eval.serving import serving_logits
from quantmla.models import describe, load_model

BF16 = QuantFormat("bf16")
JOINT = ("int4/int4", "int2/int4", "int2/int2", "int4/int2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: the shipped default model)")
    ap.add_argument("--out", required=True, help="results JSON")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # before the minutes of work, not after
    torch.set_num_threads(args.threads)
    md = resolve_model_dir(args.model)
    tok, model = tokenizer_for(md), load_model(md)
    layers = describe(model)
    dc, dr = layers[0].kv_lora_rank, layers[0].rope_dim
    calib = token_windows(encode(read_text(None), tok, model.config.vocab_size), 512, 16)
    base = CacheConfig("int4", "int4", 4, 128).fit(dc, dr)
    errors = format_errors(model, layers, calib, base)
    split = Splits.of(calib.shape[0])
    ids = calib[split.fit.start : split.select.stop]
    rows = torch.arange(base.sink + 2 * base.recent - 1, ids.shape[1] - 1)
    with torch.no_grad():
        ref = F.log_softmax(model(ids, use_cache=False).logits[:, rows].float(), -1)

    def kl_of(cfg: CacheConfig) -> float:
        with torch.no_grad():
            lp = F.log_softmax(serving_logits(model, ids, cfg, rows).float(), -1)
        return perplexity.kl(ref, lp).mean().item()

    position = {layer.cache_idx: i for i, layer in enumerate(layers)}  # errors are keyed by cache index

    def only(layer: int, path: str, fmt: QuantFormat) -> CacheConfig:
        pairs = [(BF16, BF16)] * len(layers)
        pairs[position[layer]] = (fmt, BF16) if path == "content" else (BF16, fmt)
        return replace(base, layers=tuple(pairs))

    t0 = time.perf_counter()
    res = {"model": md.name, "kl_bf16": kl_of(only(0, "content", BF16)), "rows": [], "joint": {}}
    single = {}
    for (layer, path), options in errors.items():
        for fmt, nmse in options.items():
            if fmt.kind == "bf16":
                continue
            kl = single[(layer, path, str(fmt))] = kl_of(only(layer, path, fmt))
            res["rows"].append({"layer": layer, "path": path, "format": str(fmt), "nmse": nmse, "kl": kl})
            print(f"layer {layer} {path:7s} {str(fmt):10s} nmse {nmse:.3e} kl {kl:.3e}", flush=True)
    for name in JOINT:
        c, r = (QuantFormat.parse(s) for s in name.split("/"))
        cfg = replace(base, layers=((c, r),) * len(layers)).fit(dc, dr)
        summed = sum(single[(layer.cache_idx, p, str(f))] for layer, pair in zip(layers, cfg.per_layer)
                     for p, f in zip(("content", "rope"), pair))  # fmt: skip
        res["joint"][name] = {"joint_kl": kl_of(cfg), "sum_single_kl": summed}
        print(name, res["joint"][name], flush=True)
    res["seconds"] = time.perf_counter() - t0
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
