"""A forward of an HF MLA model over whole windows [B, L] whose attention sees the cache as a server does.

Serving semantics (those of the engine's prefill and decode, `quantmla.engine.attention`): a query at position
t sees key p <= t in BF16 (as computed, in the model's dtype) if p < sink or p >= t + 1 - recent, otherwise
as stored: quantized with the path's format, then dequantized. A token-axis (KIVI-style) format quantizes a
token only once its whole block of `group` tokens (blocks counted from `sink`) has left the window, so query
t sees p stored iff p >= sink and block_end(p) <= t + 1 - recent (the rule of `quantmla.policy`,
`stored_from`). Content and RoPE paths decide separately (their formats may differ), per layer
(`CacheConfig.at`). A token's stored value does not depend on the query:
it is what `PathStore` holds for it (formats, clipping, `rope_rotation` as the cache does them); the query
only decides which of the two versions it sees. For channel formats this is exactly what feeding the window
token by token through a `QuantMLACache` gives; for token-axis formats its staging gives the block rule.

How: inside `serving(model, config)` every MLA attention module is replaced by a `ServingAttention` (and the
model's attention implementation by a name transformers builds no mask for), restored on exit. Per layer
the window's c and k_pe and their stored versions are expanded to per-head keys and values once (kv_b_proj,
as the model's own attention and the engine's prefill do), then queries attend in blocks of `query_block`
through `scaled_dot_product_attention` (fp32 softmax; an fp32 model on the CPU computes in fp32 throughout):
each block reads only the keys up to its end, every key once per version some query of the block sees, and
an additive mask picks for each (query, key) the one version it sees. Neither [L, L] scores nor [L, L]
masks exist, and `serving_logits` applies the lm_head to the positions asked for only.

`served_prefill(model, config)` is the same for generation: generate's prefill of a (left-padded) prompt
attends as above and fills a QuantMLACache, whose own window gives the decode steps serving semantics.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from quantmla.cache.quant_cache import PathStore, online_rotation
from quantmla.config import CacheConfig, QuantFormat
from quantmla.mla import project_cache, project_queries
from quantmla.models.adapters import MLALayer, attention_module, describe, register_module_attention
from quantmla.policy import key_versions, stored_from

ATTENTION_NAME = register_module_attention("quantmla_serving", "ServingAttention")
QUERY_BLOCK = 1024  # queries per attention call
KEY_ALIGN = 64  # keys per call padded to a multiple of this (masked): aligned masks keep the kernels fast


def stored_values(x: torch.Tensor, fmt: QuantFormat, config: CacheConfig, what: str,
                  rotation: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, L, D] -> each token as the cache stores it, [B, L, D] in x's dtype: sink and the tokens that no
    query of the window sees stored are left as given."""
    store = PathStore.empty(x[:, None], fmt, what, rotation)
    return store.append(x[:, None], config)[:, 0]


def serving_attention(attn: nn.Module, layer: MLALayer, config: CacheConfig, hidden: torch.Tensor,
                      position_embeddings, rotation: torch.Tensor | None = None,
                      query_block: int = QUERY_BLOCK, projected=None, positions=None) -> torch.Tensor:
    """The attention module's output [B, L, hidden] for a window at positions 0..L-1 under serving semantics;
    `config` is this layer's (one format per path). `projected`: (c, k_pe) of `hidden` where the caller has
    them (project_cache's output), else computed here. positions [B or 1, L]: the position_ids the model
    passed (`project_queries`; 0..L-1 for a window, a padded row's own where generate counts them)."""
    B, L, _ = hidden.shape
    c, k_pe = project_cache(attn, layer, hidden, position_embeddings) if projected is None else projected
    name = f"layer {layer.cache_idx}"
    c_st = stored_values(c, config.content, config, f"{name} content")
    r_st = stored_values(k_pe, config.rope, config, f"{name} rope", rotation)
    # Both versions side by side along the token axis: row p + L * stored.
    kv = attn.kv_b_proj(torch.cat([c, c_st], dim=1)).view(B, 2 * L, layer.num_heads, -1).transpose(1, 2)
    k_nope, v = kv.split([layer.nope_dim, layer.v_dim], dim=-1)
    rope = torch.cat([k_pe, r_st], dim=1)
    q_nope, q_pe = project_queries(attn, layer, hidden, position_embeddings, positions)
    q = torch.cat([q_nope, q_pe], dim=-1)
    sc = stored_from(config.content, config.sink, config.recent, L, hidden.device)
    sr = stored_from(config.rope, config.sink, config.recent, L, hidden.device)
    outs = []
    for lo in range(0, L, query_block):
        hi = min(lo + query_block, L)
        key, cs, rs, first, end = key_versions(sc[:hi], sr[:hi], lo, hi)
        pad = -key.numel() % KEY_ALIGN
        if pad:  # keys no query sees
            key, cs, rs = (torch.cat([t, t.new_zeros(pad)]) for t in (key, cs, rs))
            first, end = (torch.cat([t, t.new_zeros(pad)]) for t in (first, end))
        ci, ri = key + L * cs, key + L * rs
        k = torch.cat([k_nope.index_select(2, ci),
                       rope.index_select(1, ri)[:, None].expand(-1, layer.num_heads, -1, -1)], dim=-1)
        t = torch.arange(lo, hi, device=hidden.device)[:, None]
        seen = (first[None] <= t) & (t < end[None])
        mask = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
        outs.append(F.scaled_dot_product_attention(q[:, :, lo:hi], k, v.index_select(2, ci), attn_mask=mask,
                                                   scale=layer.softmax_scale))
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return attn.o_proj(out.transpose(1, 2).flatten(2))


class ServingAttention(nn.Module):
    """Stands in for one MLA attention module inside `serving`; returns (output, None) as the module does."""

    def __init__(self, attn: nn.Module, layer: MLALayer, config: CacheConfig, query_block: int = QUERY_BLOCK):
        super().__init__()
        self.attn, self.layer, self.config, self.query_block = attn, layer, config, query_block
        self.rotation = online_rotation(config.rope_rotation, layer.rope_dim) if config.rope.kind != "bf16" else None

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, projected=None, position_ids=None, **_):
        rotation = None if self.rotation is None else self.rotation.to(hidden_states.device)
        return serving_attention(self.attn, self.layer, self.config, hidden_states, position_embeddings, rotation,
                                 self.query_block, projected, position_ids), None


def _rows_rolled(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """x [B, L, ...] with row b rolled left by shift[b]: out[b, i] = x[b, (i + shift[b]) % L]."""
    L = x.shape[1]
    idx = (torch.arange(L, device=x.device)[None] + shift.to(x.device)[:, None]) % L
    return x.gather(1, idx.view(*idx.shape, *[1] * (x.dim() - 2)).expand_as(x))


class ServedPrefillAttention(nn.Module):
    """Stands in for one MLA attention module inside `served_prefill`. The forward that brings an empty
    QuantMLACache its first tokens (generate's prefill of the prompt, left-padded as the cache's
    `left_padding` says) attends under serving semantics and writes c and k_pe to the cache; every later
    forward (a decode step, where the cache's own window gives serving semantics) is the module's own."""

    def __init__(self, attn: nn.Module, layer: MLALayer, config: CacheConfig, query_block: int = QUERY_BLOCK):
        super().__init__()
        self.served = ServingAttention(attn, layer, config, query_block)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, **kwargs):
        attn, layer = self.served.attn, self.served.layer
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if cache is None or cache.get_seq_length(layer.cache_idx) > 0:
            return attn(hidden_states, position_embeddings=position_embeddings, **kwargs)
        c, k_pe = project_cache(attn, layer, hidden_states, position_embeddings)
        cache.update(c[:, None], k_pe[:, None], layer.cache_idx)
        # Left-padded rows rolled so each starts at its first real token (positions 0.. as HF gives them);
        # the pads, now last, are seen by no real query.
        B = hidden_states.shape[0]
        pads = getattr(cache, "left_padding", None)
        pads = torch.zeros(B, dtype=torch.long) if pads is None else pads

        def roll(t):  # position embeddings: (cos, sin) [B or 1, T, dr] or DeepSeek-V2's freqs_cis [B or 1, T, dr/2]
            return _rows_rolled(t.expand(B, *t.shape[1:]), pads)

        pe, ids = position_embeddings, kwargs.get("position_ids")  # ids [B or 1, T]: generate counts each row's own
        out, _ = self.served(roll(hidden_states), tuple(map(roll, pe)) if isinstance(pe, tuple) else roll(pe),
                             projected=(roll(c), roll(k_pe)),
                             position_ids=None if ids is None else roll(ids))  # rows and positions rolled alike
        return _rows_rolled(out, -pads), None


@contextmanager
def _attention_replaced(model: nn.Module, config: CacheConfig, module, implementation: str | None = None):
    """Every MLA attention module of `model` replaced by module(attn, layer, its layer's config) (per-layer
    formats through `config.at`), and the attention implementation by `implementation` where given; both put
    back on exit."""
    originals = {}
    try:
        for layer in describe(model):
            attn = attention_module(model, layer)
            cfg = config.at(layer.cache_idx).fit(layer.kv_lora_rank, layer.rope_dim)
            model.set_submodule(layer.module, module(attn, layer, cfg))
            originals[layer.module] = attn
        own = model.config._attn_implementation
        model.config._attn_implementation = implementation or own
        try:
            yield model
        finally:
            model.config._attn_implementation = own
    finally:
        for name, attn in originals.items():
            model.set_submodule(name, attn)


def serving(model: nn.Module, config: CacheConfig, query_block: int = QUERY_BLOCK):
    """Within the block, `model(ids, use_cache=False)` over windows starting at position 0 attends with
    serving semantics for `config` (per-layer formats through `config.at`); the model's own attention
    modules and attention implementation are put back on exit."""
    return _attention_replaced(model, config, lambda a, la, c: ServingAttention(a, la, c, query_block),
                               ATTENTION_NAME)


def served_prefill(model: nn.Module, config: CacheConfig, query_block: int = QUERY_BLOCK):
    """Within the block, `model.generate(ids, <cache kwarg>=QuantMLACache(config, left_padding=...))` prefills
    the prompt under serving semantics (`ServedPrefillAttention`) and decodes through the cache, so every
    token attends as on a server; the model's own attention modules are put back on exit. With channel
    formats, exactly `serving` semantics; token-axis formats count blocks over the pads in the cache."""
    return _attention_replaced(model, config, lambda a, la, c: ServedPrefillAttention(a, la, c, query_block))


@torch.no_grad()
def serving_logits(model: nn.Module, ids: torch.Tensor, config: CacheConfig, logits_to_keep: int | torch.Tensor,
                   query_block: int = QUERY_BLOCK) -> torch.Tensor:
    """Logits of windows ids [B, L] (positions 0..L-1) under serving semantics, at the positions
    `logits_to_keep` names (transformers' meaning: the last N, or a 1-D tensor of positions): [B, kept, V]."""
    with serving(model, config, query_block):
        return model(input_ids=ids.to(model.device), use_cache=False, logits_to_keep=logits_to_keep).logits
