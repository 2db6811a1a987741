"""A byte budget as the input: choose bits and group size per path and layer, then calibrate for them.

    cfg = choose_formats(model, layers, input_ids, base_cfg, budget=0.27, context=131072)
    calibrate_model(model, layers, input_ids, cfg)          # the usual search, at the chosen formats

The budget is a fraction of the BF16 cache at `context` tokens (the sink + recent window counted in BF16).
Every candidate format (`candidates`: bf16 and channel-grouped int8/int4/int2 at several group sizes, all
servable; for the content path also `ranked_candidates`, scored in the principal axes they are meant for) of
every path and layer is scored by one common measure, the layer's attention-output NMSE with only that path
quantized (RTN, the serving policy), on the fit + selection sequences (the report sequences stay untouched);
a knapsack over the per-token bytes then picks, per path and layer, the formats of least summed error that
fit the budget. The transforms are fitted afterwards for the chosen formats, so the allocation sees RTN
errors; calibration lowers them further (by different factors per format, which the allocation does not
know).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from quantmla.calibrate.content import attention_heads, axes_start, content_error
from quantmla.calibrate.search import Splits
from quantmla.capture import capture
from quantmla.config import CacheConfig, QuantFormat
from quantmla.mla import absorb_queries, project_queries, split_kv_b
from quantmla.models.adapters import MLALayer, attention_module
from quantmla.policy import query_positions, quantize_body, quantized_keys
from quantmla.quant.formats import bytes_per_token, fake_quantize

CONTEXT = 131072
CONTENT_GROUPS = (32, 64, 128, 256)
ROPE_GROUPS = (16, 32, 64)


def candidates(dim: int, groups: tuple[int, ...]) -> list[QuantFormat]:
    """bf16 and int8/int4/int2 with every group of `groups` that divides `dim` (the whole path if none does)."""
    fits = [g for g in groups if g <= dim and dim % g == 0] or [dim]
    return [QuantFormat("bf16")] + [QuantFormat(k, g) for k in ("int8", "int4", "int2") for g in fits]


RANK_FRACTIONS = (1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4)


def ranked_candidates(dim: int) -> list[QuantFormat]:
    """int8/int4/int2 storing the leading RANK_FRACTIONS of `dim` channels, in whole groups of 64 channels (of
    dim / 8 for paths narrower than 512)."""
    group = min(64, dim // 8)
    if group < 1 or dim % group:
        return []
    ranks = sorted({round(f * dim / group) * group for f in RANK_FRACTIONS} - {0, dim})
    # an odd group (dim / 8 for e.g. 200 channels: 25) gives ranks int4/int2 cannot pack into whole bytes
    return [QuantFormat(k, group, rank=r) for k in ("int8", "int4", "int2") for r in ranks
            if r * QuantFormat(k).bits % 8 == 0]


def fraction_at(body_bytes: float, bf16_bytes: int, cfg: CacheConfig, context: int) -> float:
    """Cache bytes at `context` tokens / BF16's, with sink + recent BF16 and every other token at body_bytes."""
    window = min(cfg.sink + cfg.recent, context)
    return (window * bf16_bytes + (context - window) * body_bytes) / (context * bf16_bytes)


def check_budget(budget: float) -> None:
    """Raises ValueError unless 0 < budget <= 1: a byte budget is a fraction of the BF16 cache."""
    if not 0 < budget <= 1:
        raise ValueError(f"a byte budget is a fraction of the BF16 cache in (0, 1], got {budget}")


@dataclass
class Allocation:
    config: CacheConfig  # cfg with the chosen per-layer formats
    fraction: float  # at `context`, the mean over layers
    context: int
    errors: dict  # (layer, path) -> {format: attention-output NMSE (RTN)}
    budget: float  # the fraction asked for

    def summary(self) -> str:
        """One log line: the budget, the formats chosen per layer and the fraction they take."""
        return (f"budget {100 * self.budget:.1f} % of BF16 at {self.context} tokens: chose, per layer (content / "
                f"rope), {', '.join(f'{c}/{r}' for c, r in self.config.per_layer)} = {100 * self.fraction:.2f} % "
                "(before choosing clipping ratios, which cost no bytes)")


def rope_error(q_abs, q_pe, c, k_pe, w_uv, scale, q_pos, cfg: CacheConfig, ref) -> torch.Tensor:
    """Attention-output NMSE with only the RoPE cache quantized (cfg.rope, RTN, the serving policy)."""
    quantized = quantized_keys(q_pos.to(k_pe.device), k_pe.shape[1], cfg, cfg.rope).float()
    delta = quantize_body(k_pe, cfg.rope, cfg.sink, fake_quantize) - k_pe
    out = attention_heads(q_abs, q_pe, c, k_pe, w_uv, scale, q_pos, None, quantized, delta)
    return (out - ref).pow(2).sum() / ref.pow(2).sum()


@torch.no_grad()
def format_errors(model, layers: list[MLALayer], input_ids: torch.Tensor, cfg: CacheConfig,
                  n_queries: int = 64, ranked: bool = True) -> dict:
    """(layer, path) -> {QuantFormat: attention-output NMSE with that path of that layer alone quantized}, on
    the fit + selection sequences of Splits.of(N); ranked: also the content path's `ranked_candidates`."""
    splits = Splits.of(input_ids.shape[0])
    chosen = slice(splits.fit.start, splits.select.stop)
    ids = input_ids[chosen]
    store = capture(model, layers, ids.to(next(model.parameters()).device))
    pos = query_positions(ids.shape[1], cfg, n_queries)
    out = {}
    for layer in layers:
        attn, cap = attention_module(model, layer), store[layer.cache_idx]
        q_nope, q_pe = project_queries(attn, layer, cap.hidden, cap.position_embeddings, cap.positions)
        w_uk, w_uv = split_kv_b(attn, layer)
        q_abs = absorb_queries(q_nope[:, :, pos].float(), w_uk.float())
        q_pe = q_pe[:, :, pos].float()
        c, k_pe, w_uv = cap.c.float(), cap.k_pe.float(), w_uv.float()
        ref = attention_heads(q_abs, q_pe, c, k_pe, w_uv, layer.softmax_scale, pos)
        gamma = torch.ones(c.shape[-1], device=c.device)
        eye = torch.eye(c.shape[-1], device=c.device)
        batch = (q_abs, q_pe, c, k_pe, w_uv, layer.softmax_scale, pos, ref)

        def content(f, rotation=eye, sigma=gamma):
            return float(content_error(batch, gamma, rotation, sigma, replace(cfg, content=f), fake_quantize))

        out[(layer.cache_idx, "content")] = {
            f: 0.0 if f.kind == "bf16" else content(f) for f in candidates(layer.kv_lora_rank, CONTENT_GROUPS)}
        if ranked:
            axes, axes_sigma = axes_start(c, min(64, c.shape[-1] // 8), torch.Generator().manual_seed(0))
            out[(layer.cache_idx, "content")].update(
                {f: content(f, axes, axes_sigma) for f in ranked_candidates(layer.kv_lora_rank)})
        out[(layer.cache_idx, "rope")] = {
            f: 0.0 if f.kind == "bf16" else float(rope_error(q_abs, q_pe, c, k_pe, w_uv, layer.softmax_scale, pos,
                                                             replace(cfg, rope=f), ref))
            for f in candidates(layer.rope_dim, ROPE_GROUPS)}
    return out


def knapsack(items: list[list[tuple[float, int]]], capacity: int) -> list[int] | None:
    """Pick one (error, bytes) option per item, total bytes <= capacity (integers), least total error.
    Returns the chosen index per item, or None if even the cheapest options do not fit."""
    if capacity < 0:  # the BF16 sink + recent window alone exceeds the budget (a short --context)
        return None
    inf = float("inf")
    best = torch.full((capacity + 1,), inf, dtype=torch.float64)
    best[0] = 0.0
    picks = []
    for options in items:
        new = torch.full_like(best, inf)
        arg = torch.full((capacity + 1,), -1, dtype=torch.long)
        for i, (err, size) in enumerate(options):
            if size > capacity:
                continue
            cand = torch.full_like(best, inf)
            cand[size:] = best[: capacity + 1 - size] + err
            better = cand < new
            new[better], arg[better] = cand[better], i
        best = new
        picks.append(arg)
    end = int(torch.argmin(best))
    if best[end] == inf:
        return None
    chosen = []
    for options, arg in zip(reversed(items), reversed(picks)):
        i = int(arg[end])
        chosen.append(i)
        end -= options[i][1]
    return chosen[::-1]


def choose_formats(model, layers: list[MLALayer], input_ids: torch.Tensor, cfg: CacheConfig, budget: float,
                   context: int = CONTEXT, ranked: bool = True) -> Allocation:
    """Per path and layer, the candidate formats of least summed attention-output error (RTN) whose cache, at
    `context` tokens, is at most `budget` of BF16's (mean over layers). Raises ValueError when even int2
    everywhere exceeds the budget."""
    check_budget(budget)
    layer0 = layers[0]
    dc, dr = layer0.kv_lora_rank, layer0.rope_dim
    cfg = cfg.fit(dc, dr)
    bf16 = 2 * (dc + dr)
    window = min(cfg.sink + cfg.recent, context)
    # Mean body bytes per layer allowed: budget * context * bf16 = window * bf16 + (context - window) * body.
    body = (budget * context * bf16 - window * bf16) / max(context - window, 1)
    capacity = int(body * len(layers))
    errors = format_errors(model, layers, input_ids, cfg, ranked=ranked)
    keys = [(l.cache_idx, p) for l in layers for p in ("content", "rope")]
    dims = {"content": dc, "rope": dr}
    items = [[(e, bytes_per_token(f, dims[p])) for f, e in errors[(i, p)].items()] for i, p in keys]
    picked = knapsack(items, capacity)
    if picked is None:
        least = sum(min(b for _, b in options) for options in items) / len(layers)
        raise ValueError(f"--budget {budget}: even the smallest formats take "
                         f"{100 * fraction_at(least, bf16, cfg, context):.1f} % of BF16 at {context} tokens")
    formats = {k: list(errors[k])[i] for k, i in zip(keys, picked)}
    pairs = tuple((formats[(l.cache_idx, "content")], formats[(l.cache_idx, "rope")]) for l in layers)
    mean_body = sum(bytes_per_token(c, dc) + bytes_per_token(r, dr) for c, r in pairs) / len(pairs)
    return Allocation(replace(cfg, layers=pairs), fraction_at(mean_body, bf16, cfg, context), context, errors, budget)
