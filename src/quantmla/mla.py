"""Reference MLA math in plain torch, the oracle every other part is checked against.

Shapes: B batch, H heads, T query tokens, S cached tokens, dc = kv_lora_rank, dr = rope dims.
The cache holds c [B, S, dc] (after kv_a_layernorm and any latent scale) and k_pe [B, S, dr] (after RoPE).
Absorbed decode never builds per-head keys or values:
    q~_h  = W_uk,h^T q_nope,h                    [B, H, T, dc]
    s_h   = scale * (q~_h . c + q_pe,h . k_pe)     [B, H, T, S]
    l_h   = softmax(s_h) c                         [B, H, T, dc]   (output in latent space)
    o_h   = W_uv,h l_h                             [B, H, T, dv] -> o_proj
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantmla.models.adapters import MLALayer


def apply_rope(x: torch.Tensor, position_embeddings, layer: MLALayer) -> torch.Tensor:
    """RoPE on the rope part x [B, H, T, dr] exactly as the family's own modeling code does it.

    position_embeddings: what the model passes to its attention — (cos, sin) [B, T, dr], or, for
    DeepSeek-V2, complex freqs_cis [B, T, dr/2].
    """
    if layer.rope_style == "complex":
        freqs = position_embeddings.unsqueeze(1)
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs).flatten(3).type_as(x)
    cos, sin = (t.unsqueeze(1) for t in position_embeddings)
    if layer.rope_style == "interleave":
        cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def query_position_factor(layer: MLALayer, positions: torch.Tensor) -> torch.Tensor:
    """positions [B or 1, T] integer -> the factor [B or 1, 1, T, 1] float32 that multiplies the whole query
    after RoPE: 1 + query_pos_beta * log(1 + floor(position / query_pos_max)), as Mistral 4 computes it."""
    return (1 + layer.query_pos_beta * torch.log(1 + torch.floor(positions / layer.query_pos_max)))[:, None, :, None]


def project_queries(attn: nn.Module, layer: MLALayer, hidden: torch.Tensor, position_embeddings,
                    positions: torch.Tensor | None = None):
    """hidden [B, T, hidden] -> (q_nope [B, H, T, dn], q_pe [B, H, T, dr] after RoPE), in hidden's dtype.

    positions [B or 1, T] integer: the query tokens' positions (what the model passes its attention as
    position_ids). Required by a layer whose query has a position factor (`MLALayer.query_pos_beta`, Mistral 4):
    ValueError without them; unused otherwise.
    """
    if layer.q_path == "q_proj":
        q = attn.q_proj(hidden)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden)))
    q = q.view(*hidden.shape[:-1], layer.num_heads, layer.qk_head_dim).transpose(1, 2)
    if layer.query_scale != 1.0:  # a kernel per call saved in every decode step of the other families
        q = q * layer.query_scale
    q_nope, q_pe = q.split([layer.nope_dim, layer.rope_dim], dim=-1)
    q_pe = apply_rope(q_pe, position_embeddings, layer)
    if layer.query_pos_beta:
        if positions is None:
            raise ValueError(f"{layer.module}: a {layer.model_type} query is scaled by its position: "
                             "project_queries needs the query positions")
        factor = query_position_factor(layer, positions.to(q.device)).to(q.dtype)
        q_nope, q_pe = q_nope * factor, q_pe * factor
    return q_nope, q_pe


def split_kv_b(attn: nn.Module, layer: MLALayer) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj.weight -> (W_uk [H, dn, dc], W_uv [H, dv, dc])."""
    w = attn.kv_b_proj.weight.view(layer.num_heads, layer.nope_dim + layer.v_dim, layer.kv_lora_rank)
    return w[:, : layer.nope_dim], w[:, layer.nope_dim :]


def absorb_queries(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [B, H, T, dn], W_uk [H, dn, dc] -> q~ [B, H, T, dc]."""
    return torch.einsum("bhtn,hnc->bhtc", q_nope, w_uk)


def latent_attention(q_abs, q_pe, c, k_pe, scale: float, causal: bool = True, dtype: torch.dtype = torch.float32):
    """Softmax attention over the cache in latent space.

    q_abs [B, H, T, dc], q_pe [B, H, T, dr], c [B, S, dc], k_pe [B, S, dr]; queries are the last T of the S
    positions when causal. Returns (latent output [B, H, T, dc], log-sum-exp [B, H, T]), in `dtype`.
    """
    q_abs, q_pe, c, k_pe = (t.to(dtype) for t in (q_abs, q_pe, c, k_pe))
    scores = scale * (torch.einsum("bhtc,bsc->bhts", q_abs, c) + torch.einsum("bhtr,bsr->bhts", q_pe, k_pe))
    if causal:
        t, s = scores.shape[-2:]
        future = torch.ones(t, s, dtype=torch.bool, device=scores.device).triu(s - t + 1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("bhts,bsc->bhtc", torch.exp(scores - lse.unsqueeze(-1)), c), lse


def attention_from_cache(attn, layer: MLALayer, hidden, position_embeddings, c, k_pe, causal: bool = True,
                         positions=None):
    """The attention module's output (after o_proj) computed in absorbed form from the cache (c, k_pe).

    c [B, S, dc] and k_pe [B, S, dr] must already contain the T tokens of `hidden` [B, T, hidden] at their end;
    positions: the queries' ([B or 1, T], `project_queries`).
    Returns (output [B, T, hidden], per-head values before o_proj [B, T, H*dv]).
    """
    q_nope, q_pe = project_queries(attn, layer, hidden, position_embeddings, positions)
    w_uk, w_uv = split_kv_b(attn, layer)
    latent, _ = latent_attention(absorb_queries(q_nope.float(), w_uk.float()), q_pe, c, k_pe,
                                 layer.softmax_scale, causal)
    heads = torch.einsum("bhtc,hvc->bthv", latent, w_uv.float()).flatten(2).to(hidden.dtype)
    return attn.o_proj(heads), heads


def expanded_attention(attn, layer: MLALayer, hidden, position_embeddings, c, k_pe, positions=None):
    """The same output computed the expanded way (per-head K/V materialised), for cross-checks."""
    q_nope, q_pe = project_queries(attn, layer, hidden, position_embeddings, positions)
    kv = attn.kv_b_proj(c).view(*c.shape[:2], layer.num_heads, -1).transpose(1, 2)
    k_nope, v = kv.split([layer.nope_dim, layer.v_dim], dim=-1)
    k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, layer.num_heads, -1, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    t, s = q.shape[-2], k.shape[-2]
    mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.softmax_scale)
    heads = out.transpose(1, 2).flatten(2)
    return attn.o_proj(heads), heads


def project_cache(attn: nn.Module, layer: MLALayer, hidden: torch.Tensor, position_embeddings):
    """What the attention writes to the cache for hidden [B, T, hidden]: (c [B, T, dc], k_pe [B, T, dr])."""
    kv = attn.kv_a_proj_with_mqa(hidden)
    c, k_pe = kv.split([layer.kv_lora_rank, layer.rope_dim], dim=-1)
    c = attn.kv_a_layernorm(c)
    if layer.latent_scale != 1.0:
        c = c * layer.latent_scale
    return c, apply_rope(k_pe.unsqueeze(1), position_embeddings, layer).squeeze(1)
