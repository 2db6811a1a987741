"""Static centering of the cached paths, measured before it is a method: each method's KL when every cached
content latent c (RoPE key k_pe) has a fixed per-layer vector mu subtracted before it is quantized.

    python benchmarks/centering.py                                   # default model, ~15 CPU min
    python benchmarks/centering.py --model models/quantmla-mla-v2-moe --out benchmarks/results/centering_v2_moe

Why a center costs no accuracy and no bytes: if the cache stores x - mu for every token (BF16 and quantized
alike), every score of one query shifts by the same amount (q_pe . mu_rope, or absorbed q . mu_content), which
softmax ignores; on the content path the attention output, a convex combination of the stored values, shifts
by -mu_content, which one vector add after attention puts back. The cache holds (512 + 64) more values per
layer, not per token. Here that cache is simulated by storing Q(x - mu) + mu for the quantized tokens (the
same attention), in the evaluation's serving forward (`quantmla.eval.serving.stored_values`).

mu per layer and path: the mean over --cal-windows calibration windows (`quantmla/data/calibration.txt`,
positions from the sink on) of the path as the method's model writes it (its folded transform applied).
quantmla rows are calibrated as `quantmla calibrate` does, without knowing about the center: the gain a
center-aware search reaches is not measured here. KL: next-token KL(BF16 || method) under serving semantics
(sink 4 + last 128 keys BF16) on held-out windows, as benchmarks/eval_methods.py. Writes OUT.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from quantmla.data import encode, read_text, resolve_model_dir, token_windows, tokenizer_for
from quantmla.eval import perplexity, serving
from quantmla.eval.methods import MethodArgs, apply_method
from quantmla.eval.suite import heldout_windows
from quantmla.models import load_model

RESULTS = Path(__file__).resolve().parent / "results"
SINK, RECENT = 4, 128
VARIANTS = {"none": (), "rope": ("rope",), "content": ("content",), "both": ("content", "rope")}


@contextmanager
def patched_stored_values(fn):
    original = serving.stored_values
    serving.stored_values = fn(original)
    try:
        yield
    finally:
        serving.stored_values = original


def path_means(model, cfg, windows: torch.Tensor) -> dict[str, torch.Tensor]:
    """{'layer i content' | 'layer i rope': mean over windows and positions >= SINK} of what the cache stores."""
    sums: dict[str, list[torch.Tensor]] = {}

    def recording(original):
        def fn(x, fmt, config, what, rotation=None):
            sums.setdefault(what, []).append(x[:, SINK:].float().mean(dim=(0, 1)))
            return original(x, fmt, config, what, rotation)
        return fn

    with patched_stored_values(recording), torch.no_grad():
        perplexity.score_window(model, windows, 1, cfg)
    return {what: torch.stack(v).mean(0) for what, v in sums.items()}


def centered_kl(model, cfg, windows, ref_lp, scored: int, means: dict, paths: tuple[str, ...]) -> float:
    def centering(original):
        def fn(x, fmt, config, what, rotation=None):
            if not any(what.endswith(p) for p in paths):
                return original(x, fmt, config, what, rotation)
            mu = means[what].to(x.dtype)
            return original(x - mu, fmt, config, what, rotation) + mu
        return fn

    with patched_stored_values(centering):
        lp = perplexity.score_window(model, windows, scored, cfg)
    return perplexity.kl(ref_lp, lp).mean().item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the shipped default model)")
    ap.add_argument("--methods", default="rtn@int4/int4,kivi@int4/int4,quantmla@int4/int4,rtn@int2/int4,"
                                         "quantmla@int2/int4", help="comma-separated METHOD@CONTENT/ROPE")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=12, help="held-out windows scored")
    ap.add_argument("--scored", type=int, default=256)
    ap.add_argument("--cal-windows", type=int, default=4, help="calibration windows the centers are taken from")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "centering"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    model_dir = resolve_model_dir(a.model)
    tok, ref = tokenizer_for(model_dir), load_model(model_dir)
    vocab = ref.config.vocab_size
    windows = heldout_windows(tok, vocab, a.length, a.windows)
    cal = token_windows(encode(read_text(None), tok, vocab), a.length, a.cal_windows)
    ref_lp = perplexity.reference_logprobs(ref, windows, a.scored)
    rows = []
    for spec in a.methods.split(","):
        t0 = time.perf_counter()
        name, formats = spec.split("@")
        content, rope = formats.split("/")
        model, cfg = apply_method(name, ref, MethodArgs(content, rope, SINK, RECENT))
        means = path_means(model, cfg, cal)
        row = {"method": spec, "content_format": "|".join(str(c) for c, _ in cfg.per_layer),
               "rope_format": "|".join(str(r) for _, r in cfg.per_layer),
               "center_norms": {what: round(v.norm().item(), 3) for what, v in means.items()}}
        for variant, paths in VARIANTS.items():
            row[variant] = centered_kl(model, cfg, windows, ref_lp, a.scored, means, paths)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print({k: v for k, v in row.items() if k != "center_norms"}, flush=True)
    meta = {"date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "device": f"CPU ({platform.machine()}), {a.threads} thread(s)", "model": str(model_dir),
            "command": "python benchmarks/centering.py" + "".join(f" --{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "out" and v != ap.get_default(k)),
            "length": a.length, "windows": a.windows, "scored": a.scored, "cal_windows": a.cal_windows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{a.out}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    lines = ["# Static centering of the cached paths", "",
             f"{meta['date_utc']}; {meta['device']}; `{meta['command']}`; model `{model_dir.name}`; KL on "
             f"{a.windows} held-out windows of {a.length} tokens, last {a.scored} scored, serving semantics (sink "
             f"{SINK} + last {RECENT} keys BF16); centers from {a.cal_windows} calibration windows of {a.length}. "
             "Columns: mean next-token KL(BF16 || method) with no center, the RoPE path centered, the content "
             "path centered, both. Same bytes in every column (the centers are per layer, not per token); the "
             "module docstring says why a center is exact.", "",
             "| method | content | rope | none | rope | content | both | both / none |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [r["content_format"].replace("|", "\\|"), r["rope_format"].replace("|", "\\|")]  # per layer
        lines.append(f"| {r['method']} | {cells[0]} | {cells[1]} | {r['none']:.2e} | {r['rope']:.2e} | "
                     f"{r['content']:.2e} | {r['both']:.2e} | {r['both'] / r['none']:.2f} |")
    Path(f"{a.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
