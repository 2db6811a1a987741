"""Streaming calibration: a checkpoint larger than memory, one decoder layer's weights resident at a time.

The model is built as a skeleton whose parameters sit on the meta device (buffers such as RoPE's inv_freq
are real: they are computed, not stored). Everything outside the decoder layers (embeddings, final norm,
lm_head) is loaded from the safetensors shards up front; then `driver.calibrate_model` runs its usual
layer-by-layer loop with two hooks around each decoder layer i:

    before: read layer i's tensors from the shards (`safe_open`, lazily, through the checkpoint's
            model.safetensors.index.json or its single model.safetensors) into the skeleton
    after:  (the attentions are calibrated and folded) write layer i's tensors to its own output shard,
            then put the layer back on the meta device

so resident weights are the non-layer tensors plus one decoder layer (`StreamingResult.peak_weight_bytes`),
while activations stay those of one layer as in the in-memory path. The output is a sharded Hugging Face
checkpoint with the same tensor names as the source (MoE experts stay per-expert as in the checkpoint:
the folds never touch them, so they are copied through, cast to the output dtype) and the same `quantmla`
config section as `export.save_calibrated` writes; its weights equal the in-memory path's. Of a multimodal
checkpoint (`adapters.Multimodal`) only the language model is read, and written under the text causal LM's
names: the output is a text-only checkpoint of the text family, as the in-memory path writes.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from quantmla.calibrate.driver import calibrate_model
from quantmla.calibrate.space import SearchSpace
from quantmla.calibrate.export import (finish_checkpoint, mark_calibrated, source_dtype, stored_dtype,
                                      writing_checkpoint)
from quantmla.config import CacheConfig
from quantmla.models.adapters import (check_checkpoint_dir, check_safetensors, describe, load_config, multimodal,
                                      read_weight_map, renaming)

_EXPERT = re.compile(r"^(?P<pre>.*mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class ShardReader:
    """Lazy access to a checkpoint's tensors by name, across its safetensors shards."""

    def __init__(self, model_dir: str | Path):
        self.dir = check_checkpoint_dir(model_dir)
        if (names := read_weight_map(self.dir)) is not None:
            self.weight_map = names
            check_safetensors(sorted({self.dir / name for name in self.weight_map.values()}))  # before any work
        elif (self.dir / "model.safetensors").is_file():
            check_safetensors([self.dir / "model.safetensors"])
            with safe_open(self.dir / "model.safetensors", "pt") as f:
                self.weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"{self.dir} has neither model.safetensors.index.json nor model.safetensors "
                                    "(streaming calibration reads safetensors only)")

        self.stored: dict[str, str] = {}  # name -> the name it is stored under, where `rename`d

    def rename(self, names: dict[str, str]) -> None:
        """Read only the tensors `names` maps (stored name -> name), under their new names: a multimodal
        checkpoint's language model, under the causal LM's names (`Multimodal.text_names`)."""
        self.stored = {new: old for old, new in names.items()}
        self.weight_map = {new: self.weight_map[old] for old, new in names.items()}

    def keys_under(self, prefix: str) -> list[str]:
        return [k for k in self.weight_map if k.startswith(prefix)]

    def read(self, keys) -> dict[str, torch.Tensor]:
        """The named tensors, each shard opened once (only these tensors are read into memory)."""
        by_file: dict[str, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.weight_map[k], []).append(k)
        out = {}
        for name, ks in by_file.items():
            with safe_open(self.dir / name, "pt") as f:
                for k in ks:
                    out[k] = f.get_tensor(self.stored.get(k, k))
        return out

    @property
    def total_bytes(self) -> int:
        """The bytes of the tensors this reader reads (all of the checkpoint's, unless `rename`d)."""
        by_file: dict[str, list[str]] = {}
        for k, name in self.weight_map.items():
            by_file.setdefault(name, []).append(self.stored.get(k, k))
        total = 0
        for name, ks in by_file.items():
            with safe_open(self.dir / name, "pt") as f:
                for k in ks:
                    sl = f.get_slice(k)
                    n = 1
                    for d in sl.get_shape():
                        n *= d
                    total += n * _itemsize(sl.get_dtype())
        return total


def _itemsize(dtype: str) -> int:
    return {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}.get(dtype, 1)


@contextmanager
def _parameters_on_meta():
    """Modules built inside get their parameters on the meta device, their buffers on the CPU."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def skeleton(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    """The model of `model_dir` with every parameter on the meta device (no weights read)."""
    from transformers import AutoModelForCausalLM

    config = load_config(model_dir)
    config._attn_implementation = "eager"
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _to_model_names(tensors: dict[str, torch.Tensor], rename) -> dict[str, torch.Tensor]:
    """Checkpoint names -> module names: `rename`d (`renaming`), and per-expert projections become
    transformers' fused expert tensors (gate_up_proj = cat(stack(gate), stack(up), dim 1), down_proj =
    stack(down)), as its loader does."""
    out, experts = {}, {}
    for k, v in tensors.items():
        m = _EXPERT.match(k)
        if m is None:
            out[rename(k)] = v
        else:
            experts.setdefault(m["pre"], {}).setdefault(m["proj"], {})[int(m["e"])] = v
    for pre, projs in experts.items():
        stack = {p: torch.stack([d[e] for e in sorted(d)]) for p, d in projs.items()}
        out[f"{pre}.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        out[f"{pre}.down_proj"] = stack["down_proj"]
    return out


def _check_shapes(module: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Refuse, by name, a tensor of another shape than the module built from config.json has (load_state_dict
    would raise a multi-line error for it, even with strict=False)."""
    expected = module.state_dict()
    for k, v in tensors.items():
        if k in expected and expected[k].shape != v.shape:
            raise ValueError(f"{where}: {k} is {list(v.shape)} in the checkpoint but {list(expected[k].shape)} "
                             "in the model its config.json describes")


def _resident_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()) if not t.is_meta)


@dataclass
class StreamingResult:
    reports: list
    out_dir: Path
    peak_weight_bytes: int  # most weight/buffer bytes resident at once (model tensors, not activations)
    checkpoint_bytes: int  # the source checkpoint's tensors it reads (a multimodal one's: its language model's)


def calibrate_streaming(model_dir: str | Path, out_dir: str | Path, input_ids: torch.Tensor, cfg: CacheConfig,
                        steps: int = 100, seed: int = 0, dtype: torch.dtype | None = None,
                        calibration: dict | None = None, progress: bool = True,
                        space: SearchSpace | None = None) -> StreamingResult:
    """Calibrate and fold the checkpoint in `model_dir` one decoder layer at a time, writing a fused checkpoint
    to `out_dir` (weights in `dtype`, default the source's) without ever holding all its weights.

    Same arguments and the same fused weights as `driver.calibrate_model` + `export.save_calibrated`.
    """
    model_dir, out_dir = check_checkpoint_dir(model_dir), Path(out_dir)
    reader = ShardReader(model_dir)
    if (mm := multimodal(model_dir)) is not None:  # its language model alone, written under the causal LM's names
        reader.rename(mm.text_names(reader.weight_map))
    compute = torch.float32
    model = skeleton(model_dir, compute)
    if dtype is None:
        dtype = source_dtype(model_dir)
    layers = describe(model)
    rename = renaming(model)
    prefix = layers[0].module.split(".layers.")[0] + ".layers."
    n = len(model.get_submodule(prefix[:-1]))
    files = [f"model-{i + 1:05d}-of-{n + 1:05d}.safetensors" for i in range(n + 1)]
    weight_map: dict[str, str] = {}
    total = 0  # the index's total_size: tensor bytes, headers not counted (as save_pretrained writes it)
    # An old single file would shadow the new index (writing_checkpoint clears it first); a failed or interrupted
    # run leaves none of its shards (config.json is written last: nothing before it looks like a checkpoint).
    with writing_checkpoint(out_dir):
        peak = 0

        def write(shard: str, keys, state: dict[str, torch.Tensor], source: dict[str, torch.Tensor]):
            nonlocal total
            # a name the module has (folded or not, `rename`d) comes from the module; the per-expert names from
            # the source
            tensors = {k: (state[rename(k)] if rename(k) in state else source[k]).detach()
                       .to(stored_dtype(model, k, dtype)).contiguous() for k in keys}
            save_file(tensors, str(out_dir / shard), metadata={"format": "pt"})
            total += sum(t.nbytes for t in tensors.values())
            weight_map.update({k: shard for k in keys})

        # Tensors transformers ignores on loading (LongCat-Flash's multi-token-prediction layer, model.mtp.*) are
        # neither read nor written, as by the in-memory path; the model has no place for them.
        ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
        reader.weight_map = {k: v for k, v in reader.weight_map.items() if not any(p.search(k) for p in ignored)}
        # Everything outside the decoder layers, resident for the whole run (the forward needs the embeddings).
        rest = [k for k in reader.weight_map if not k.startswith(prefix)]
        source = reader.read(rest)
        tensors = {k: v.to(compute) for k, v in _to_model_names(source, rename).items()}
        _check_shapes(model, tensors, str(model_dir))
        missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
        if unexpected:
            raise ValueError(f"{model_dir}: tensors the model does not have: {unexpected[:5]}")
        model.tie_weights()
        still_meta = [name for name, p in model.named_parameters() if p.is_meta and not name.startswith(prefix)]
        if still_meta:
            raise ValueError(f"{model_dir}: the checkpoint lacks {still_meta[:5]}")
        write(files[-1], rest, model.state_dict(), source)
        del source

        layer_source: dict[str, torch.Tensor] = {}

        def before(i, block):
            nonlocal peak
            keys = reader.keys_under(f"{prefix}{i}.")
            layer_source.clear()
            layer_source.update({k[len(f"{prefix}{i}."):]: v for k, v in reader.read(keys).items()})
            tensors = {k: v.to(compute) for k, v in _to_model_names(layer_source, rename).items()}
            _check_shapes(block, tensors, f"{model_dir}: layer {i}")
            missing, unexpected = block.load_state_dict(tensors, strict=False, assign=True)
            if missing or unexpected:  # strict=True would raise these as a multi-line error
                raise ValueError(f"{model_dir}: layer {i}'s tensors do not match the model: " + "; ".join(
                    f"{what} {names[:5]}" for what, names in (("lacks", missing), ("has unknown", unexpected))
                    if names))
            peak = max(peak, _resident_bytes(model))

        def after(i, block):
            at = f"{prefix}{i}."
            write(files[i], [at + k for k in layer_source], {at + k: v for k, v in block.state_dict().items()},
                  {at + k: v for k, v in layer_source.items()})
            layer_source.clear()
            block.to("meta")  # free the layer's weights

        reports = calibrate_model(model, layers, input_ids, cfg, steps, seed, progress, before_layer=before,
                                  after_layer=after, space=space)
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
        cfg = cfg.fit(layers[0].kv_lora_rank, layers[0].rope_dim)
        mark_calibrated(model.config, cfg, calibration or {}, reports)
        model.config.dtype = dtype
        model.config.save_pretrained(out_dir)
        # The skeleton's generation config is derived from config.json; the source's own (sampling defaults, the
        # eos ids of a chat model's end of turn) is copied by finish_checkpoint, as from_pretrained would load it.
        if (not (model_dir / "generation_config.json").is_file()
                and getattr(model, "generation_config", None) is not None and model.can_generate()):
            model.generation_config.save_pretrained(out_dir)
        finish_checkpoint(out_dir, reports, model_dir)
        return StreamingResult(reports, out_dir, peak, reader.total_bytes)
