"""The engine's attention: the model's own MLA module, wrapped so that it reads and writes the paged pool.

`PagedAttention` replaces each attention module of the model (module composition, the model's weights and
every other module stay its own). What it does depends on the step the runner announces in its
`StepContext`:
  - `Prefill` (`Prefill.plan(...)`, once per chunk): one chunk of one sequence, hidden [1, n, hidden] at
    positions [start, start + n): `prefill_attention`;
  - `Decode(block_tables, seq_lens, slots, max_seq_len, checked)`: one token per sequence, hidden [B, 1,
    hidden]: `quantmla.decode_step.decode_step` (a decode kernel on CUDA, the torch oracle elsewhere).

Both see the cache exactly as it is served: a query at position t sees key u with each path quantized iff
t >= stored_from(u) (`quantmla.policy`): channel formats quantize the keys of [sink, t + 1 - recent),
token-axis formats whole blocks of g tokens (from sink) that have left the window; the other keys it sees in
BF16. So a prompt gives the same cache and the same logits whether it is prefilled at once, in chunks, or
token by token, and a sequence recomputed after a preemption continues exactly as it would have without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quantmla.cache.paged import ChunkRows, PagedMLACache
from quantmla.decode_step import decode_step
from quantmla.mla import project_cache, project_queries
from quantmla.models.adapters import MLALayer
from quantmla.policy import NEVER, key_versions, stored_from


QUERY_BLOCK = 1024  # prefill queries attend in blocks of this many: each block reads only the keys it can see
KEY_ALIGN = 64  # keys per block are padded to a multiple of this (masked keys)


@dataclass
class QueryBlock:
    """Queries [queries) of a chunk and the keys they can see: rows [0, keys) of the layer's keys
    (`ChunkPlan.keys_c`) once `copies` are done: served positions [0, served), then the block's band entries
    (each copy (dst, src, n) moves rows [src, src + n) to [dst, dst + n)), then pad keys it does not see
    (whatever rows the buffer holds there); `mask` [len(queries), keys] additive (0 / -inf)."""

    queries: slice
    keys: int
    copies: list[tuple[int, int, int]]
    mask: torch.Tensor


def plan_key(cache: PagedMLACache) -> tuple:
    """What a chunk's plan depends on besides positions: the window and, per path, block and bf16-ness."""
    return cache.sink, cache.recent, *((p.block, ring, p.fmt.kind == "bf16") for p, _, ring in cache.paths())


def _runs(idx: torch.Tensor) -> list[tuple[int, int, int]]:
    """(offset, first value, length) of each run of consecutive values in idx [n] int64 (host)."""
    if not len(idx):
        return []
    cut = (torch.nonzero(idx.diff() != 1).flatten() + 1).tolist()
    vals = idx.tolist()
    return [(a, vals[a], b - a) for a, b in zip([0, *cut], [*cut, len(vals)])]


@dataclass
class ChunkPlan:
    """One chunk's pool rows, key rows and query blocks for the caches of one layout (`plan_key`)."""

    rows: tuple[ChunkRows, ChunkRows]  # where the chunk's tokens go (`PagedMLACache.chunk_rows`)
    # [end + gap + E] int64, or None where no query sees a band entry: the rows of served ++ band (`ChunkView`)
    # that make a layer's keys (content, rope): served positions, a gap the blocks copy their band entries
    # into, then the E band entries.
    keys_c: torch.Tensor | None
    keys_r: torch.Tensor | None
    blocks: list[QueryBlock]

    @classmethod
    def build(cls, cache: PagedMLACache, block_table: torch.Tensor, start: int, n: int, dtype: torch.dtype,
              query_block: int | None = None) -> ChunkPlan:
        """block_table [max_blocks] int32 covers start + n tokens; `cache` any layer's with this layout.

        Query t sees key u <= t with each path stored iff t >= stored_from(u) (`quantmla.policy`, the
        rule of the serving eval). The served cache after the chunk holds every key in the version the
        chunk's last query sees; it serves query t iff t is past the first query that sees that version. Every
        other version some query of the chunk sees (`key_versions`) is a band entry, seen by its queries
        [first, end): its content and rope come from the served cache where that holds them (stored, or not
        yet quantized; a bf16 path's pool holds its BF16 values) and from the path's band otherwise. The
        versions are positions only, computed on the host. Blocking the queries keeps the keys of each block
        to those it can see: about half the causal square, and only ~block + window band entries; a block's
        entries are a few runs of consecutive ones (one per version kind), so it moves them as slices."""
        query_block = query_block or QUERY_BLOCK
        rows = cache.chunk_rows(block_table, start, n)
        end, dev = start + n, block_table.device
        paths = (cache.content, cache.rope)
        sf = [stored_from(p.fmt, cache.sink, cache.recent, end) for p in paths]
        key, cs, rs, first, last = key_versions(*sf, start, end)
        band = last < end  # versions the chunk's last query no longer sees
        key, cs, rs, first, last = (x[band] for x in (key, cs, rs, first, last))
        u = torch.arange(end)
        served_from = u
        for s in sf:  # the first query that sees the served version
            served_from = torch.where(s < end, torch.maximum(served_from, s), served_from)
        served_from = served_from.to(dev)
        picks = []
        for lo in range(start, end, query_block):
            hi = min(lo + query_block, end)
            sel = torch.nonzero(torch.clamp(first, min=lo) < torch.clamp(last, max=hi)).flatten()
            # Pad the block's keys to a multiple of KEY_ALIGN with keys it does not see (later served ones,
            # masked rows past its entries): aligned key counts and mask rows keep the attention kernels fast.
            served_hi = min(end, hi + (-(hi + len(sel))) % KEY_ALIGN)
            pad = (-(served_hi + len(sel))) % KEY_ALIGN if len(key) else 0
            picks.append((lo, hi, sel, served_hi, pad))
        gap = max(len(sel) + pad for *_, sel, _, pad in picks)
        blocks = []
        for lo, hi, sel, served_hi, pad in picks:
            f, e = first[sel], last[sel]
            f, e = torch.cat([f, f.new_full((pad,), NEVER)]).to(dev), torch.cat([e, e.new_zeros(pad)]).to(dev)
            t = torch.arange(lo, hi, device=dev)[:, None]
            seen = torch.cat([served_from[None, :served_hi] <= t, (f[None] <= t) & (t < e[None])], dim=1)
            mask = torch.zeros(seen.shape, dtype=dtype, device=dev).masked_fill_(~seen, float("-inf"))
            copies = [(served_hi + i, end + gap + v, m) for i, v, m in _runs(sel)]
            blocks.append(QueryBlock(slice(lo - start, hi - start), served_hi + len(sel) + pad, copies, mask))
        keys = [None, None]
        if gap:
            for i, (path, r, stored) in enumerate(zip(paths, rows, (cs, rs))):
                served = stored | (key >= r.q_end) | (path.fmt.kind == "bf16")
                entry = torch.where(served, key, end + key - r.band_start)  # its row in served ++ band
                keys[i] = torch.cat([u, u.new_zeros(gap), entry]).to(dev)  # gap rows: any (masked where read)
        return cls(rows, *keys, blocks)


@dataclass
class Prefill:
    """One chunk of one sequence, positions [start, start + n): its plans, built once per chunk and shared by
    every layer with the same layout (`plan_key`; a layer whose two formats are bf16 keeps no BF16 window)."""

    slot: int
    plans: dict[tuple, ChunkPlan]  # by plan_key

    @classmethod
    def plan(cls, caches: list[PagedMLACache], slot: int, block_table: torch.Tensor, start: int, n: int,
             dtype: torch.dtype) -> Prefill:
        plans: dict[tuple, ChunkPlan] = {}
        for cache in caches:
            if plan_key(cache) not in plans:
                plans[plan_key(cache)] = ChunkPlan.build(cache, block_table, start, n, dtype)
        return cls(slot, plans)


@dataclass
class Decode:
    block_tables: torch.Tensor  # [B, max_blocks] int32, covers the new token
    seq_lens: torch.Tensor  # [B] int32, tokens cached before this step
    slots: torch.Tensor  # [B] int32
    max_seq_len: int  # bound on seq_lens + 1 (sizes the kernel's split without a host sync)
    checked: bool = True  # False inside a CUDA graph: no host-side NaN checks in the writer


class StepContext:
    """What the current forward is; set by the model runner before it calls the model."""

    current: Prefill | Decode | None = None


@torch.no_grad()
def prefill_attention(attn: nn.Module, layer: MLALayer, cache: PagedMLACache, hidden: torch.Tensor,
                      position_embeddings, ctx: Prefill, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Write the chunk's (c, k_pe) into the pool and return the attention output [1, n, hidden]; positions
    [1, n]: the chunk's (`project_queries`).

    Keys come in two sets, each (position, version) at most once per query: the cache as served after the
    chunk (`write_chunk`'s view: quantized body, BF16 sink and ring rows), and the band entries: versions of
    positions a query of the chunk sees with fewer paths quantized than the served cache (`ChunkPlan`).
    Per block of queries (`ChunkPlan.blocks`), a mask picks for query t each key from the right set and one
    `scaled_dot_product_attention` over the keys the block can see does the rest (expanded K/V, as the
    model's own prefill).
    """
    c, k_pe = (x[0] for x in project_cache(attn, layer, hidden, position_embeddings))
    plan = ctx.plans[plan_key(cache)]
    view = cache.write_chunk(ctx.slot, plan.rows, c, k_pe, checked=False, view_dtype=hidden.dtype)
    # Keys in one buffer (`ChunkPlan.keys_c`), one gather from the view: served positions, a gap as long as the
    # longest block band, then the band entries. Blocks run last to first and each copies its entries (slices)
    # just past the served keys it reads (over served keys only later blocks read), so a block's keys are one
    # prefix of the buffer.
    all_c, all_r = view.c, view.k_pe
    if plan.keys_c is not None:
        all_c, all_r = view.content.index_select(0, plan.keys_c), view.rope.index_select(0, plan.keys_r)
    q_nope, q_pe = project_queries(attn, layer, hidden, position_embeddings, positions)
    q = torch.cat([q_nope, q_pe], dim=-1)
    kv = attn.kv_b_proj(all_c).view(-1, layer.num_heads, layer.nope_dim + layer.v_dim).transpose(0, 1)
    k_nope, v = kv.split([layer.nope_dim, layer.v_dim], dim=-1)
    k = torch.cat([k_nope, all_r[None].expand(layer.num_heads, -1, -1)], dim=-1)
    outs = []
    for blk in reversed(plan.blocks):
        for dst, src, m in blk.copies:
            k[:, dst : dst + m] = k[:, src : src + m]
            v[:, dst : dst + m] = v[:, src : src + m]
        outs.append(F.scaled_dot_product_attention(q[:, :, blk.queries], k[None, :, : blk.keys],
                                                   v[None, :, : blk.keys], attn_mask=blk.mask,
                                                   scale=layer.softmax_scale))  # fmt: skip
    out = outs[0] if len(outs) == 1 else torch.cat(outs[::-1], dim=2)
    return attn.o_proj(out.transpose(1, 2).flatten(2))


class PagedAttention(nn.Module):
    """Stands in for one MLA attention module of the model; returns (output, None) as the module does."""

    def __init__(self, attn: nn.Module, layer: MLALayer, cache: PagedMLACache, step: StepContext,
                 kernel: str = "auto"):
        super().__init__()
        self.attn, self.layer, self.cache, self.step, self.kernel = attn, layer, cache, step, kernel

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, position_ids=None, **_):
        ctx = self.step.current
        if isinstance(ctx, Prefill):
            return prefill_attention(self.attn, self.layer, self.cache, hidden_states, position_embeddings, ctx,
                                     position_ids), None
        if isinstance(ctx, Decode):
            out = decode_step(self.attn, self.layer, hidden_states, position_embeddings, self.cache,
                              ctx.block_tables, ctx.seq_lens, ctx.slots, max_seq_len=ctx.max_seq_len,
                              checked=ctx.checked, kernel=self.kernel)  # fmt: skip
            return out, None
        raise RuntimeError("PagedAttention called outside an engine step (no StepContext set)")
