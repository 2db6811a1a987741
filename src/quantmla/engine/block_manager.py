"""The KV pool's bookkeeping: fixed pages of `block_size` tokens, reference counts, and protected-row slots.

Every layer has its own `PagedMLACache`, but they are laid out alike, so one block id and one slot address
a page and a sequence's BF16 rows in all layers at once. A sequence's block table covers positions
[0, len(seq)) (the rows of its protected sink/recent tokens included, so pages are the same for every format).
Block `num_blocks` and slot `max_num_seqs` exist in the pools but are never handed out: padded rows of a
CUDA-graph batch write there.

Sizing (`PoolLayout`): one page costs `page_bytes` (all layers: body bytes of `block_size` quantized tokens),
one slot `slot_bytes` (all layers: the sink + ring BF16 rows of content and RoPE; ring = recent, or recent +
block - 1 with a token-axis path, `PagedMLACache.window`). Both are the allocated tensors' exact bytes
(`PagedMLACache.page_bytes`: token-axis scales per block of a page included). From a byte budget:
num_blocks = (budget - (max_num_seqs + 1) * slot_bytes) // page_bytes - 1.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from quantmla.cache.paged import PagedMLACache
from quantmla.config import CacheConfig
from quantmla.engine.sequence import Sequence
from quantmla.models.adapters import MLALayer


@dataclass(frozen=True)
class PoolLayout:
    """Bytes of one page and of one sequence's protected rows, summed over layers, for chosen formats."""

    page_bytes: int
    slot_bytes: int
    block_size: int

    @classmethod
    def of(cls, config: CacheConfig, layers: list[MLALayer], block_size: int,
           dtype: torch.dtype = torch.bfloat16) -> PoolLayout:
        """dtype: of the unquantized rows (see `PagedMLACache.allocate`)."""
        page = slot = 0
        for layer in layers:
            cfg = config.at(layer.cache_idx).fit(layer.kv_lora_rank, layer.rope_dim)  # per-layer formats
            probe = PagedMLACache.allocate(cfg, layer.kv_lora_rank, layer.rope_dim, 1, 1, block_size, "meta",
                                           dtype=dtype)  # fmt: skip
            page += probe.page_bytes
            slot += probe.protected_content[0].nbytes + probe.protected_rope[0].nbytes
        return cls(page, slot, block_size)

    def num_blocks(self, budget_bytes: int, max_num_seqs: int) -> int:
        """Pages that fit in `budget_bytes` beside the protected rows of max_num_seqs (+1 scratch) slots and
        one scratch page. Raises if not even one page fits."""
        n = (budget_bytes - (max_num_seqs + 1) * self.slot_bytes) // self.page_bytes - 1
        if n < 1:
            need = (max_num_seqs + 1) * self.slot_bytes + 2 * self.page_bytes
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no page: with {max_num_seqs} sequences "
                             f"it needs at least {need} bytes (one page = {self.page_bytes} B, protected rows "
                             f"of one sequence = {self.slot_bytes} B)")
        return int(n)

    def bytes_for(self, num_blocks: int, max_num_seqs: int) -> int:
        """What the pools of `num_blocks` pages and `max_num_seqs` slots take (scratch page and slot included)."""
        return (num_blocks + 1) * self.page_bytes + (max_num_seqs + 1) * self.slot_bytes


class BlockManager:
    """Hands out pages (reference-counted; freed when the count drops to 0) and slots."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.free_slots: deque[int] = deque(range(max_num_seqs))

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def can_allocate(self, seq: Sequence) -> bool:
        """Pages for all of seq's tokens, and a slot."""
        return self.blocks_for(len(seq)) <= len(self.free_blocks) and bool(self.free_slots)

    def allocate(self, seq: Sequence) -> None:
        assert not seq.block_table and seq.slot < 0, "sequence already holds pages"
        seq.block_table = [self._take() for _ in range(self.blocks_for(len(seq)))]
        seq.slot = self.free_slots.popleft()

    def can_append(self, seq: Sequence) -> bool:
        """Room for seq's newest token (it may open a new page)."""
        return len(seq.block_table) >= self.blocks_for(len(seq)) or bool(self.free_blocks)

    def append(self, seq: Sequence) -> None:
        while len(seq.block_table) < self.blocks_for(len(seq)):
            seq.block_table.append(self._take())

    def free(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_blocks.append(b)
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
        seq.block_table, seq.slot = [], -1

    def _take(self) -> int:
        b = self.free_blocks.popleft()
        assert self.ref_counts[b] == 0
        self.ref_counts[b] = 1
        return b
