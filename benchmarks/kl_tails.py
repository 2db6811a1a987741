"""How much of a mean KL a few tokens carry, per method, on the default model at one length.

    python benchmarks/kl_tails.py                  # 12 held-out windows of 2048, last 256 scored, ~10 CPU min

Rows: RTN and KIVI at INT4/INT4, then quantmla INT4/INT4 calibrated as `quantmla calibrate` does (8
sequences, 100 steps per path) on sequences of each --calib-lengths. Per row, the next-token KL(BF16 ||
method) under serving semantics per scored token: mean (what the accuracy tables report), median, largest,
and the share of the mean carried by the 5 largest tokens. Writes benchmarks/results/kl_tails.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import time
from pathlib import Path

import torch

from rope_judge import kl_terms

from quantmla.calibrate.driver import calibrate_model, chosen_config
from quantmla.config import CacheConfig
from quantmla.data import encode, read_text, resolve_model_dir, token_windows, tokenizer_for
from quantmla.eval import perplexity
from quantmla.eval.methods import MethodArgs, apply_method
from quantmla.eval.suite import heldout_windows
from quantmla.models import describe, load_model

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the shipped default model)")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument("--scored", type=int, default=256)
    ap.add_argument("--calib-lengths", default="512,2048")
    ap.add_argument("--out", default=str(RESULTS / "kl_tails"))
    a = ap.parse_args()
    model_dir = resolve_model_dir(a.model)
    tok, ref = tokenizer_for(model_dir), load_model(model_dir)
    layers, vocab = describe(ref), ref.config.vocab_size
    windows = heldout_windows(tok, vocab, a.length, a.windows)
    ref_lp = perplexity.reference_logprobs(ref, windows, a.scored)
    rows = []
    for name in ("rtn", "kivi"):
        model, cfg = apply_method(name, ref, MethodArgs("int4", "int4", 4, 128))
        rows.append({"method": name, "calib_length": None, "content": str(cfg.content), "rope": str(cfg.rope),
                     **kl_terms(ref, windows, ref_lp, model, cfg, a.scored)})
        print(rows[-1], flush=True)
    text = encode(read_text(None), tok, vocab)
    for length in (int(v) for v in a.calib_lengths.split(",")):
        t0 = time.perf_counter()
        model = load_model(model_dir)
        cfg = CacheConfig("int4", "int4", 4, 128).fit(layers[0].kv_lora_rank, layers[0].rope_dim)
        served = chosen_config(cfg, calibrate_model(model, layers, token_windows(text, length, 8), cfg, 100, 0,
                                                    progress=False))
        chosen = served.layers or ((served.content, served.rope),)
        rows.append({"method": "quantmla", "calib_length": length, "content": "|".join(str(c) for c, _ in chosen),
                     "rope": "|".join(str(r) for _, r in chosen),
                     **kl_terms(ref, windows, ref_lp, model, served, a.scored),
                     "seconds": time.perf_counter() - t0})
        print(rows[-1], flush=True)
    meta = {"date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "device": f"CPU ({platform.machine()}), {torch.get_num_threads()} thread(s)", "model": str(model_dir),
            "command": "python benchmarks/kl_tails.py" + "".join(f" --{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "out" and v != ap.get_default(k)), "length": a.length, "windows": a.windows, "scored": a.scored}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{a.out}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    lines = ["# KL tails per method", "", f"{meta['date_utc']}; {meta['device']}; `{meta['command']}`; model "
             f"`{model_dir.name}`; {a.windows} held-out windows of {a.length} tokens, last {a.scored} scored "
             f"({a.windows * a.scored} tokens), serving semantics (sink 4 + last 128 keys BF16).", "",
             "| method | calibrated on | content | rope | KL mean | median | max | top-5 share |",
             "|---|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        cells = [r["content"].replace("|", "\\|"), r["rope"].replace("|", "\\|")]  # per-layer formats
        lines.append(f"| {r['method']} | {r['calib_length'] or '-'} | {cells[0]} | {cells[1]} | {r['kl']:.2e} | "
                     f"{r['kl_median']:.2e} | {r['kl_max']:.3f} | {r['top5_share']:.2f} |")
    Path(f"{a.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
