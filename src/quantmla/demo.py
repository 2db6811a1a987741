"""The README's main job, end to end on one model: calibrate, write the fused checkpoint, then compare a BF16
cache, plain round-to-nearest and quantmla at the same INT4/INT4 format (and RTN vs quantmla at INT2/INT4).

Every number it prints comes from the same code as `quantmla calibrate` and `quantmla eval`; it only
chooses settings small enough for a few minutes on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from quantmla.calibrate.driver import calibrate_model
from quantmla.calibrate.export import save_calibrated
from quantmla.config import CacheConfig
from quantmla.data import encode, read_text, token_windows, tokenizer_for
from quantmla.eval.methods import MethodArgs
from quantmla.eval.suite import EvalResult, EvalSettings, evaluate
from quantmla.models import describe, load_model


@dataclass(frozen=True)
class DemoSettings:
    formats: tuple[tuple[str, str], ...] = (("int4", "int4"), ("int2", "int4"))
    calib_samples: int = 8
    calib_length: int = 512
    calib_steps: int = 40
    sink: int = 4
    recent: int = 128
    eval: EvalSettings = EvalSettings(lengths=(512,), samples=16, windows=64, scored=128, batch=8)
    seed: int = 0


def run_demo(model_dir: Path, out_dir: Path, settings: DemoSettings = DemoSettings(), log=print
             ) -> list[tuple[str, EvalResult]]:
    """Returns [(label, result)] in table order: bf16, then rtn and quantmla for each format pair."""
    torch.manual_seed(settings.seed)
    tokenizer = tokenizer_for(model_dir)
    model = load_model(model_dir)
    layers = describe(model)
    log("BF16 ...")
    rows = [("bf16", evaluate(model, tokenizer, "bf16", MethodArgs(), settings.eval))]
    calib = token_windows(encode(read_text(None), tokenizer, model.config.vocab_size),
                          settings.calib_length, settings.calib_samples)
    for content, rope in settings.formats:
        args = MethodArgs(content, rope, settings.sink, settings.recent)
        log(f"RTN {content}/{rope} ...")
        rows.append((f"rtn {content}/{rope}", evaluate(model, tokenizer, "rtn", args, settings.eval)))
        log(f"calibrating quantmla {content}/{rope} ({settings.calib_samples} x {settings.calib_length} tokens) ...")
        calibrated = load_model(model_dir)
        cfg = CacheConfig(content, rope, settings.sink, settings.recent).fit(layers[0].kv_lora_rank,
                                                                             layers[0].rope_dim)
        reports = calibrate_model(calibrated, layers, calib, cfg, settings.calib_steps, settings.seed)
        path = save_calibrated(calibrated, out_dir / f"quantmla-{content}-{rope}", cfg,
                               {"samples": settings.calib_samples, "length": settings.calib_length,
                                "steps": settings.calib_steps, "seed": settings.seed, "source": str(model_dir)},
                               reports, model_dir, torch.float32)
        log(f"wrote {path}; evaluating it ...")
        fused = load_model(path)
        rows.append((f"quantmla {content}/{rope}",
                     evaluate(fused, tokenizer, "quantmla", MethodArgs(), settings.eval, reference_model=model)))
    return rows
