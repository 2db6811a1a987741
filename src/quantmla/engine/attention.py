"""The engine's attention: the model's own MLA module, wrapped so that it reads and writes the paged pool.

`PagedAttention` replaces each attention module of the model (module composition, the model's weights and
every other module stay its own). What it does depends on the step the runner announces in its
`StepContext`:
  - `Prefill(slot, block_table, start)`: one chunk of one sequence, hidden [1, n, hidden] at positions
    [start, start + n): `prefill_attention`;
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

from quantmla.cache.paged import PagedMLACache
from quantmla.decode_step import decode_step
from quantmla.mla import project_cache, project_queries
from quantmla.models.adapters import MLALayer


@dataclass
class Prefill:
    slot: int
    block_table: torch.Tensor  # [max_blocks] int32, covers start + n tokens
    start: int  # tokens of this sequence already in the pool


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

    Keys come in two sets, each position at most once per query: the cache as it holds the first
    start + n positions (`gather`: quantized body, BF16 sink and recent rows), and BF16 copies of the
    positions some query of the chunk still sees unquantized ([max(sink, start + 1 - recent), start + n)).
    A mask picks, for query t, key u from the first set when u < sink or u < t + 1 - recent, else from the
    second; one `scaled_dot_product_attention` over both does the rest (expanded K/V, as the model's own
    prefill).
    """
    c, k_pe = (x[0] for x in project_cache(attn, layer, hidden, position_embeddings))
    n, start, dev, dtype = c.shape[0], ctx.start, c.device, hidden.dtype
    end = start + n
    sink, recent = cache.sink, cache.recent
    lo = max(sink, start + 1 - recent) if recent else end
    if lo < start:  # BF16 keys from before the chunk still sit in the recent ring
        rows = cache.protected_row(torch.arange(lo, start, device=dev))
        old_c, old_r = cache.protected_content[ctx.slot, rows], cache.protected_rope[ctx.slot, rows]
    else:
        old_c, old_r = cache.protected_content[ctx.slot, :0], cache.protected_rope[ctx.slot, :0]
    skip, held = max(lo - start, 0), cache.protected_content.dtype
    band_c = torch.cat([old_c, c[skip:].to(held)]).to(dtype)  # as the ring holds them (bf16 when serving)
    band_r = torch.cat([old_r, k_pe[skip:].to(held)]).to(dtype)
    cache.append(ctx.slot, ctx.block_table, start, c, k_pe, checked=False)
    hist_c, hist_r = cache.gather(ctx.slot, ctx.block_table, end, dtype)

    t = torch.arange(start, end, device=dev)[:, None]
    u_hist = torch.arange(end, device=dev)[None]
    u_band = torch.arange(end - band_c.shape[0], end, device=dev)[None]
    in_hist = (u_hist <= t) & ((u_hist < sink) | (u_hist < t + 1 - recent) | (recent == 0))
    in_band = (u_band <= t) & (u_band >= t + 1 - recent)
    mask = torch.cat([in_hist, in_band], dim=1)

    all_c, all_r = torch.cat([hist_c, band_c]), torch.cat([hist_r, band_r])
    q_nope, q_pe = project_queries(attn, layer, hidden, position_embeddings)
    kv = attn.kv_b_proj(all_c).view(-1, layer.num_heads, layer.nope_dim + layer.v_dim).transpose(0, 1)
    k_nope, v = kv.split([layer.nope_dim, layer.v_dim], dim=-1)
    k = torch.cat([k_nope, all_r[None].expand(layer.num_heads, -1, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    out = F.scaled_dot_product_attention(q, k[None], v[None], attn_mask=mask, scale=layer.softmax_scale)
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
