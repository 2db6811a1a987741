"""A calibrated checkpoint: the transforms fused into the weights, plus a `quantmla` section in config.json.

The result is a plain Hugging Face checkpoint: `AutoModelForCausalLM.from_pretrained` loads it (a mistral4 one
`Mistral4ForCausalLM.from_pretrained`: transformers maps no auto class to it) and, with a BF16 cache, computes
the original model's function (the folds are exact). quantmla reads the section to
configure its cache:
    "quantmla": {"method": "quantmla", "content": "int4", "rope": "int4", "sink": 4, "recent": 128,
                 "layers": [["int4c0.9", "int4"], ...],   # only where the chosen formats differ by layer
                 "calibration": {"samples": .., "length": .., "steps": .., "seed": .., "source": ..}}
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from quantmla.config import CacheConfig
from quantmla.models.adapters import read_config_json

SECTION = "quantmla"
# Files besides config and weights that make a checkpoint directory usable on its own (glob patterns, top level).
# transformers 5 keeps a tokenizer's chat template in chat_template.jinja, not in tokenizer_config.json (`quantmla
# serve` formats chats with it). Kimi K2's tokenizer is its own code (tokenization_kimi.py, named by
# tokenizer_config.json's auto_map) over tiktoken.model: quantmla never runs it, but transformers and vLLM
# users load it with trust_remote_code. A model's licence goes with a derivative of its weights.
_COPY = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
         "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
         "tiktoken.model", "*.tiktoken", "tokenization_*.py", "LICENSE*")


def _copied(folder: Path) -> list[Path]:
    """The files of `folder` that `_COPY` names."""
    return sorted({f for pattern in _COPY for f in folder.glob(pattern) if f.is_file()})


def save_calibrated(model, out_dir: str | Path, cfg: CacheConfig, calibration: dict, reports=(),
                    source_dir: str | Path | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write the folded `model` with a quantmla section: cfg with the formats `reports` chose
    (`driver.chosen_config`; cfg as given without reports)."""
    out_dir = Path(out_dir)
    with writing_checkpoint(out_dir):
        return _save_calibrated(model, out_dir, cfg, calibration, reports, source_dir, dtype)


def _save_calibrated(model, out_dir: Path, cfg: CacheConfig, calibration: dict, reports, source_dir, dtype) -> Path:
    mark_calibrated(model.config, cfg, calibration, reports)
    if dtype is not None:
        kept = {name: t for name, t in (*model.named_parameters(), *model.named_buffers())
                if stored_dtype(model, name, dtype) != dtype}
        model = model.to(dtype)
        for name, t in kept.items():  # the float32 tensors from before the cast
            owner, _, leaf = name.rpartition(".")
            getattr(model.get_submodule(owner), leaf).data = t
    # A source's generation_config.json is copied as it is (finish_checkpoint). save_pretrained would write the
    # loaded one, and refuses one that transformers only warns about on loading (sampling settings beside
    # do_sample false): that failed after the whole calibration. It saves a blank one instead, replaced.
    from transformers import GenerationConfig

    own = model.generation_config
    if source_dir is not None and (Path(source_dir) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig()
    try:
        model.save_pretrained(out_dir)
    finally:
        model.generation_config = own
    return finish_checkpoint(out_dir, reports, source_dir)


def stored_dtype(model, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype tensor `name` of `model` is written in, in a checkpoint of `dtype`: float32 where transformers
    computes with it in float32 when loading in dtype (`_keep_in_fp32_modules_strict`, e.g. DeepSeek-V3's and
    GLM's router bias e_score_correction_bias; `_keep_in_fp32_modules` in float16 only), as its save_pretrained
    writes it. Rounded to BF16, that bias flipped expert choices near a tie: the output computed another
    function."""
    keep = set()
    if dtype in (torch.float16, torch.bfloat16):
        keep |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    parts = name.split(".")
    hit = any(parts[i : i + len(k.split("."))] == k.split(".") for k in keep for i in range(len(parts)))
    return torch.float32 if hit else dtype


@contextmanager
def writing_checkpoint(out_dir: Path):
    """Create out_dir and clear an earlier checkpoint's files from it (`clear_checkpoint`) for a checkpoint
    written inside; if that raises or is interrupted, remove what it wrote (and out_dir, if created here and
    left empty). A partial checkpoint is of no use (there is no resuming), filled the disk (a large model's
    shards) and, as a non-empty --out, made `calibrate` refuse the next run unless --overwrite."""
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    clear_checkpoint(out_dir)
    try:
        yield
    except BaseException:
        clear_checkpoint(out_dir)
        if created and not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise


def clear_checkpoint(out_dir: Path) -> None:
    """Remove an earlier checkpoint's files from out_dir (`calibrate --overwrite`) before writing a new one. What
    save_pretrained leaves would outlive it: a sharded checkpoint's index beside the new single
    model.safetensors (readers of the index, the streaming reader and vLLM, then look for shards that are
    gone), and tokenizer files that `finish_checkpoint` would keep instead of copying the source's."""
    for name in ("config.json", "calibration_report.json", "model.safetensors.index.json"):
        (out_dir / name).unlink(missing_ok=True)
    for stale in _copied(out_dir):
        stale.unlink()
    for stale in out_dir.glob("model*.safetensors"):
        stale.unlink()


def mark_calibrated(config, cfg: CacheConfig, calibration: dict, reports=()) -> None:
    """Put the quantmla section on the output's `config`, and set num_nextn_predict_layers to 0: the
    multi-token-prediction layers are not written (transformers does not load them), and a reader that
    trusts the count (vLLM's MTP speculative decoding) would look for weights the checkpoint lacks.
    Drop an `auto_map` (DeepSeek-V3's names its own modeling code): the code files are not copied, so
    trust_remote_code=True, as its card and vLLM users load it, failed on the missing files; the folded
    weights are checked against transformers' own classes, which load the checkpoint without it."""
    setattr(config, SECTION, section(cfg, calibration, reports))
    if getattr(config, "num_nextn_predict_layers", 0):
        config.num_nextn_predict_layers = 0
    if hasattr(config, "auto_map"):
        del config.auto_map


def section(cfg: CacheConfig, calibration: dict, reports=()) -> dict:
    """The config.json section: the cache config to serve with (the chosen formats) and how it was made."""
    from quantmla.calibrate.driver import chosen_config  # the driver imports the objectives; export stays light

    return {"method": "quantmla", **(chosen_config(cfg, reports) if reports else cfg).to_dict(),
            "calibration": calibration}


def finish_checkpoint(out_dir: Path, reports=(), source_dir: str | Path | None = None) -> Path:
    """Copy the source's tokenizer files and write calibration_report.json next to the weights."""
    if source_dir is not None:
        for src in _copied(Path(source_dir)):  # over the generation_config.json save_pretrained wrote
            shutil.copy(src, out_dir / src.name)
    (out_dir / "calibration_report.json").write_text(
        json.dumps([asdict(r) for r in reports], indent=1) + "\n")
    return out_dir


_FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def source_dtype(model_dir: str | Path) -> torch.dtype:
    """The dtype `calibrate --dtype auto` writes: the checkpoint's config.json's (`dtype`, or the older
    `torch_dtype`), else the one most of its stored floating tensors have, as transformers' dtype="auto"
    falls back to the weights (a BF16 checkpoint whose config names none was written in float32), else
    float32."""
    from collections import Counter

    from safetensors import safe_open

    config = read_config_json(model_dir)
    name = config.get("dtype") or config.get("torch_dtype")
    if name:
        return getattr(torch, name)
    seen = Counter()
    for file in sorted(Path(model_dir).glob("*.safetensors")):  # headers only
        with safe_open(file, "pt") as f:
            seen.update(_FLOAT_DTYPES.get(f.get_slice(k).get_dtype()) for k in f.keys())
    seen.pop(None, None)
    return seen.most_common(1)[0][0] if seen else torch.float32


def quantmla_section(model_dir: str | Path) -> dict | None:
    """The checkpoint's quantmla section, or None for an uncalibrated checkpoint. A section quantmla did not write
    (edited, or another tool's) is a ValueError naming config.json: its readers raised a KeyError, TypeError or
    AttributeError."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    section = read_config_json(model_dir).get(SECTION)
    if section is not None and not (isinstance(section, dict) and {"content", "rope"} <= set(section)):
        raise ValueError(f"{path}: its {SECTION} section is not one quantmla writes (an object with content and rope "
                         f"formats): {json.dumps(section)[:80]}; remove it, or calibrate the original checkpoint again")
    return section


def cache_config_of(model_dir: str | Path) -> CacheConfig | None:
    section = quantmla_section(model_dir)
    if not section:
        return None
    try:
        return CacheConfig.from_dict(section)
    except (ValueError, TypeError) as e:  # a format quantmla does not know: say where it is written
        raise ValueError(f"{Path(model_dir) / 'config.json'}: its {SECTION} section does not hold a cache "
                         f"configuration: {e}") from None
