"""Which layer a RoPE format's end-to-end error comes from: one layer's RoPE path quantized at a time.

    PYTHONPATH=src python benchmarks/rope_format_by_layer.py [--model DIR] [--formats int4,int4:t64]
        [--length 2048] [--windows 3] [--scored 256] --out OUT      (CPU, about a minute per format)

For each format and each MLA layer, every other path of every layer stays BF16 and that layer's RoPE keys are
stored in the format (sink 4 + recent 128 BF16, serving semantics: `quantmla.eval.serving`); the figure is the
mean next-token KL(BF16 || quantized) over the last `--scored` tokens of `--windows` held-out windows
(`quantmla.eval.perplexity`, as `quantmla eval` scores them). It
localizes a format whose mean positional QK error (`rope_token_axis.py`) and end-to-end KL disagree.
Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import torch

from quantmla.config import CacheConfig
from quantmla.data import resolve_model_dir, tokenizer_for
from quantmla.eval import perplexity
from quantmla.eval.suite import heldout_windows
from quantmla.models import describe, load_model


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the shipped default model)")
    ap.add_argument("--formats", default="int4,int4:t64", help="RoPE formats, comma-separated")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--scored", type=int, default=256, help="last tokens of each window scored")
    ap.add_argument("--out", required=True, help="output path without suffix")
    args = ap.parse_args()

    model_dir = resolve_model_dir(args.model)
    model = load_model(model_dir).eval()
    n = len(describe(model))
    batch = heldout_windows(tokenizer_for(model_dir), model.config.vocab_size, args.length, args.windows)
    rows = []
    with torch.no_grad():
        ref = perplexity.reference_logprobs(model, batch, args.scored)
        for fmt in args.formats.split(","):
            for layer in range(n):
                layers = [("bf16", fmt if i == layer else "bf16") for i in range(n)]
                cfg = CacheConfig("bf16", fmt, 4, 128, layers=layers)
                out = perplexity.score_window(model, batch, args.scored, cfg)
                rows.append({"format": fmt, "layer": layer, "kl": float(perplexity.kl(ref, out).mean())})
                print(f"{fmt:>10} layer {layer}: KL {rows[-1]['kl']:.3e}", flush=True)
    meta = {"model": model_dir.name, "date": datetime.date.today().isoformat(), "machine": platform.machine(),
            "command": "python benchmarks/rope_format_by_layer.py " + " ".join(
                f"--{k} {v}" for k, v in vars(args).items() if v is not None and k != "model"),
            "windows": [batch.shape[0], batch.shape[1]], "scored": args.scored}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    formats = args.formats.split(",")
    lines = [f"# RoPE format by layer: {meta['model']}", "",
             f"{meta['date']}, CPU {meta['machine']}; {batch.shape[0]} held-out windows of {batch.shape[1]} "
             f"tokens, last {args.scored} scored; `{meta['command']}`. KL(BF16 || quantized), nats per token, "
             "with one layer's RoPE path in the format and every other path BF16 (sink 4 + recent 128 BF16).", "",
             "| layer | " + " | ".join(formats) + " |", "|---:|" + "---:|" * len(formats)]
    for layer in range(n):
        lines.append(f"| {layer} | " + " | ".join(f"{r['kl']:.2e}" for f in formats for r in rows
                                                   if r["format"] == f and r["layer"] == layer) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
