"""Does a learnt RoPE center (`quantmla calibrate --center`) still help at long context? KL of the default
model at INT4/INT4 with and without it, at 1 K and 8 K tokens, on the CPU.

    python benchmarks/centering_long.py [--out benchmarks/results/centering_long_cpu]

Calibration is short (4 x 512 tokens, 10 steps per path; both rows alike), KL under serving semantics (sink 4 +
last 128 keys BF16) on held-out windows (3 of 1024 and 1 of 8192 tokens, last 256 scored), against the BF16
model. Writes OUT.{json,md}.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import time
from pathlib import Path

import torch

from quantmla.calibrate.driver import calibrate_model, chosen_config
from quantmla.config import CacheConfig
from quantmla.data import default_model_dir, encode, read_text, token_windows, tokenizer_for
from quantmla.eval import perplexity
from quantmla.eval.baselines import calibration_ids
from quantmla.models import load_model
from quantmla.models.adapters import describe

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(RESULTS / "centering_long_cpu"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    base = load_model(default_model_dir())
    ids = calibration_ids(base, 4, 512)
    held = encode(read_text(None, "heldout.txt"), tokenizer_for(default_model_dir()), 40000)
    sets = {1024: token_windows(held, 1024, 3), 8192: token_windows(held, 8192, 1)}
    refs = {n: perplexity.score_window(base, w, 256, CacheConfig.bf16()) for n, w in sets.items()}
    rows, start = [], time.time()
    for center in (False, True):
        model = copy.deepcopy(base)
        cfg = CacheConfig("int4", "int4", 4, 128).fit(512, 64)
        served = chosen_config(cfg, calibrate_model(model, describe(model), ids, cfg, steps=10, progress=False,
                                                    center=center))
        for n, w in sets.items():
            kl = perplexity.kl(refs[n], perplexity.score_window(model, w, 256, served)).mean().item()
            rows.append({"center": center, "length": n, "kl": kl})
            print(rows[-1], flush=True)
    meta = {"date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "python benchmarks/centering_long.py", "seconds": time.time() - start, "rows": rows}
    Path(a.out).with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    kl = {(r["center"], r["length"]): r["kl"] for r in rows}
    lines = ["# RoPE center at long context (default model, INT4/INT4, CPU)", "",
             f"{meta['date_utc']}; `{meta['command']}`; see the script's docstring for the protocol.", "",
             "| tokens | KL, no center | KL, center | center / none |", "|---:|---:|---:|---:|"]
    for n in sets:
        lines.append(f"| {n} | {kl[False, n]:.2e} | {kl[True, n]:.2e} | {kl[True, n] / kl[False, n]:.2f} |")
    Path(a.out).with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
