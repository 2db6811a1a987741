"""The engine's attention: the model's own MLA module, wrapped so that it reads and writes the paged pool.

`PagedAttention` replaces each attention module of the model (module composition, the model's weights and
every other module stay its own). What it does depends on the step the runner announces in its
`StepContext`:
  - `Prefill` (`Prefill.plan(...)`, once per chunk): one chunk of one sequence, hidden [1, n, hidden] at
    positions [start, start + n): `prefill_attention`;
  - `Decode(block_tables, seq_lens, slots, max_seq_len, checked)`: one token per sequence, hidden [B, 1,
    hidden]: `quantmla.decode_step.decode_step` (the Triton kernel on CUDA, the torch oracle elsewhere).

Both see the cache exactly as it is served: a query at position t attends to BF16 keys at the sink
positions and at (t - recent, t], and to the quantized keys of [sink, t + 1 - recent). So a prompt gives the
same cache and the same logits whether it is prefilled at once, in chunks, or token by token, and a
sequence recomputed after a preemption continues exactly as it would have without it.
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


QUERY_BLOCK = 1024  # prefill queries attend in blocks of this many: each block reads only the keys it can see
KEY_ALIGN = 64  # keys per block are padded to a multiple of this (masked keys)


@dataclass
class QueryBlock:
    """Queries [queries) of a chunk and the keys they can see: served-cache positions [0, served) and band
    rows [band) (positions band_start + i); `mask` [len(queries), served + len(band)] additive (0 / -inf)."""

    queries: slice
    served: int
    band: slice
    mask: torch.Tensor


@dataclass
class ChunkPlan:
    """One chunk's pool rows and query blocks for the caches of one (sink, recent) window."""

    rows: tuple[ChunkRows, ChunkRows]  # where the chunk's tokens go (`PagedMLACache.chunk_rows`)
    blocks: list[QueryBlock]

    @classmethod
    def build(cls, cache: PagedMLACache, block_table: torch.Tensor, start: int, n: int, dtype: torch.dtype,
              query_block: int | None = None) -> ChunkPlan:
        """block_table [max_blocks] int32 covers start + n tokens; `cache` any layer's with this window.

        Query t sees served key u if u <= t and u is a sink or recent key of the served cache or one it sees
        quantized (u < t + 1 - recent); it sees band key u if t + 1 - recent <= u <= t. Blocking the queries
        keeps the keys of each block to those it can see: about half the causal square, and only ~block +
        recent band keys, instead of every query against the served cache and the whole band."""
        query_block = query_block or QUERY_BLOCK
        both = cache.chunk_rows(block_table, start, n)
        rows = both[0]  # channel formats (the runner refuses token-axis ones): one ChunkRows for both paths
        sink, recent, q_end, dev = cache.sink, cache.recent, rows.q_end, block_table.device
        blocks = []
        for lo in range(start, rows.end, query_block):
            hi = min(lo + query_block, rows.end)
            b_lo, b_hi = max(rows.band_start, lo + 1 - recent), min(q_end, hi)
            if b_hi <= b_lo:
                b_lo = b_hi = rows.band_start
            # Pad the block's keys to a multiple of KEY_ALIGN with keys it does not see (later served ones,
            # band ones out of reach): aligned key counts and mask rows keep the attention kernels fast.
            served_hi = min(rows.end, hi + (-(hi + b_hi - b_lo)) % KEY_ALIGN)
            need = (-(served_hi + b_hi - b_lo)) % KEY_ALIGN
            take = min(need, b_lo - rows.band_start)
            b_lo, need = b_lo - take, need - take
            b_hi += min(need, q_end - b_hi)
            t = torch.arange(lo, hi, device=dev)[:, None]
            u = torch.arange(served_hi, device=dev)[None]
            band = torch.arange(b_lo, b_hi, device=dev)[None]
            served = (u <= t) & ((u < sink) | (u < t + 1 - recent) | (u >= q_end) | (recent == 0))
            seen = torch.cat([served, (band <= t) & (band >= t + 1 - recent)], dim=1)
            mask = torch.zeros(seen.shape, dtype=dtype, device=dev).masked_fill_(~seen, float("-inf"))
            off = rows.band_start
            blocks.append(QueryBlock(slice(lo - start, hi - start), served_hi, slice(b_lo - off, b_hi - off), mask))
        return cls(both, blocks)


@dataclass
class Prefill:
    """One chunk of one sequence, positions [start, start + n): its plans, built once per chunk and shared by
    every layer with the same window (a layer whose two formats are bf16 keeps no BF16 window: (0, 0))."""

    slot: int
    plans: dict[tuple[int, int], ChunkPlan]  # by (sink, recent)

    @classmethod
    def plan(cls, caches: list[PagedMLACache], slot: int, block_table: torch.Tensor, start: int, n: int,
             dtype: torch.dtype) -> Prefill:
        plans: dict[tuple[int, int], ChunkPlan] = {}
        for cache in caches:
            if (cache.sink, cache.recent) not in plans:
                plans[cache.sink, cache.recent] = ChunkPlan.build(cache, block_table, start, n, dtype)
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
                      position_embeddings, ctx: Prefill) -> torch.Tensor:
    """Write the chunk's (c, k_pe) into the pool and return the attention output [1, n, hidden].

    Keys come in two sets, each position at most once per query: the cache as served after the chunk
    (`write_chunk`'s view: quantized body, BF16 sink and recent rows), and the band of positions that the
    served cache has quantized but a query of the chunk still sees in BF16 (those within `recent` of it).
    Per block of queries (`ChunkPlan.blocks`), a mask picks for query t each key from the right set and one
    `scaled_dot_product_attention` over the keys the block can see does the rest (expanded K/V, as the
    model's own prefill).
    """
    c, k_pe = (x[0] for x in project_cache(attn, layer, hidden, position_embeddings))
    plan = ctx.plans[cache.sink, cache.recent]
    view = cache.write_chunk(ctx.slot, plan.rows, c, k_pe, checked=False, view_dtype=hidden.dtype)
    served = view.c.shape[0]
    # Keys in one buffer: served positions, a gap as long as the longest block band, then the chunk's band.
    # Blocks run last to first and each copies its band just past the served keys it reads (over served
    # keys only later blocks read), so a block's keys are one prefix of the buffer: no per-block K/V copies.
    gap = max(blk.band.stop - blk.band.start for blk in plan.blocks)
    all_c, all_r = view.c, view.k_pe
    if gap:
        all_c = torch.cat([all_c, view.band_c.new_zeros(gap, all_c.shape[1]), view.band_c])
        all_r = torch.cat([all_r, view.band_r.new_zeros(gap, all_r.shape[1]), view.band_r])
    q_nope, q_pe = project_queries(attn, layer, hidden, position_embeddings)
    q = torch.cat([q_nope, q_pe], dim=-1)
    kv = attn.kv_b_proj(all_c).view(-1, layer.num_heads, layer.nope_dim + layer.v_dim).transpose(0, 1)
    k_nope, v = kv.split([layer.nope_dim, layer.v_dim], dim=-1)
    k = torch.cat([k_nope, all_r[None].expand(layer.num_heads, -1, -1)], dim=-1)
    outs = []
    for blk in reversed(plan.blocks):
        n_band = blk.band.stop - blk.band.start
        if n_band:
            src = slice(served + gap + blk.band.start, served + gap + blk.band.stop)
            k[:, blk.served : blk.served + n_band] = k[:, src]
            v[:, blk.served : blk.served + n_band] = v[:, src]
        keys = slice(0, blk.served + n_band)
        outs.append(F.scaled_dot_product_attention(q[:, :, blk.queries], k[None, :, keys], v[None, :, keys],
                                                   attn_mask=blk.mask, scale=layer.softmax_scale))
    out = outs[0] if len(outs) == 1 else torch.cat(outs[::-1], dim=2)
    return attn.o_proj(out.transpose(1, 2).flatten(2))


class PagedAttention(nn.Module):
    """Stands in for one MLA attention module of the model; returns (output, None) as the module does."""

    def __init__(self, attn: nn.Module, layer: MLALayer, cache: PagedMLACache, step: StepContext,
                 kernel: str = "auto"):
        super().__init__()
        self.attn, self.layer, self.cache, self.step, self.kernel = attn, layer, cache, step, kernel

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, **_):
        ctx = self.step.current
        if isinstance(ctx, Prefill):
            return prefill_attention(self.attn, self.layer, self.cache, hidden_states, position_embeddings, ctx), None
        if isinstance(ctx, Decode):
            out = decode_step(self.attn, self.layer, hidden_states, position_embeddings, self.cache,
                              ctx.block_tables, ctx.seq_lens, ctx.slots, max_seq_len=ctx.max_seq_len,
                              checked=ctx.checked, kernel=self.kernel)  # fmt: skip
            return out, None
        raise RuntimeError("PagedAttention called outside an engine step (no StepContext set)")
