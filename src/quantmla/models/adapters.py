"""Adapters: from a Hugging Face MLA model (or a local checkpoint directory) to one `MLALayer` per attention.

Everything family-specific lives here, in one small function per family; the rest of quantmla only reads
`MLALayer`. Every supported family names its attention weights the same way (`q_proj` or `q_a_proj`/
`q_b_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`); they differ in where the RoPE
pairs sit and in a few scalars (Mistral 4 also in a query factor of the position).

RoPE styles (pairs are index pairs inside the rope part, of width d):
  complex     DeepSeek-V2: weights and cache both interleaved, pair j = (2j, 2j+1)
  interleave  V3-style `rope_interleave=True`: weights interleaved (2j, 2j+1); the rotary op de-interleaves,
              so the cache holds pair j at (j, j + d/2)
  half        weights and cache both half-split, pair j = (j, j + d/2)
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


class UnsupportedModelError(ValueError):
    """The model is not an MLA family quantmla knows how to handle."""


@dataclass(frozen=True)
class MLALayer:
    """What quantmla needs to know about one MLA attention module.

    cache_idx:     the `layer_idx` the module passes to `Cache.update` (LongCat has two per decoder layer)
    module:        dotted path of the attention module inside the model
    q_path:        "q_proj" (one projection) or "q_a_q_b" (low-rank q with q_a_layernorm)
    rope_style:    "complex" | "interleave" | "half" (see module docstring)
    latent_scale:  constant multiplying the latent after kv_a_layernorm (LongCat's mla_scale_kv_lora)
    query_scale:   constant multiplying q (LongCat's mla_scale_q_lora)
    softmax_scale: the attention's score scale, YaRN mscale included
    mscale:        softmax_scale / qk_head_dim**-0.5 (1.0 without YaRN)
    query_pos_beta, query_pos_max: after RoPE the whole query (nope and rope parts) is multiplied by
                   1 + query_pos_beta * log(1 + floor(position / query_pos_max)) (Mistral 4: Llama 4's
                   attention scaling, rope_parameters' llama_4_scaling_beta and original_max_position_embeddings);
                   beta 0: no such factor. `quantmla.mla.project_queries` applies it.
    """

    model_type: str
    cache_idx: int
    module: str
    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    nope_dim: int
    v_dim: int
    q_path: str
    rope_style: str
    latent_scale: float = 1.0
    query_scale: float = 1.0
    softmax_scale: float = 1.0
    mscale: float = 1.0
    query_pos_beta: float = 0.0
    query_pos_max: int = 0

    @property
    def weight_pairs(self) -> list[tuple[int, int]]:
        """Index pairs (inside the rope rows of kv_a_proj and of each query head) that RoPE rotates together."""
        half = self.rope_dim // 2
        if self.rope_style in ("complex", "interleave"):
            return [(2 * j, 2 * j + 1) for j in range(half)]
        return [(j, j + half) for j in range(half)]

    @property
    def cache_pairs(self) -> list[tuple[int, int]]:
        """The same pairs in the coordinates of the cached k_pe."""
        half = self.rope_dim // 2
        if self.rope_style == "complex":
            return [(2 * j, 2 * j + 1) for j in range(half)]
        return [(j, j + half) for j in range(half)]

    @property
    def qk_head_dim(self) -> int:
        return self.nope_dim + self.rope_dim


def _rope_interleave_flag(config, attn) -> str:
    return "interleave" if getattr(config, "rope_interleave", False) else "half"


# One function per family: (config, attention module) -> (rope_style, extra MLALayer fields).
def _deepseek_v2(config, attn):
    return "complex", {}


def _v3_like(config, attn):
    return _rope_interleave_flag(config, attn), {}


def _longcat_flash(config, attn):
    # LongCat always applies the interleaved rotary op and scales q and the latent by constants.
    return "interleave", {"latent_scale": float(attn.mla_scale_kv_lora), "query_scale": float(attn.mla_scale_q_lora)}


def _minicpm3(config, attn):
    return "half", {}


def _mistral4(config, attn):
    # V3's attention, then the whole query times a factor of its position (get_llama_4_attn_scale).
    params = config.rope_parameters or {}
    beta, period = params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings")
    if beta is None or not period:
        raise UnsupportedModelError("a mistral4 config needs rope_parameters' llama_4_scaling_beta and "
                                    "original_max_position_embeddings (its attention scales queries by them)")
    return _rope_interleave_flag(config, attn), {"query_pos_beta": float(beta), "query_pos_max": int(period)}


FAMILIES = {
    "deepseek_v2": _deepseek_v2,
    "deepseek_v3": _v3_like,  # also Kimi K2
    "glm4_moe_lite": _v3_like,  # GLM-4.7-Flash
    "youtu": _v3_like,
    "axk1": _v3_like,  # A.X K1
    "longcat_flash": _longcat_flash,
    "minicpm3": _minicpm3,
    "mistral4": _mistral4,  # Mistral Small 4 (its text model)
}

# MLA families transformers runs but quantmla does not: why, for the refusal.
_DSA = "uses DeepSeek Sparse Attention (an indexer selects the keys each query sees)"
NOT_SUPPORTED = {
    **dict.fromkeys(("deepseek_v32", "glm_moe_dsa", "axk2", "hy_v4", "glm5_next", "glm5_next_text"), _DSA),
    "kimi_linear": "mixes MLA layers with linear-attention (Kimi Delta Attention) layers, whose state is no KV cache",
}

# Families whose causal-LM class transformers' AutoModelForCausalLM does not map (5.19: mistral4, whose
# checkpoints are multimodal); `register_causal_lms` adds them, so they load like every other family.
CAUSAL_LM_CLASSES = {"mistral4": ("Mistral4Config", "Mistral4ForCausalLM")}


def register_causal_lms() -> None:
    """Register `CAUSAL_LM_CLASSES` with AutoModelForCausalLM where transformers does not (idempotent)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for model_type, (config_class, model_class) in CAUSAL_LM_CLASSES.items():
        config_cls, model_cls = getattr(transformers, config_class, None), getattr(transformers, model_class, None)
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and config_cls and model_cls:  # (a release without
            transformers.AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)  # them refuses the type)
            if config_cls not in MODEL_FOR_CAUSAL_LM_MAPPING:  # 5.17's register skips a config class of its own
                MODEL_FOR_CAUSAL_LM_MAPPING._extra_content[config_cls] = model_cls


def _text_config(model: nn.Module):
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _is_mla_attention(module: nn.Module) -> bool:
    return all(hasattr(module, n) for n in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"))


def describe(model: nn.Module | str | Path) -> list[MLALayer]:
    """One MLALayer per MLA attention module, in cache-index order.

    `model` may be a loaded model or a checkpoint directory (then only its config is read and the model is
    built on the meta device, without weights).
    """
    if isinstance(model, (str, Path)):
        model = load_model(model, meta=True)
    config = _text_config(model)
    model_type = getattr(config, "model_type", type(model).__name__)
    if model_type not in FAMILIES:
        raise _unsupported(model_type)
    layers = []
    for name, attn in model.named_modules():
        if not _is_mla_attention(attn):
            continue
        rope_style, extra = FAMILIES[model_type](config, attn)
        qk_head_dim = attn.qk_nope_head_dim + attn.qk_rope_head_dim
        layers.append(
            MLALayer(
                model_type=model_type,
                cache_idx=int(attn.layer_idx),
                module=name,
                num_heads=int(attn.num_heads),
                kv_lora_rank=int(attn.kv_lora_rank),
                rope_dim=int(attn.qk_rope_head_dim),
                nope_dim=int(attn.qk_nope_head_dim),
                v_dim=int(attn.v_head_dim),
                q_path="q_proj" if getattr(attn, "q_proj", None) is not None else "q_a_q_b",
                rope_style=rope_style,
                softmax_scale=float(attn.scaling),
                mscale=float(attn.scaling) * math.sqrt(qk_head_dim),
                **extra,
            )
        )
    if not layers:
        raise UnsupportedModelError(f"model_type {model_type!r}: no MLA attention modules found in the model")
    return sorted(layers, key=lambda s: s.cache_idx)


def attention_module(model: nn.Module, layer: MLALayer) -> nn.Module:
    return model.get_submodule(layer.module)


def register_module_attention(name: str, done_by: str) -> str:
    """Register `name` as a transformers attention implementation for models whose attention modules were
    replaced (by `done_by`): transformers builds no mask for an unknown-to-it function, and a call to it means
    a module was missed. Returns `name`."""
    from transformers import AttentionInterface

    def not_called(*args, **kwargs):
        raise RuntimeError(f"{name} attention is done by {done_by} modules, not by this function")

    AttentionInterface.register(name, not_called)
    return name


def query_weight(attn: nn.Module, layer: MLALayer) -> nn.Linear:
    """The linear whose output rows are the per-head queries [H * (nope + rope)]."""
    return attn.q_proj if layer.q_path == "q_proj" else attn.q_b_proj


def check_checkpoint_dir(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    return path


def read_config_json(path: str | Path) -> dict:
    """A checkpoint directory's config.json as a dict; FileNotFoundError naming a missing directory or
    config.json (`check_checkpoint_dir`), ValueError naming the file when it is not JSON."""
    file = check_checkpoint_dir(path) / "config.json"
    config = _read_json(file)
    if not isinstance(config, dict):
        raise ValueError(f"{file} holds a JSON {type(config).__name__}, not an object of model settings")
    return config


def _read_json(file: Path):
    """A checkpoint's JSON file, parsed; ValueError naming the file when it is not JSON (json's own names none)."""
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e}); fix or replace the checkpoint's {file.name}") from None


def read_weight_map(path: str | Path) -> dict[str, str] | None:
    """A sharded checkpoint's model.safetensors.index.json weight_map (tensor name -> shard file), None without
    that index. ValueError naming the file when it is not one (a download cut short): transformers' error named
    no file, or was a KeyError."""
    index = Path(path) / "model.safetensors.index.json"
    if not index.is_file():
        return None
    data = _read_json(index)
    if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
        raise ValueError(f"{index} has no weight_map (tensor name -> shard file); fix or replace the "
                         "checkpoint's index")
    return data["weight_map"]


def check_unquantized(path: str | Path) -> None:
    """Refuse a checkpoint with quantized weights (a `quantization_config`, e.g. DeepSeek-V3's FP8 blocks) for
    a command that folds transforms into the weights and writes them: on a CPU transformers dequantizes
    such a checkpoint on load, but cannot save the folded weights back in its format (it fails at the very
    end, after the whole calibration)."""
    if quant := quantization_config(path):
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ValueError(f"{path} holds quantized weights (quantization_config, quant_method {method!r}); "
                         "calibration folds into unquantized ones: convert the checkpoint to bf16 first")


def quantization_config(path: str | Path):
    """A checkpoint's quantization_config as config.json has it, None without one."""
    raw = read_config_json(path)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    # a multimodal checkpoint's may sit in its language model's config (Kimi K2.5's INT4 experts)
    return raw.get("quantization_config") or text.get("quantization_config") or None


def check_not_fp8_blocks(path: str | Path) -> None:
    """Refuse block-scaled FP8 weights (DeepSeek-V3's, R1's and Kimi K2's as published) before transformers loads
    them: on a CPU its dequantization fails on kv_a_proj_with_mqa (kv_lora_rank + rope rows, 576, are no multiple
    of its 128-row blocks) with a page of traceback; where it finds a GPU its quantizer keeps FP8 modules, whose
    raw FP8 weights quantmla's attention would read."""
    quant = quantization_config(path)
    if isinstance(quant, dict) and quant.get("quant_method") == "fp8" and quant.get("weight_block_size"):
        raise ValueError(f"{path} holds FP8 weights in blocks (quantization_config, quant_method 'fp8', "
                         f"weight_block_size {quant['weight_block_size']}), which quantmla does not read: convert "
                         "the checkpoint to bf16 first")


def _unsupported(model_type, path: Path | None = None) -> UnsupportedModelError:
    where = f" in {path}" if path is not None else ""
    why = (f"{NOT_SUPPORTED[model_type]}, which quantmla does not support" if model_type in NOT_SUPPORTED
           else "is not a supported MLA family")
    return UnsupportedModelError(f"model_type {model_type!r}{where} {why}; supported: {', '.join(sorted(FAMILIES))}")


# The weight files transformers' from_pretrained reads from a local directory.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")

# Checkpoints that name their own model_type but are a supported family's architecture (their config.json's
# `architectures`), read with that family's transformers classes: Kimi K2 is DeepSeek-V3.
ALIASES = {"kimi_k2": ("deepseek_v3", "DeepseekV3ForCausalLM")}


@contextmanager
def _invalid_settings_named(path: Path):
    """transformers' config classes validate their fields (huggingface_hub's strict dataclasses) and raise a
    multi-line error that names no file: say which config.json holds the bad value, on one line."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        yield
    except StrictDataclassError as e:
        raise ValueError(f"{path / 'config.json'} holds an invalid setting: {e.__cause__ or e}") from None


def load_config(path: str | Path):
    """The transformers config of a local MLA checkpoint directory; refuses any other model by its model_type.
    An `ALIASES` model_type gets its family's config class (without the checkpoint's `auto_map`, so no code
    of the checkpoint runs; a checkpoint quantmla saves from it is of the family's model_type). A multimodal
    checkpoint around an MLA language model gets its language model's config (`Multimodal`)."""
    return _configs(path)[0]


def multimodal(path: str | Path) -> Multimodal | None:
    """The `Multimodal` view of a checkpoint whose MLA language model sits inside a multimodal model, else None."""
    return _configs(path)[1]


def _configs(path: str | Path):
    """(the config quantmla runs, `Multimodal` or None) of a checkpoint directory; see `load_config`."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING)

    register_causal_lms()
    path = check_checkpoint_dir(path)
    raw = read_config_json(path)
    declared = raw.get("model_type")
    if declared in ALIASES and ALIASES[declared][1] in raw.get("architectures", []):
        family = ALIASES[declared][0]
        fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
        with _invalid_settings_named(path):
            return _with_longrope_factor(CONFIG_MAPPING[family].from_dict(fields)), None
    # A model_type transformers has no class for needs the checkpoint's own code, which quantmla never runs
    # (transformers would ask for trust_remote_code, or prompt on a terminal): refuse it here, by name. So is one
    # that is no name (a number; null): transformers' refusal of it ran over several lines of upgrade advice.
    # (A missing one is left to transformers, which guesses it from the directory's name, or says it is missing.)
    if "model_type" in raw and (not isinstance(declared, str) or declared not in CONFIG_MAPPING):
        raise _unsupported(declared, path)
    with _invalid_settings_named(path):
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    text = _with_longrope_factor(config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config)
    kind = getattr(text, "model_type", None)
    if text is not config and kind in ALIASES and type(text).model_type == ALIASES[kind][0]:
        kind = type(text).model_type  # Kimi K2.5's text_config says kimi_k2; transformers reads it as deepseek_v3
    if kind not in FAMILIES:
        raise _unsupported(kind, path)
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return config, None
    if text is not config and type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        mm = Multimodal(path, config)
        return mm.text, mm
    # Anything else around an MLA text model: say so here rather than let AutoModelForCausalLM list every class
    # it knows.
    raise UnsupportedModelError(f"model_type {config.model_type!r} in {path} wraps a {text.model_type} language "
                                "model in a model transformers runs neither as a causal LM nor as an image-text "
                                "model; quantmla reads neither")


def _with_longrope_factor(config):
    """`config`, its longrope parameters given the `factor` that transformers' rope code derives when it is absent
    (max_position_embeddings / original_max_position_embeddings). MiniCPM3-4B's config.json, as published, has
    none, and transformers' MiniCPM3 attention reads it for any rope type but the default: a KeyError 'factor'
    traceback from every command."""
    params = getattr(config, "rope_parameters", None)
    if (isinstance(params, dict) and params.get("rope_type") == "longrope" and params.get("factor") is None
            and params.get("original_max_position_embeddings")):
        params["factor"] = config.max_position_embeddings / params["original_max_position_embeddings"]
    return config


class Multimodal:
    """A multimodal checkpoint (transformers runs it as an image-text-to-text model) around an MLA language model:
    Mistral Small 4 (mistral3 around mistral4), Kimi K2.5 (kimi_k25 around deepseek_v3). quantmla reads its
    language model alone, as a text-only causal LM of the text family (`text`, e.g. Mistral4ForCausalLM); the
    vision tower and projector are not read, and what quantmla writes from it is a text-only checkpoint.

    Its text weights are found by transformers' own names: the checkpoint's names are renamed as transformers'
    loader renames them for the multimodal class (an older layout, `language_model.model.layers.0...`, to the
    one transformers 5 saves, `model.language_model.layers.0...`), then moved from where that class keeps its
    language model and head (`get_decoder`, `get_output_embeddings`) to where the causal LM keeps them.
    """

    def __init__(self, path: Path, config):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        self.path, self.config = Path(path), config
        text = copy.deepcopy(config.get_text_config(decoder=True))
        # Of the family its config class is (an alias, Kimi K2.5's kimi_k2, is not), without the checkpoint's code.
        text.model_type = type(text).model_type
        if hasattr(text, "auto_map"):
            del text.auto_map
        # transformers' multimodal class ties its head to the embeddings by its own flag, not the text config's:
        # the text model computes what it computes.
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        text.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING[type(text)].__name__]
        self.text = text

    def text_names(self, stored) -> dict[str, str]:
        """checkpoint name -> the causal LM's name, for each of the `stored` names that is a weight of the
        language model (the others, vision tower and projector, are left out); refuses a checkpoint without any."""
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        with torch.device("meta"):
            whole = AutoModelForImageTextToText.from_config(self.config)
            lm = AutoModelForCausalLM.from_config(self.text)
        place = {id(m): n for n, m in whole.named_modules()}
        text_place = {id(m): n for n, m in lm.named_modules()}
        moves = {place[id(part(whole))] + ".": text_place[id(part(lm))] + "."
                 for part in (lambda m: m.get_decoder(), lambda m: m.get_output_embeddings())}
        rename = renaming(whole)
        names = {}
        for key in stored:
            name = rename(key)
            for src, dst in moves.items():
                if name.startswith(src):
                    names[key] = dst + name[len(src):]
        if not names:
            raise ValueError(f"{self.path}: no weight of its {self.text.model_type} language model found (looked for "
                             f"names under {', '.join(m[:-1] for m in moves)}, as transformers' "
                             f"{type(whole).__name__} has them, "
                             "or names its loader renames to them)")
        return names

    @staticmethod
    def key_mapping(names: dict[str, str]) -> dict[str, str]:
        """`text_names`' result as from_pretrained's `key_mapping` (regex -> replacement, applied in turn): one
        entry per prefix the renaming replaces, e.g. {'^model\\.language_model\\.': 'model.'}."""
        pairs = set()
        for key, name in names.items():
            a, b = key.split("."), name.split(".")
            same = 0  # the dotted tail both names share
            while same < min(len(a), len(b)) and a[len(a) - 1 - same] == b[len(b) - 1 - same]:
                same += 1
            if a != b:
                pairs.add((".".join(a[: len(a) - same]), ".".join(b[: len(b) - same])))
        mapping = {"^" + re.escape(src + "."): dst + "." if dst else ""
                   for src, dst in sorted(pairs, key=lambda p: -len(p[0]))}
        for key, name in names.items():  # the loader chains them: check it reaches each name
            got = key
            for pattern, replacement in mapping.items():
                got = re.sub(pattern, replacement, got, count=1)
            if got != name:
                raise AssertionError(f"key_mapping takes {key} to {got}, not {name}")
        return mapping


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, meta: bool = False, attn: str = "eager"):
    """Load a local HF MLA checkpoint with transformers' own classes (no hub access).

    meta=True builds the architecture without weights (for `describe`/`info`).
    """
    from transformers import AutoModelForCausalLM

    config, mm = _configs(path)
    path = Path(path)
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    # save_pretrained writes a sharded checkpoint's index after its shards: a write or copy cut short leaves
    # shards that transformers cannot find (an OSError naming model.safetensors only).
    shards = sorted(path.glob("model-*-of-*.safetensors"))
    if shards and not any((path / n).is_file() for n in ("model.safetensors.index.json", "model.safetensors")):
        raise FileNotFoundError(f"{path} holds weight shards ({shards[0].name}, ...) but no "
                                "model.safetensors.index.json that maps tensors to them: a write or copy cut short? "
                                "copy or write the checkpoint again")
    # transformers reads these names only (or the file a config's transformers_weights names); weights under
    # another (Mistral's consolidated.safetensors) were an OSError traceback.
    if not any((path / n).is_file() for n in WEIGHT_FILES) and "transformers_weights" not in read_config_json(path):
        others = sorted(p.name for p in (*path.glob("*.safetensors"), *path.glob("*.bin")))
        why = f"{path} has a config.json but no weights that transformers reads ({', '.join(WEIGHT_FILES)})"
        if others:
            why += (f"; {others[0]}{', ...' * (len(others) > 1)} is another layout (e.g. Mistral's "
                    "consolidated.safetensors), which quantmla does not read: use the checkpoint's Hugging Face files")
        raise FileNotFoundError(why)
    read_weight_map(path)  # a broken index, by name
    check_safetensors(sorted(path.glob("*.safetensors")))
    check_not_fp8_blocks(path)
    extra, quiet = {}, contextlib.nullcontext()
    if mm is not None:  # the language model's weights, under the causal LM's names; the vision ones unexpected
        stored = stored_names(path)
        names = mm.text_names(stored)
        extra["key_mapping"], quiet = mm.key_mapping(names), _without_load_report()
    # ignore_mismatched_sizes: a weight of another shape than config.json describes is then reported in `info`
    # (and refused below, by name) instead of raised as transformers' multi-line loading report.
    with quiet:
        model, info = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, local_files_only=True,
                                                           attn_implementation=attn, output_loading_info=True,
                                                           ignore_mismatched_sizes=True, **extra)
    if mm is not None:  # save_pretrained reverts the renamings a model was loaded with: not to multimodal names
        from transformers.core_model_loading import WeightRenaming

        ours = set(extra["key_mapping"])
        model._weight_conversions = [t for t in getattr(model, "_weight_conversions", None) or ()
                                     if not (isinstance(t, WeightRenaming) and set(t.source_patterns) <= ours)]
    # transformers fills a weight the files lack with random values and only logs it: refuse instead.
    if info.get("missing_keys"):
        names = sorted(str(k) for k in info["missing_keys"])
        raise ValueError(f"{path}: {len(names)} weight(s) missing in the checkpoint, e.g. {names[0]}; the model "
                         "would run with random values there")
    if info.get("mismatched_keys"):
        name, found, wanted = sorted(info["mismatched_keys"])[0]  # (name, checkpoint shape, model shape)
        raise ValueError(f"{path}: {len(info['mismatched_keys'])} weight(s) of another shape than config.json "
                         f"describes, e.g. {name}: {list(found)} in the checkpoint, {list(wanted)} in the model")
    if mm is not None:  # what transformers' report (left out) said beyond the vision weights
        unread = sorted(set(map(str, info.get("unexpected_keys") or ())) - (set(stored) - set(names)))
        if unread:
            warnings.warn(f"{path}: {len(unread)} tensor(s) of the language model that {type(model).__name__} does "
                          f"not have, not read, e.g. {unread[0]}", stacklevel=2)
    return model.eval()


@contextmanager
def _without_load_report():
    """transformers logs a table of the checkpoint's tensors its model lacks: for a multimodal checkpoint, every
    vision weight. Leave it out (load_model refuses missing and misshapen weights, and warns of others itself)."""
    import logging

    log = logging.getLogger("transformers.modeling_utils")

    def keep(record) -> bool:
        return "LOAD REPORT" not in record.getMessage()

    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)


def stored_names(path: str | Path) -> list[str]:
    """The names of the tensors a checkpoint directory stores: its model.safetensors.index.json's, else those in the
    headers of its *.safetensors files (multimodal checkpoints are read from safetensors only)."""
    from safetensors import safe_open

    path = Path(path)
    if (names := read_weight_map(path)) is not None:
        return list(names)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files (a multimodal checkpoint is read from those only)")
    names = []
    for file in files:
        with safe_open(file, "pt") as f:
            names += list(f.keys())
    return names


def renaming(model: nn.Module):
    """checkpoint name -> module name under the renamings transformers' loader applies to this model (A.X K1
    stores its mlp.post_mlp_layernorm as post_mlp_layernorm); names relative to a decoder layer work alike."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]

    def rename(key: str) -> str:
        for t in renamings:
            key = t.rename_source_key(key)[0]
        return key

    return rename


def check_safetensors(files) -> None:
    """Read the header of every safetensors file: a missing, truncated or corrupt one is then an error that
    names the file, before any work (the loaders' own errors name none, or come halfway through a run)."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        if not Path(file).is_file():
            raise FileNotFoundError(f"weight file not found: {file}")
        try:
            with safe_open(file, "pt"):
                pass
        except SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file ({e}); it may be truncated or "
                             "corrupt: download or copy it again") from None


def cache_kwargs(model: nn.Module, cache) -> dict:
    """How to hand a Cache to `model(...)`/`generate(...)`: transformers >= 5.2x names it `cache`, older 5.x
    releases `past_key_values` (still accepted, with a deprecation warning, by the newer ones)."""
    import inspect

    return {"cache": cache} if "cache" in inspect.signature(model.forward).parameters else {"past_key_values": cache}
