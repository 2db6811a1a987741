"""`quantmla calibrate --budget` against the fixed formats, at the demo's sizes (issue 10, item 4).

For each row: calibrate the default model (or --model) on the built-in text, then measure the KL to BF16 on
held-out windows (the demo's protocol: 512 tokens, last 128 scored, sink 4 + recent 128) and the cache's
measured bytes at the evaluated length and at 128 K. Rows: RTN at INT4/INT4, quantmla at each --fixed format
pair (default INT4/INT4, the fixed format the budget should beat in bytes), quantmla at each --budgets
fraction (formats chosen per path and layer).

    python benchmarks/budget.py [--budgets 0.27,0.25] [--fixed int4/int4,int2/int4] [--samples 16 --steps 40]

Writes budget.{json,md} to --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import time
from pathlib import Path

import torch

from quantmla.calibrate.budget import choose_formats
from quantmla.calibrate.driver import calibrate_model, chosen_config
from quantmla.config import CacheConfig
from quantmla.data import encode, read_text, resolve_model_dir, token_windows, tokenizer_for
from quantmla.eval import perplexity
from quantmla.eval.suite import LONG_CONTEXT, heldout_windows, measure_bytes_per_token
from quantmla.models import describe, load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--budgets", default="0.27")
    p.add_argument("--fixed", default="int4/int4", help="fixed content/rope formats calibrated as quantmla rows, "
                   "comma-separated (e.g. int4/int4,int2/int4)")
    p.add_argument("--samples", type=int, default=16, help="calibration sequences of 512 tokens")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    model_dir = resolve_model_dir(a.model)
    tokenizer = tokenizer_for(model_dir)
    model = load_model(model_dir)
    layers = describe(model)
    dc, dr = layers[0].kv_lora_rank, layers[0].rope_dim
    calib = token_windows(encode(read_text(None), tokenizer, model.config.vocab_size), 512, a.samples)
    windows = heldout_windows(tokenizer, model.config.vocab_size, 512, a.windows)
    base = CacheConfig("int4", "int4", 4, 128).fit(dc, dr)

    def row(label, test_model, cfg, seconds):
        stats = perplexity.ppl_kl(perplexity.window_stats(test_model, windows, 128, cfg, model, batch=8,
                                                          progress=False))
        r = {"label": label, "formats": [list(map(str, pair)) for pair in cfg.per_layer], "kl": stats["kl"],
             "ppl": stats["ppl"], "bytes_512": measure_bytes_per_token(cfg, dc, dr, 512),
             "bytes_128k": measure_bytes_per_token(cfg, dc, dr, LONG_CONTEXT), "bf16": 2 * (dc + dr),
             "seconds": seconds}
        print(r, flush=True)
        return r

    rows = [row("rtn int4/int4", model, base, 0.0)]
    fixed = [CacheConfig(*pair.split("/"), 4, 128).fit(dc, dr) for pair in a.fixed.split(",") if pair]
    plans = ([(f"quantmla {f.content}/{f.rope}", f) for f in fixed]
             + [(f"quantmla --budget {b}", float(b)) for b in a.budgets.split(",") if b])
    for label, plan in plans:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        calibrated = copy.deepcopy(model)
        cfg = plan if isinstance(plan, CacheConfig) else choose_formats(model, layers, calib, base, plan).config
        reports = calibrate_model(calibrated, layers, calib, cfg, a.steps, 0, progress=False)
        rows.append(row(label, calibrated, chosen_config(cfg, reports), time.perf_counter() - t0))
    result = {"model": model_dir.name, "budgets": a.budgets, "fixed": a.fixed, "date": str(datetime.date.today()), "machine": f"CPU {platform.machine()}",
              "samples": a.samples, "steps": a.steps, "windows": a.windows, "rows": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "budget.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# Byte budget vs fixed formats", "",
             f"{result['date']}, {result['machine']}; model `{model_dir.name}`; calibration {a.samples} x 512 tokens "
             f"of the built-in text, {a.steps} steps per path; KL to BF16 on {a.windows} held-out windows of 512 "
             "tokens (last 128 scored), sink 4 + recent 128 BF16. Bytes per token and layer measured from the "
             f"cache at 512 and at {LONG_CONTEXT} tokens. Command: `python benchmarks/budget.py --budgets "
             f"{a.budgets} --fixed {a.fixed} --samples {a.samples} --steps {a.steps} --windows {a.windows}`.", "",
             "| method | B/token @512 | B/token @128K | % of BF16 @128K | KL | ppl | formats (content/rope, layer 0..) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['bytes_512']:.1f} | {r['bytes_128k']:.1f} | "
                     f"{100 * r['bytes_128k'] / r['bf16']:.2f} | {r['kl']:.3e} | {r['ppl']:.4f} | "
                     f"{', '.join('/'.join(f) for f in r['formats'])} |")
    (out / "budget.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
