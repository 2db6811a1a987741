"""The layer-by-layer calibration loop.

Hidden states enter decoder layer 0; for each decoder layer in turn: run it once with hooks on its MLA
attention(s) to capture their inputs, calibrate each attention's content and RoPE transforms, fold them
(exact, so the layer's output is unchanged), and pass the layer's output on. Only one decoder layer's
activations are alive at a time, so peak memory does not grow with depth. For a checkpoint larger than
memory (a 671 B DeepSeek-V3), build the model on the meta device and materialise one decoder layer's
weights at a time from its safetensors shards (their index maps every tensor name to a file): this loop only
ever touches `layers[i]`, so loading before and writing the folded tensors back after each step is all it
needs around it: `calibrate_model`'s `before_layer` / `after_layer` hooks, which `streaming.py` uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from tqdm.auto import tqdm

from quantmla.calibrate.content import calibrate_content
from quantmla.capture import attention_hooks
from quantmla.calibrate.rope import calibrate_rope
from quantmla.calibrate.search import Splits
from quantmla.calibrate.space import SearchSpace
from quantmla.config import CacheConfig, QuantFormat
from quantmla.mla import absorb_queries, project_cache, project_queries, split_kv_b
from quantmla.models.adapters import MLALayer, attention_module
from quantmla.policy import query_positions
from quantmla.transforms import ContentTransform, RopeTransform, fold_content, fold_rope


@dataclass
class LayerReport:
    """True objectives (real quantization, the serving policy) on the report sequences, which neither fit
    nor select the transform: `*_identity` is RTN at the requested format, `*_smoothquant` SmoothQuant's
    migration there, `*_best` the chosen point (transform + `*_format`); `*_select` is the winner's value on
    the selection sequences, `points` every scored point's there."""

    layer: int
    module: str
    content_identity: float | None = None
    content_best: float | None = None
    rope_identity: float | None = None
    rope_best: float | None = None
    content_select: float | None = None
    rope_select: float | None = None
    content_smoothquant: float | None = None
    rope_smoothquant: float | None = None
    content_format: str | None = None  # the chosen format (None: the path is bf16)
    rope_format: str | None = None
    history: dict = field(default_factory=dict)  # path -> [(step, surrogate on fit, true on select)]
    points: dict = field(default_factory=dict)  # path -> {"transform@format": true objective on select}


class _Stop(Exception):
    pass


def decoder_layers(model):
    return model.model.layers


@torch.no_grad()
def _first_layer_inputs(model, input_ids):
    """Hidden states and keyword arguments the model hands decoder layer 0 (then stops the forward)."""
    got = {}

    def pre(mod, args, kwargs):
        got["hidden"] = args[0] if args else kwargs.pop("hidden_states")
        got["kwargs"] = {k: v for k, v in kwargs.items() if k not in ("hidden_states",)}
        raise _Stop

    handle = decoder_layers(model)[0].register_forward_pre_hook(pre, with_kwargs=True)
    try:
        model(input_ids, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    kwargs = got["kwargs"]
    for k in ("cache", "past_key_values"):  # the name depends on the transformers release
        if k in kwargs:
            kwargs[k] = None
    kwargs["use_cache"] = False
    return got["hidden"], kwargs


# Format families whose quantizer the calibration surrogate (`fake_quantize_ste`) models: group min/max scale,
# straight-through rounding. The others' gradients pass the quantization error straight through.
CALIBRATED_FAMILIES = ("bf16", "int")

# Tokens per calibration sequence unless asked otherwise. With recent=128, queries of 512-token sequences see
# at most ~380 quantized keys, all near them; 2048-token sequences show the objective the far, many-key regime
# a long context serves, which lowers held-out KL at more CPU time (benchmarks/results/kl_tails.md).
LENGTH = 2048


def default_length(model, length: int = LENGTH) -> int:
    """`length`, or the model's max_position_embeddings where that is shorter."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return min(length, limit) if limit else length


def check_calibratable(cfg: CacheConfig) -> None:
    """Raise for a format calibration has no honest surrogate for (fp8, fp4, the codebooks)."""
    for path, fmt in ((p, f) for pair in cfg.per_layer for p, f in zip(("content", "rope"), pair)):
        if fmt.family not in CALIBRATED_FAMILIES:
            raise ValueError(f"quantmla calibrates integer formats (int8, int4, int2, channel or token groups) "
                             f"and bf16; {path} {fmt} has no calibration surrogate yet (its gradient would "
                             "ignore the quantization error)")


def calibrate_attention(attn, layer: MLALayer, hidden, position_embeddings, cfg: CacheConfig, steps: int,
                        seed: int, n_queries: int = 64, space: SearchSpace | None = None, positions=None
                        ) -> tuple[ContentTransform | None, RopeTransform | None, LayerReport]:
    """Fit both transforms of one attention from its inputs hidden [B, T, hidden] at `positions` ([B or 1, T],
    `project_queries`) (does not fold them), for queries where cfg's serving policy shows them a quantized
    region (`policy.query_positions`), and choose each path's format among `space`'s points (default: cfg's
    formats only). cfg: this layer's formats."""
    q_nope, q_pe = project_queries(attn, layer, hidden, position_embeddings, positions)
    c, k_pe = project_cache(attn, layer, hidden, position_embeddings)
    pos = query_positions(hidden.shape[1], cfg, n_queries)
    q_nope, q_pe = q_nope[:, :, pos], q_pe[:, :, pos]
    w_uk, w_uv = split_kv_b(attn, layer)
    q_abs = absorb_queries(q_nope.float(), w_uk.float())
    report = LayerReport(layer.cache_idx, layer.module)
    content = rope = None
    if cfg.content.kind != "bf16":
        gamma = attn.kv_a_layernorm.weight.float() * layer.latent_scale
        with torch.enable_grad():
            content, res = calibrate_content(q_abs, q_pe, c, k_pe, w_uv, gamma, layer.softmax_scale, pos, cfg,
                                             steps, seed, space=space)
        # The fold sets kv_a_layernorm.weight = sigma and the model multiplies by the latent scale after it.
        content.scale = content.scale / layer.latent_scale
        _record(report, "content", res)
    if cfg.rope.kind != "bf16":
        with torch.enable_grad():
            judge_output = (space or SearchSpace()).rope_judge == "output"  # else on the QK error
            heads = (q_abs, c, w_uv, layer.softmax_scale) if judge_output else None
            rope, res = calibrate_rope(q_pe, k_pe, pos, layer.cache_pairs, cfg, steps, seed, space=space,
                                       heads=heads)
        _record(report, "rope", res)
    return content, rope, report


def _record(report: LayerReport, path: str, res) -> None:
    for key, name in (("identity", "identity"), ("best", "calibrated"), ("smoothquant", "smoothquant")):
        setattr(report, f"{path}_{key}", res.report[name])
    setattr(report, f"{path}_select", res.best)
    setattr(report, f"{path}_format", str(res.format))
    report.history[path], report.points[path] = res.history, res.points


def chosen_config(cfg: CacheConfig, reports: list[LayerReport]) -> CacheConfig:
    """cfg with the formats the calibration chose, per layer (CacheConfig.layers, by cache index; cfg itself
    where every layer kept cfg's formats). cfg.content / cfg.rope stay the formats asked for. A bf16 path
    stays bf16."""
    reports = sorted(reports, key=lambda r: r.layer)
    pairs = tuple((QuantFormat.parse(r.content_format or c), QuantFormat.parse(r.rope_format or p))
                  for r, (c, p) in zip(reports, (cfg.at(r.layer).per_layer[0] for r in reports)))
    if all(pair == cfg.at(r.layer).per_layer[0] for r, pair in zip(reports, pairs)):
        return cfg
    return replace(cfg, layers=pairs)


@torch.no_grad()
def calibrate_model(model, layers: list[MLALayer], input_ids: torch.Tensor, cfg: CacheConfig, steps: int = 100,
                    seed: int = 0, progress: bool = True, before_layer=None,
                    after_layer=None, space: SearchSpace | None = None) -> list[LayerReport]:
    """Calibrate and fold every MLA attention of `model` in place, one decoder layer at a time.

    cfg: the formats asked for (per layer where cfg.layers is set) and the serving policy; each path's
    format is then chosen among `space`'s points (default `SearchSpace()`: the clipping ratios with channel
    groups, servable by the engine on every device; see `space`), and the reports name what was chosen:
    `chosen_config(cfg, reports)` is the config to serve the result with (`export.save_calibrated` writes it).

    input_ids [N, T]: calibration sequences, N >= 3, split by `search.Splits.of(N)` into fit / select /
    report; T > cfg.sink + cfg.recent, so that queries see quantized keys (longer is closer to serving).
    before_layer(i, block) runs before decoder layer i's forward (e.g. to load its weights), after_layer(i,
    block) once its attentions are folded (e.g. to write and free them).
    """
    cfg = cfg.fit(layers[0].kv_lora_rank, layers[0].rope_dim)
    check_calibratable(cfg)
    Splits.of(input_ids.shape[0])  # fail before the first forward
    query_positions(input_ids.shape[1], cfg, 1)
    hidden, kwargs = _first_layer_inputs(model, input_ids.to(next(model.parameters()).device))
    prefix = layers[0].module.split(".layers.")[0] + ".layers."
    space = SearchSpace() if space is None else space
    reports = []
    bar = tqdm(list(enumerate(decoder_layers(model))), desc="calibrating layers", disable=not progress)
    for i, block in bar:
        if before_layer is not None:
            before_layer(i, block)
        mine = [l for l in layers if l.module.startswith(f"{prefix}{i}.")]
        seen = {}
        with attention_hooks(model, mine, seen):
            out = block(hidden, **kwargs)
        for l in mine:
            attn = attention_module(model, l)
            k = seen[l.cache_idx]
            content, rope, report = calibrate_attention(attn, l, k.hidden, k.position_embeddings,
                                                        cfg.at(l.cache_idx), steps, seed + l.cache_idx,
                                                        space=space, positions=k.positions)
            if content is not None:
                fold_content(attn, l, content)
            if rope is not None:
                fold_rope(attn, l, rope)
            reports.append(report)
        hidden = out[0] if isinstance(out, tuple) else out
        if after_layer is not None:
            after_layer(i, block)
    return reports
