"""Which cached keys a query sees quantized under the serving policy (CacheConfig.sink / recent), for the
objectives that model the cache: calibration (`calibrate/`) and the amplification experiment (`analysis/`).

Decoding token by token, QuantMLACache holds the key at position u quantized for the query at position t
iff u is in [sink, t + 1 - recent): the first `sink` tokens and the `recent` newest ones (t included) stay
BF16. A token-axis format quantizes whole blocks of `group` tokens counted from the sink; a token that left
the window waits in BF16 (staging) until its block is full, so its region ends at a block boundary.
"""

from __future__ import annotations

import torch

from quantmla.config import CacheConfig, QuantFormat


def block(fmt: QuantFormat) -> int:
    """Tokens quantized together: a token-axis format's block, else 1."""
    return fmt.group if fmt.axis == "token" else 1


def quantized_keys(q_pos: torch.Tensor, length: int, cfg: CacheConfig, fmt: QuantFormat) -> torch.Tensor:
    """bool [Tq, length]: True where the query at q_pos[i] sees the key at position u quantized (`fmt` is the
    path's format; only its block matters). Keys after the query are False (not seen at all)."""
    u = torch.arange(length, device=q_pos.device)
    left = (q_pos + 1 - cfg.recent - cfg.sink).clamp_min(0)  # tokens past the sink that left the window
    end = cfg.sink + left // block(fmt) * block(fmt)
    return (u[None, :] >= cfg.sink) & (u[None, :] < end[:, None])


def query_positions(length: int, cfg: CacheConfig, n: int) -> torch.Tensor:
    """Up to n query positions, evenly spread over [sink + 2 recent, length) — queries that see at least
    `recent` quantized keys — or over [sink + recent, length) in sequences too short for that.
    Raises ValueError when no query of a `length`-token sequence sees a quantized key."""
    first = cfg.sink + cfg.recent
    if length <= first:
        raise ValueError(f"sequences of {length} tokens are too short for sink {cfg.sink} + recent {cfg.recent}: "
                         f"no query sees a quantized key (use sequences longer than {first} tokens, or a "
                         "smaller recent window)")
    if length > first + cfg.recent:
        first += cfg.recent
    return torch.linspace(first, length - 1, min(n, length - first)).round().long().unique()


def quantize_body(x: torch.Tensor, fmt: QuantFormat, sink: int, quant) -> torch.Tensor:
    """x [B, S, D] with quant(·, fmt) applied to the tokens a cache would ever hold quantized: from the sink
    on, in whole blocks (token-axis formats); the others unchanged. Differentiable when quant is."""
    n = (x.shape[1] - sink) // block(fmt) * block(fmt)
    if n <= 0:
        return x
    return torch.cat([x[:, :sink], quant(x[:, sink:sink + n], fmt), x[:, sink + n:]], dim=1)


def policy_attention(q_abs, q_pe, c, k_pe, scale: float, q_pos: torch.Tensor, quantized: torch.Tensor,
                     delta_c=None, delta_pe=None) -> torch.Tensor:
    """Latent attention output [B, H, Tq, dc] of queries q_abs [B, H, Tq, dc], q_pe [B, H, Tq, dr] at positions
    q_pos [Tq] over the cache c [B, S, dc], k_pe [B, S, dr], where each query sees c + delta_c and k_pe +
    delta_pe (the cache's error; None: none) at the keys its row of `quantized` [Tq, S] (float) marks, and the
    clean cache elsewhere: what it attends to when serving. Differentiable in the deltas."""
    scores = torch.einsum("bhtc,bsc->bhts", q_abs, c) + torch.einsum("bhtr,bsr->bhts", q_pe, k_pe)
    if delta_c is not None:
        scores = scores + torch.einsum("bhtc,bsc->bhts", q_abs, delta_c) * quantized
    if delta_pe is not None:
        scores = scores + torch.einsum("bhtr,bsr->bhts", q_pe, delta_pe) * quantized
    future = torch.arange(c.shape[1], device=c.device)[None, :] > q_pos.to(c.device)[:, None]
    probs = torch.softmax((scale * scores).masked_fill(future, float("-inf")), dim=-1)
    latent = torch.einsum("bhts,bsc->bhtc", probs, c)
    if delta_c is not None:
        latent = latent + torch.einsum("bhts,bsc->bhtc", probs * quantized, delta_c)
    return latent
