"""The baselines and quantmla itself as `quantmla eval --method` choices.

Each is `fn(model, args) -> (model, CacheConfig)` as in `eval.methods` (args: a `MethodArgs`, read only for
.content/.rope/.sink/.recent, and .budget by quantmla). A method that folds a transform returns a deep copy
and leaves `model` alone.
Every method keeps the project's protected tokens (sink 4, recent 128) unless --sink/--recent say otherwise,
so that in the accuracy table only the quantizer differs.

  fp4          both paths e2m1 with an e4m3 scale per 16 values (NVFP4-style, one serving stack's FP4 MLA pool):
               (512 + 64) / 2 + 576 / 16 = 324 B/token. No transform. Only fp4 formats are accepted.
  turboquant   random rotation of the content path (a randomized Hadamard folded into the weights) + the
               3-bit Lloyd-Max codebook of a Gaussian with a per-token fp16 norm (`lm3`), RoPE BF16:
               192 + 2 + 128 = 322 B/token. --content lm2/lm4 allowed; RoPE must stay bf16.
  kivi         KIVI-style per-channel grouping along tokens (`int4:t64`: one scale + zero per channel and
               block of 64 tokens) on both paths; tokens leaving the recent window wait in BF16 until a block
               is full. int4:t64 on both: 288 + 36 = 324 B/token (G = 64 costs the same as channel groups of
               64; KIVI's paper uses G = 32: --content int4:t32). A plain `int4` means `int4:t64`.
  quarot       randomized Hadamard: folded into the weights on the content path (free); on the RoPE path
               applied online after RoPE by the cache (CacheConfig.rope_rotation), since a Hadamard does not
               commute with RoPE. Its cost: `method_info` (online_flops_per_token). Formats as rtn (int4/int4).
  smoothquant  SmoothQuant's migration (alpha = 0.5), no rotation: content c' = c * max|c_j|^-a * max|q~_j|^a,
               RoPE a tied scale per pair (the only scaling that commutes with RoPE) from the pairs' maximal
               magnitudes; both folded. Statistics from the built-in calibration text. Formats as rtn.
  quantmla     our method: a checkpoint with a `quantmla` section (from `quantmla calibrate`) is used as is;
               any other is calibrated first (calibrate.driver.calibrate_model on a copy; says so on stdout),
               with the default search space: transforms x clipping ratios x channel groups. With a byte
               budget (`quantmla@budget=F` in benchmarks/eval_methods.py) the formats are first chosen per
               path and layer to fit F of BF16's bytes at 128 K tokens (calibrate.budget.choose_formats on the
               calibration windows, both as `quantmla calibrate --budget F` has them), then calibrated for.
  quantmla-t   the same with token-axis (KIVI-style) groups in the search too (`quantmla calibrate
               --token-axis`; on the GPU the decode kernel serves them only on the RoPE path at few heads).
  quantmla-c   the same without ranked content formats (`quantmla calibrate --no-ranked`): every channel
               stored; the search quantmla had before ranked formats.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from quantmla.calibrate.content import random_hadamard
from quantmla.calibrate.driver import default_length
from quantmla.calibrate.export import SECTION
from quantmla.calibrate.smooth import smooth_scales
from quantmla.config import CacheConfig, QuantFormat
from quantmla.data import encode, read_text, token_windows, tokenizer_for
from quantmla.mla import absorb_queries, project_cache, project_queries, split_kv_b
from quantmla.models.adapters import MLALayer, attention_module, describe
from quantmla.transforms import ContentTransform, RopeTransform, fold_content, fold_rope

SINK, RECENT = 4, 128
KIVI_TOKENS = 64
ROTATION_SEED = 0


def _cache(args, content, rope, rope_rotation: str = "") -> CacheConfig:
    sink = SINK if args.sink is None else args.sink
    recent = RECENT if args.recent is None else args.recent
    return CacheConfig(content, rope, sink, recent, rope_rotation)


def _refuse(method: str, path: str, given: str, stores: str) -> ValueError:
    return ValueError(f"method {method!r} stores {path} as {stores}; --{path} {given} is not allowed")


# ---------------------------------------------------------------- fixed formats
def fp4(model: nn.Module, args) -> tuple[nn.Module, CacheConfig]:
    for path, given in (("content", args.content), ("rope", args.rope)):
        if given is not None and QuantFormat.parse(given).kind != "fp4":
            raise _refuse("fp4", path, given, "fp4 (e2m1, an e4m3 scale per 16 values)")
    return model, _cache(args, args.content or "fp4", args.rope or "fp4")


def _rotate_content(model: nn.Module, seed: int = ROTATION_SEED) -> nn.Module:
    """A copy of `model` whose content cache holds s * rms(gamma) * H c_hat (H a randomized Hadamard per layer).

    The channel scale is a constant, not gamma: the cache then holds a rotated, evenly scaled latent whose
    coordinates are all alike (what a codebook for a Gaussian or a shared group scale assumes); gamma moves
    into kv_b_proj, so the fold stays exact (QuaRot folds RMSNorm weights into the next layer the same way).
    """
    model = copy.deepcopy(model)
    for layer in describe(model):
        attn = attention_module(model, layer)
        gamma = attn.kv_a_layernorm.weight.detach().double()
        rotation = random_hadamard(layer.kv_lora_rank, torch.Generator().manual_seed(seed + layer.cache_idx))
        sigma = torch.full((layer.kv_lora_rank,), gamma.pow(2).mean().sqrt().clamp_min(1e-6).item())
        fold_content(attn, layer, ContentTransform(rotation.double(), sigma))
    return model


def turboquant(model: nn.Module, args) -> tuple[nn.Module, CacheConfig]:
    if args.content is not None and QuantFormat.parse(args.content).family != "codebook":
        raise _refuse("turboquant", "content", args.content, "a Lloyd-Max codebook: lm3 (also lm2, lm4)")
    if args.rope is not None and QuantFormat.parse(args.rope).kind != "bf16":
        raise _refuse("turboquant", "rope", args.rope, "bf16")
    return _rotate_content(model), _cache(args, args.content or "lm3", "bf16")


# ---------------------------------------------------------------- kivi
def _kivi_format(path: str, spec: str | None) -> QuantFormat:
    """int4:tG as given; a plain integer kind (no group) -> its token-axis format with KIVI_TOKENS; bf16 kept."""
    fmt = QuantFormat.parse(spec or "int4")
    if fmt.kind == "bf16" or fmt.axis == "token":
        return fmt
    if fmt.is_integer and ":" not in (spec or ""):
        return QuantFormat(fmt.kind, KIVI_TOKENS, "token")
    raise _refuse("kivi", path, spec, f"an integer format grouped along tokens, e.g. int4:t{KIVI_TOKENS}")


def kivi(model: nn.Module, args) -> tuple[nn.Module, CacheConfig]:
    return model, _cache(args, _kivi_format("content", args.content), _kivi_format("rope", args.rope))


# ---------------------------------------------------------------- quarot
def quarot(model: nn.Module, args) -> tuple[nn.Module, CacheConfig]:
    content, rope = QuantFormat.parse(args.content or "int4"), QuantFormat.parse(args.rope or "int4")
    rotation = "" if rope.kind == "bf16" else f"hadamard:{ROTATION_SEED}"  # nothing to rotate for a BF16 path
    return (model if content.kind == "bf16" else _rotate_content(model)), _cache(args, content, rope, rotation)


def online_cost(config: CacheConfig, layer: MLALayer) -> dict:
    """Extra run-time work of an online RoPE rotation, per token and layer: the new key is rotated once, and
    every head's query once (the kernel scores H q_pe against the rotated keys instead of undoing H on every
    cached key). Dense matmul: 2 dr^2 FLOPs a vector; a fast Walsh-Hadamard transform: dr log2 dr adds."""
    if not config.rope_rotation:
        return {"online_rotation": None, "online_flops_per_token": 0, "online_flops_per_token_fwht": 0}
    dr, vectors = layer.rope_dim, 1 + layer.num_heads
    return {"online_rotation": f"rope {config.rope_rotation}", "online_flops_per_token": vectors * 2 * dr * dr,
            "online_flops_per_token_fwht": vectors * dr * math.ceil(math.log2(dr))}


def method_info(model: nn.Module, config: CacheConfig) -> dict:
    """What a method costs besides cache bytes (for the eval JSON): the online rotation work per token per layer."""
    return online_cost(config, describe(model)[0])


# ---------------------------------------------------------------- smoothquant
def calibration_ids(model: nn.Module, samples: int, length: int) -> torch.Tensor:
    """Windows [N, length] of the built-in calibration text, tokenized with the checkpoint's own tokenizer
    (found through the directory transformers loaded it from; byte ids modulo the vocab without one)."""
    source = getattr(model.config, "_name_or_path", "") or ""
    tokenizer = tokenizer_for(source) if source and Path(source).is_dir() else None
    length = default_length(model, length)
    ids = token_windows(encode(read_text(None), tokenizer, model.config.vocab_size), length, samples)
    return ids.to(next(model.parameters()).device)


@torch.no_grad()
def activation_maxima(model: nn.Module, layers: list[MLALayer], ids: torch.Tensor) -> dict[int, dict]:
    """Per attention: max |c_j| and max |q~_j| (absorbed query, all heads) per latent channel, and the
    largest magnitude of each RoPE pair of the cached key and of the queries. One window per forward; only
    the maxima are kept."""
    stats: dict[int, dict] = {}

    def hook(attn, args, kwargs, layer):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        pe = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
        q_nope, q_pe = project_queries(attn, layer, hidden, pe, kwargs.get("position_ids"))
        c, k_pe = project_cache(attn, layer, hidden, pe)
        q_abs = absorb_queries(q_nope.float(), split_kv_b(attn, layer)[0].float())
        pairs = torch.tensor(layer.cache_pairs)
        new = {"c": c.abs().amax((0, 1)), "q": q_abs.abs().amax((0, 1, 2)),
               "k_pe": k_pe[..., pairs].norm(dim=-1).amax((0, 1)),
               "q_pe": q_pe[..., pairs].norm(dim=-1).amax((0, 1, 2))}
        old = stats.get(layer.cache_idx)
        stats[layer.cache_idx] = new if old is None else {k: torch.maximum(old[k], v) for k, v in new.items()}

    handles = [attention_module(model, l).register_forward_pre_hook(
        lambda attn, args, kwargs, l=l: hook(attn, args, kwargs, l), with_kwargs=True) for l in layers]
    try:
        for window in ids:
            model(window[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return stats


def smoothquant(model: nn.Module, args, samples: int = 4, length: int = 512) -> tuple[nn.Module, CacheConfig]:
    config = _cache(args, args.content or "int4", args.rope or "int4")
    layers = describe(model)
    stats = activation_maxima(model, layers, calibration_ids(model, samples, length))
    model = copy.deepcopy(model)
    for layer in layers:
        attn, s = attention_module(model, layer), stats[layer.cache_idx]
        if config.content.kind != "bf16":
            # c' = m * c with c = s * gamma * c_hat: sigma = |gamma| m, and the signs of gamma become a diagonal
            # rotation (the fold needs sigma > 0).
            gamma = attn.kv_a_layernorm.weight.detach().double()
            m = smooth_scales(s["c"], s["q"])
            sign = torch.where(gamma < 0, -1.0, 1.0).double()
            fold_content(attn, layer, ContentTransform(torch.diag(sign), (gamma.abs() * m).clamp_min(1e-12)))
        if config.rope.kind != "bf16":
            alpha = smooth_scales(s["k_pe"], s["q_pe"])
            fold_rope(attn, layer, RopeTransform(torch.zeros_like(alpha), alpha))
    return model, config


# ---------------------------------------------------------------- quantmla
@dataclass(frozen=True)
class Calibration:
    """How `quantmla` calibrates an uncalibrated checkpoint (the `quantmla calibrate` defaults)."""

    samples: int = 8
    length: int = 2048  # cut to the model's positions by `calibrate.driver.default_length`
    steps: int = 100
    seed: int = 0
    token_axis: bool = False  # also search KIVI-style token-axis groups (`quantmla calibrate --token-axis`)
    ranked: bool = True  # also search ranked content formats (`quantmla calibrate --ranked`, the default)


def quantmla(model: nn.Module, args, calibration: Calibration = Calibration()) -> tuple[nn.Module, CacheConfig]:
    section = getattr(model.config, SECTION, None)  # from_pretrained keeps config.json's quantmla section
    if section and args.budget is not None:
        raise ValueError(f"this checkpoint is already calibrated (its config.json has a '{SECTION}' section, "
                         f"formats {section.get('content')}/{section.get('rope')}); a byte budget needs the "
                         "original checkpoint")
    budget = (section or {}).get("calibration", {}).get("budget")
    if budget and (args.content is not None or args.rope is not None):  # its section's base formats chose nothing
        raise ValueError(f"this checkpoint's formats were chosen per layer for a byte budget "
                         f"({budget.get('fraction')} of BF16's); --content/--rope need a calibration of the "
                         "original checkpoint")
    if section:
        config, layer = CacheConfig.from_dict(section), describe(model)[0]
        dims = {"content": layer.kv_lora_rank, "rope": layer.rope_dim}
        for path, given in (("content", args.content), ("rope", args.rope)):
            if given is not None and QuantFormat.parse(given).fit(dims[path]) != getattr(config, path):
                raise ValueError(f"this checkpoint was calibrated for {path} {getattr(config, path)}; "
                                 f"--{path} {given} needs a calibration of the original checkpoint")
        return model, replace(config, sink=config.sink if args.sink is None else args.sink,
                              recent=config.recent if args.recent is None else args.recent)
    from quantmla.calibrate.budget import choose_formats
    from quantmla.calibrate.driver import calibrate_model, chosen_config
    from quantmla.calibrate.space import SearchSpace

    config = _cache(args, args.content or "int4", args.rope or "int4")
    ids = calibration_ids(model, calibration.samples, calibration.length)
    if ids.shape[0] < 3:
        raise ValueError(f"need at least 3 calibration windows of {ids.shape[1]} tokens (fit / select / report); "
                         "the text has fewer")
    formats = (f"a byte budget of {args.budget}" if args.budget is not None
               else f"content {config.content}, rope {config.rope}")
    print(f"quantmla: the model has no '{SECTION}' section (uncalibrated): calibrating first, {formats}, "
          f"{ids.shape[0]} x {ids.shape[1]} tokens, {calibration.steps} steps per path (save a calibrated "
          "checkpoint with `quantmla calibrate` to skip this)", flush=True)
    model = copy.deepcopy(model)
    layers = describe(model)
    if args.budget is not None:
        allocation = choose_formats(model, layers, ids, config, args.budget, ranked=calibration.ranked)
        config = allocation.config
        print(f"quantmla: {allocation.summary()}", flush=True)
    torch.manual_seed(calibration.seed)  # after the format choice, as `quantmla calibrate` seeds
    reports = calibrate_model(model, layers, ids, config, calibration.steps, calibration.seed,
                              space=SearchSpace(token_axis=calibration.token_axis, ranked=calibration.ranked))
    return model, chosen_config(config.fit(layers[0].kv_lora_rank, layers[0].rope_dim), reports)


def quantmla_token_axis(model: nn.Module, args) -> tuple[nn.Module, CacheConfig]:
    """quantmla whose search also has token-axis (KIVI-style) points (`quantmla calibrate --token-axis`)."""
    return quantmla(model, args, Calibration(token_axis=True))


def quantmla_channels(model: nn.Module, args) -> tuple[nn.Module, CacheConfig]:
    """quantmla without ranked content formats (`quantmla calibrate --no-ranked`)."""
    return quantmla(model, args, Calibration(ranked=False))


BASELINES = {"fp4": fp4, "turboquant": turboquant, "kivi": kivi, "quarot": quarot, "smoothquant": smoothquant,
             "quantmla": quantmla, "quantmla-t": quantmla_token_axis, "quantmla-c": quantmla_channels}
BUDGETED = ("quantmla", "quantmla-t", "quantmla-c")  # the methods that read MethodArgs.budget
