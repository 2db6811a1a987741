"""Which cached keys a query sees quantized: the one rule that QuantMLACache, the paged cache (its writers,
`gather` and the decode kernel's bounds), the engine's prefill, the serving evaluation and the objectives
that model the cache (calibration, `calibrate/`, and the amplification experiment, `analysis/`) all follow.

Positions [0, sink) are never quantized (CacheConfig.sink). From `sink` on, a path quantizes its tokens in
blocks of `block_of(fmt)` tokens counted from sink (1 for channel formats and bf16; `group` for token-axis,
KIVI-style formats), and a block is quantized once all of it has left the last `recent` positions (a token
that left the window waits in BF16, staged, until its block is full). So once L tokens are cached,
positions [sink, quantized_end(L)) are quantized; a query at position t (which sees the cache of length
t + 1) sees key p stored iff p < quantized_end(t + 1), i.e. iff t >= stored_from(p). Past the sink at most
`ring_size` positions of a path are unquantized at any length: recent + block - 1.
"""

from __future__ import annotations

import torch

from quantmla.config import CacheConfig, QuantFormat

NEVER = 1 << 62  # "no query sees this key stored"


def block_of(fmt: QuantFormat) -> int:
    """Tokens a path quantizes together: a token-axis format's block, else 1 (every token on its own)."""
    return fmt.group if fmt.axis == "token" else 1


def block_start(pos, sink: int, block: int):
    """First position of the block of `pos` (>= sink): blocks of `block` tokens counted from sink. `pos` an
    int or an integer tensor (elementwise)."""
    return sink + (pos - sink) // block * block


def quantized_end(length, sink: int, recent: int, block: int):
    """Q such that positions [sink, Q) are quantized once `length` tokens are cached: the end of the last
    block that lies wholly before length - recent; sink if none. `length` an int (returns an int) or an
    integer tensor (returns one, elementwise)."""
    if isinstance(length, torch.Tensor):
        return block_start((length - recent).clamp_min(sink), sink, block)
    return block_start(max(length - recent, sink), sink, block)


def ring_size(recent: int, block: int) -> int:
    """Unquantized positions past the sink a path of `block` tokens per block holds at most."""
    return recent + block - 1


def stored_from(fmt: QuantFormat, sink: int, recent: int, length: int, device=None) -> torch.Tensor:
    """[length] int64: for each key p, the first query position that sees it stored (NEVER for sink tokens
    and bf16 paths, whose stored value is the BF16 one): the smallest t with p < quantized_end(t + 1)."""
    p = torch.arange(length, device=device)
    if fmt.kind == "bf16":
        return torch.full_like(p, NEVER)
    block = block_of(fmt)
    end = block_start(p.clamp_min(sink), sink, block) + block  # end of p's block
    return torch.where(p < sink, NEVER, end - 1 + recent)


def key_versions(sc: torch.Tensor, sr: torch.Tensor, lo: int, hi: int):
    """The keys a block of queries [lo, hi) reads: one entry per (key p < hi, version of (content, rope) some
    query of the block sees). sc, sr [hi]: `stored_from` of each path. Returns (key, content stored, rope
    stored, first query, end query) [n] each: query t sees the entry iff first <= t < end."""
    p = torch.arange(hi, device=sc.device)
    first_stored, both_stored = torch.minimum(sc, sr), torch.maximum(sc, sr)
    no, yes = torch.zeros_like(p, dtype=torch.bool), torch.ones_like(p, dtype=torch.bool)
    versions = [(no, no, p, first_stored),  # both BF16: from p itself until the first path is stored
                (sc < sr, sr < sc, first_stored, both_stored),  # one path stored (empty where sc == sr)
                (yes, yes, both_stored, torch.full_like(p, NEVER))]  # both stored
    out = []
    for c, r, a, b in versions:
        keep = torch.maximum(a, torch.full_like(a, lo)) < torch.minimum(b, torch.full_like(b, hi))
        out.append([t[keep] for t in (p, c, r, a, b)])
    return [torch.cat(parts) for parts in zip(*out)]


def quantized_keys(q_pos: torch.Tensor, length: int, cfg: CacheConfig, fmt: QuantFormat) -> torch.Tensor:
    """bool [Tq, length]: True where the query at q_pos[i] sees the key at position u quantized (`fmt` is the
    path's format; only its block matters). Keys after the query are False (not seen at all)."""
    u = torch.arange(length, device=q_pos.device)
    end = quantized_end(q_pos + 1, cfg.sink, cfg.recent, block_of(fmt))
    return (u[None, :] >= cfg.sink) & (u[None, :] < end[:, None])


def check_window_fits(max_positions: int | None, sink: int, recent: int) -> None:
    """Raises ValueError when a model of max_positions positions keeps every token in the sink + recent BF16
    window, so that nothing it runs is ever quantized (and no longer sequence can be used instead)."""
    if max_positions and max_positions <= sink + recent:
        fix = f", e.g. --recent {max_positions - sink - 1}" if max_positions > sink + 1 else ""
        raise ValueError(f"sink {sink} + recent {recent} BF16 tokens cover all {max_positions} positions of the "
                         f"model (max_position_embeddings): no key would ever be quantized; use a --sink and "
                         f"--recent that add up to less than {max_positions}{fix}")


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
    n = (x.shape[1] - sink) // block_of(fmt) * block_of(fmt)
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
