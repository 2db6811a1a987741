"""Capture what each MLA attention sees and caches, with forward hooks (no monkeypatching).

`capture(model, input_ids)` runs one forward pass and returns, per cache index, the attention's input
hidden states, the position embeddings and position ids it received, its output, and the (c, k_pe) it wrote
to the cache.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from quantmla.models.adapters import MLALayer, attention_module, cache_kwargs


@dataclass
class Captured:
    hidden: torch.Tensor  # [B, T, hidden]  input of the attention module
    position_embeddings: object  # (cos, sin) or complex freqs_cis, as the model passed them
    output: torch.Tensor  # [B, T, hidden]  attention output after o_proj
    heads: torch.Tensor  # [B, T, H*dv]    attention output before o_proj
    c: torch.Tensor | None = None  # [B, T, dc]  cached content latent
    k_pe: torch.Tensor | None = None  # [B, T, dr]  cached post-RoPE key
    positions: torch.Tensor | None = None  # [B or 1, T]  position_ids, as the model passed them (if it did)


@contextmanager
def attention_hooks(model, layers: list[MLALayer], store: dict[int, Captured]):
    """While active, every forward of the listed attentions records a Captured in `store[cache_idx]`."""
    handles = []
    for layer in layers:
        attn = attention_module(model, layer)
        pending = {}

        def pre(mod, args, kwargs, pending=pending):
            pending["hidden"] = kwargs.get("hidden_states", args[0] if args else None)
            pending["pe"] = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
            pending["positions"] = kwargs.get("position_ids")

        def post(mod, args, kwargs, out, pending=pending, idx=layer.cache_idx):
            store[idx] = Captured(pending["hidden"], pending["pe"], out[0], pending.get("heads"),
                                  positions=pending["positions"])

        def o_pre(mod, args, pending=pending):
            pending["heads"] = args[0]

        handles += [attn.register_forward_pre_hook(pre, with_kwargs=True),
                    attn.register_forward_hook(post, with_kwargs=True),
                    attn.o_proj.register_forward_pre_hook(o_pre)]
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def capture(model, layers: list[MLALayer], input_ids: torch.Tensor, **kwargs) -> dict[int, Captured]:
    """One forward pass over input_ids; returns {cache_idx: Captured} with the cache contents filled in."""
    store: dict[int, Captured] = {}
    cache = DynamicCache(config=model.config)
    with attention_hooks(model, layers, store):
        model(input_ids, use_cache=True, **cache_kwargs(model, cache), **kwargs)
    for layer in layers:
        cache_layer = cache.layers[layer.cache_idx]
        store[layer.cache_idx].c = cache_layer.keys[:, 0]
        store[layer.cache_idx].k_pe = cache_layer.values[:, 0]
    return store
