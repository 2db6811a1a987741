"""When a cached token is quantized: the one rule that QuantMLACache, the paged cache (its writers, `gather`
and the decode kernel's bounds), the engine's prefill and the serving evaluation all follow.

Positions [0, sink) are never quantized. From `sink` on, a path quantizes its tokens in blocks of
`block_of(fmt)` tokens counted from sink (1 for channel formats and bf16; `group` for token-axis, KIVI-style
formats), and a block is quantized once all of it has left the last `recent` positions. So once L tokens are
cached, positions [sink, quantized_end(L)) are quantized; a query at position t (which sees the cache of
length t + 1) sees key p stored iff p < quantized_end(t + 1), i.e. iff t >= stored_from(p). Past the sink at
most `ring_size` positions of a path are unquantized at any length: recent + block - 1.
"""

from __future__ import annotations

import torch

from quantmla.config import QuantFormat

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
