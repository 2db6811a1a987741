"""The paged, packed MLA cache of one layer: pools of fixed-size blocks plus BF16 protected tokens.

Layout (one layer; the engine keeps one `PagedMLACache` per layer and one block table per sequence,
shared by all layers). `P` = page size in tokens (`block_size`), `NB` = pool blocks, `dc` = kv_lora_rank,
`dr` = rope dims, `g` = a path's group size, `S` = max sequences (protected slots), `W` = sink + recent.

Body pools, one `PagedPath` per cache path (content: dim = dc, rope: dim = dr), byte layouts exactly those
of `quantmla.quant.formats` (the pool holds `quantize()`'s output, row for row):
  int8/int4/int2  codes uint8   [NB, P, dim*bits/8]   int4: channel 2i low nibble, 2i+1 high nibble of byte i;
                                                      int2: channel 4i+k in bits 2k..2k+1 of byte i
                  scale fp16    [NB, P, dim/g]        x ~= code * scale + zero (a clipping ratio,
                                                      QuantFormat.clip, changes only how scale/zero are chosen)
                  zero  fp16    [NB, P, dim/g]
  fp8             codes uint8   [NB, P, dim]          e4m3 bit patterns
                  scale fp32    [NB, P, dim/g]        x ~= e4m3(code) * scale  (g = 0: no scale, 1.0)
  bf16            codes bf16    [NB, P, dim]          the values themselves
Token at position p of a sequence lives in pool row `(block_table[p // P], p % P)`. Only positions that have
left the protected window are ever written there; the rows of protected positions stay unused (the first
block of a sequence therefore wastes `sink` rows, a few hundred bytes).

Protected tokens (BF16, never quantized): `protected_content` bf16 [S, W, dc] and `protected_rope`
bf16 [S, W, dr], indexed by the sequence's slot. Row p holds sink position p (p < sink); row
`sink + (p - sink) % recent` holds a recent position p >= sink (a ring). For a sequence of length L:
  - rows [0, min(L, W)) are valid (sink rows first, then the ring; attention does not care about order);
  - positions [sink, L - recent) are quantized (none while L <= W);
  - a token is quantized at the step its position drops out of the last `recent` positions.
When both paths are bf16 there is nothing to protect: W = 0 and every token goes straight to the pool.

Use: `cache = PagedMLACache.allocate(CacheConfig(...), dc, dr, num_blocks, max_seqs, block_size=64,
device=...)`; per sequence a block table int32 [max_blocks] (`make_block_tables` stands in for the engine's
block manager) and a slot; `cache.append(slot, table, seq_len, c, k_pe)` writes n new tokens (prefill),
`cache.append_decode(slots, tables, seq_lens, c, k_pe)` one token for each sequence of a batch;
`cache.gather(...)` is the dequantized view the reference attention uses; the decode kernel is
`quantmla.kernels.mla_decode(q_nope_absorbed, q_pe, cache, block_tables, seq_lens, slots, sm_scale)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantmla.config import CacheConfig, QuantFormat
from quantmla.quant.formats import Packed, dequantize, quantize

PAGED_KINDS = ("bf16", "fp8", "int8", "int4", "int2")  # what the pools and the decode kernel read


@dataclass
class PagedPath:
    """One cache path's pools (see the module docstring for shapes, dtypes and byte layouts).

    scale/zero are None where the format has none (bf16; zero also for fp8; scale for fp8 with group 0).
    """

    fmt: QuantFormat
    dim: int
    codes: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.zero) if t is not None]

    def write(self, rows: torch.Tensor, x: torch.Tensor, checked: bool = True) -> Packed:
        """Quantize x [n, dim] with `quantize()` and store it at flat pool rows [n] (block * P + offset);
        returns what was stored (in the pools' dtypes). checked=False: no value checks, so no host sync."""
        p = quantize(x, self.fmt, "cache", checked)
        stored = [val.to(pool.dtype) for pool, val in zip(self.tensors(), p.tensors())]
        for pool, val in zip(self.tensors(), stored):
            pool.view(-1, pool.shape[-1])[rows] = val
        return Packed(*stored)

    def read(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantize the tokens at flat pool rows [n] -> [n, dim] in `dtype` (via `dequantize()`)."""
        flat = [t.view(-1, t.shape[-1])[rows] for t in self.tensors()]
        if self.fmt.kind == "fp8" and self.fmt.group == 0:
            return dequantize(Packed(flat[0]), self.fmt, dtype)
        return dequantize(Packed(*flat), self.fmt, dtype)

    @property
    def bytes_per_token(self) -> int:
        return sum(t.shape[-1] * t.element_size() for t in self.tensors())


def _alloc_path(fmt: QuantFormat, dim: int, num_blocks: int, block_size: int, device, fill,
                dtype=torch.bfloat16) -> PagedPath:
    lead = (num_blocks, block_size)
    if fmt.kind == "bf16":
        return PagedPath(fmt, dim, torch.full((*lead, dim), fill, dtype=dtype, device=device))
    codes = torch.zeros((*lead, dim * fmt.bits // 8), dtype=torch.uint8, device=device)
    if fill != 0:
        codes.fill_(0xFF)  # 0xFF is NaN in e4m3 and the top code for integers
    if fmt.kind == "fp8":
        scale = torch.full((*lead, dim // fmt.group), fill, device=device) if fmt.group else None
        return PagedPath(fmt, dim, codes, scale)
    g = dim // fmt.group
    scale = torch.full((*lead, g), fill, dtype=torch.float16, device=device)
    zero = torch.full((*lead, g), fill, dtype=torch.float16, device=device)
    return PagedPath(fmt, dim, codes, scale, zero)


@dataclass(frozen=True)
class ChunkRows:
    """Where a chunk of new tokens at positions [start, end) of one sequence goes, and what attention reads.

    With S = sink and Q = max(S, end - recent), after the chunk positions [S, Q) are quantized and the rest
    protected. In position order (E = max(S, start - recent): the quantized region before the chunk ends):
      [0, min(S, end))   sink, BF16: protected rows [0, sink_old) (old), then rows new_sink = (lo, hi) taking
                         the chunk's first hi - lo tokens
      [S, E)             quantized before the chunk: pool rows `pool_old` [E - S] int64
      [E, Q)             quantized by this chunk: old tokens from ring rows `evict_ring`, then the chunk's tokens
                         evict_fresh = (lo, hi) (indices into the chunk); stored at pool rows `evict_dst`
      [Q, end)           recent, BF16: old tokens at ring rows `tail_old`, then the chunk's tokens from index
                         new_tail_src on, written to ring rows `new_tail`
    The band [band_start, Q): positions quantized in the served cache after the chunk that some query of the
    chunk still sees unquantized (within `recent` of it): band_start = max(S, start + 1 - recent), or Q when
    recent = 0 (then no query sees a BF16 copy of a quantized position). Index tensors are None where the part is empty; all live on the block table's device.
    They depend only on positions, the block table, page size, sink and recent, so an engine builds them
    once per chunk for all layers.
    """

    start: int
    end: int
    sink_old: int
    new_sink: tuple[int, int] | None
    pool_old: torch.Tensor | None
    evict_ring: torch.Tensor | None
    evict_fresh: tuple[int, int]
    evict_dst: torch.Tensor | None
    tail_old: torch.Tensor | None
    new_tail_src: int
    new_tail: torch.Tensor | None
    evict_start: int  # E
    q_end: int  # Q
    band_start: int

    @classmethod
    def build(cls, block_table: torch.Tensor, start: int, n: int, block_size: int, sink: int, recent: int
              ) -> ChunkRows:
        end, dev = start + n, block_table.device
        q_end = max(sink, end - recent)
        e = max(sink, start - recent)

        def positions(lo, hi):
            return torch.arange(lo, hi, device=dev) if hi > lo else None

        def pool(lo, hi):
            pos = positions(lo, hi)
            if pos is None:
                return None
            return block_table.long()[pos // block_size] * block_size + pos % block_size

        def ring(lo, hi):
            pos = positions(lo, hi)
            return None if pos is None else sink + (pos - sink) % max(recent, 1)

        tail_lo = max(q_end, start)
        return cls(
            start, end,
            sink_old=min(sink, start),
            new_sink=(start, min(sink, end)) if start < min(sink, end) else None,
            pool_old=pool(sink, e),
            evict_ring=ring(e, min(q_end, start)),
            evict_fresh=(max(e, start) - start, max(q_end, start) - start),
            evict_dst=pool(e, q_end),
            tail_old=ring(q_end, start),
            new_tail_src=tail_lo - start,
            new_tail=ring(tail_lo, end),
            evict_start=e,
            q_end=q_end,
            band_start=min(max(sink, start + 1 - recent), q_end) if recent else q_end,
        )  # fmt: skip


@dataclass
class ChunkView:
    """What a prefill chunk's attention reads, in `view_dtype`: the cache as served after the chunk, c [end,
    dc] and k_pe [end, dr] in position order (quantized positions dequantized), and `band_c` / `band_r`, the
    BF16 values of positions [start + 1 - recent, Q) clipped to >= sink: quantized in the served cache, but
    still unquantized for the chunk's queries within `recent` of them (as stored in the ring: rounded to the
    protected rows' dtype)."""

    c: torch.Tensor
    k_pe: torch.Tensor
    band_c: torch.Tensor
    band_r: torch.Tensor


@dataclass
class PagedMLACache:
    """One layer's paged cache: body pools for quantized tokens and BF16 rows for protected tokens."""

    config: CacheConfig
    kv_lora_rank: int
    rope_dim: int
    block_size: int
    content: PagedPath
    rope: PagedPath
    protected_content: torch.Tensor  # bf16 [max_seqs, W, dc]
    protected_rope: torch.Tensor  # bf16 [max_seqs, W, dr]
    sink: int  # effective: 0 when both paths are bf16
    recent: int

    @classmethod
    def allocate(
        cls,
        config: CacheConfig,
        kv_lora_rank: int,
        rope_dim: int,
        num_blocks: int,
        max_seqs: int,
        block_size: int = 64,
        device: torch.device | str = "cpu",
        fill: float = 0.0,
        dtype: torch.dtype = torch.bfloat16,
    ) -> PagedMLACache:
        """Allocate empty pools. `fill=float('nan')` poisons every slot, so tests catch reads of unused rows.
        `dtype`: of the protected rows and of bf16-format pools (the decode kernel reads bfloat16; an fp32 model
        on the CPU may keep fp32 there, so that an unquantized cache is exactly the model's own)."""
        if config.layers:
            raise ValueError("this cache config has per-layer formats; allocate each layer's cache with "
                             "config.at(layer)")
        config.check_dims(kv_lora_rank, rope_dim)
        for fmt in (config.content, config.rope):
            if fmt.kind not in PAGED_KINDS or getattr(fmt, "axis", "channel") != "channel":
                raise ValueError(f"the paged cache stores {', '.join(PAGED_KINDS)} grouped along channels, not {fmt} "
                                 "(token-axis formats need per-channel scales per page and BF16 staging; not built)")
        if getattr(config, "rope_rotation", ""):
            raise ValueError(f"the paged cache has no online rotation; {config.rope_rotation!r} would be ignored")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        all_bf16 = config.content.kind == "bf16" and config.rope.kind == "bf16"
        sink, recent = (0, 0) if all_bf16 else (config.sink, config.recent)
        w = sink + recent
        prot_c = torch.full((max_seqs, w, kv_lora_rank), fill, dtype=dtype, device=device)
        prot_r = torch.full((max_seqs, w, rope_dim), fill, dtype=dtype, device=device)
        return cls(
            config,
            kv_lora_rank,
            rope_dim,
            block_size,
            _alloc_path(config.content, kv_lora_rank, num_blocks, block_size, device, fill, dtype),
            _alloc_path(config.rope, rope_dim, num_blocks, block_size, device, fill, dtype),
            prot_c,
            prot_r,
            sink,
            recent,
        )

    @property
    def window(self) -> int:
        """Protected rows per sequence (sink + recent)."""
        return self.sink + self.recent

    @property
    def num_blocks(self) -> int:
        return self.content.codes.shape[0]

    @property
    def body_bytes_per_token(self) -> int:
        """Exact pool bytes of one quantized token (both paths, scales and zeros included)."""
        return self.content.bytes_per_token + self.rope.bytes_per_token

    def protected_row(self, pos: torch.Tensor) -> torch.Tensor:
        """Protected row of positions that are in the window (sink rows, then the recent ring)."""
        ring = self.sink + (pos - self.sink).remainder(max(self.recent, 1))
        return torch.where(pos < self.sink, pos, ring)

    def pool_rows(self, block_table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Flat pool rows (block * P + offset) of positions `pos` under `block_table` ([..., max_blocks])."""
        blocks = torch.gather(block_table.long(), -1, pos // self.block_size)
        return blocks * self.block_size + pos % self.block_size

    # --- writers -------------------------------------------------------------------------------------

    def chunk_rows(self, block_table: torch.Tensor, start: int, n: int) -> ChunkRows:
        """The rows a chunk of n new tokens at positions [start, start + n) writes and reads (`ChunkRows`).
        Depends only on positions, the block table, page size, sink and recent: an engine builds it once per
        chunk and hands it to every layer's cache."""
        return ChunkRows.build(block_table, start, n, self.block_size, self.sink, self.recent)

    def append(self, slot: int, block_table: torch.Tensor, seq_len: int, c: torch.Tensor, k_pe: torch.Tensor,
               checked: bool = True):
        """Append n tokens (c [n, dc], k_pe [n, dr], positions seq_len .. seq_len+n-1) to one sequence.

        Host-driven (prefill, tests). block_table [max_blocks] int32 must already cover the new length.
        Tokens that leave the recent window are quantized (from the ring or straight from the input),
        then the new tokens that stay protected are written to the sink rows or the ring. checked=False skips
        the NaN/range checks (each a host sync; the engine's prefill vouches for its activations).
        """
        if c.shape[0]:
            self.write_chunk(slot, self.chunk_rows(block_table, seq_len, c.shape[0]), c, k_pe, checked)

    def write_chunk(self, slot: int, rows: ChunkRows, c: torch.Tensor, k_pe: torch.Tensor, checked: bool = True,
                    view_dtype: torch.dtype | None = None) -> ChunkView | None:
        """`append` with precomputed rows; with `view_dtype`, also return what attention reads (`ChunkView`).

        The view is built from the values just written (quantized tokens dequantized from the very codes
        stored), so it equals `gather(slot, table, rows.end, view_dtype)` without reading new tokens back.
        Every range is a host integer in `rows`: nothing here reads device data unless checked.
        """
        r, held = rows, self.protected_content.dtype
        pc, pr = self.protected_content[slot], self.protected_rope[slot]
        # Old protected rows are read (copied: advanced indexing) before the chunk's new tokens overwrite the
        # ring; sink_old stays a view, as new sink tokens only go to rows [start, sink), past it.
        sink_old = (pc[: r.sink_old], pr[: r.sink_old]) if r.sink_old else None
        tail_old = (pc[r.tail_old], pr[r.tail_old]) if r.tail_old is not None else None
        evicted = packed = None
        if r.evict_dst is not None:
            fresh = slice(*r.evict_fresh)
            evicted = (c[fresh], k_pe[fresh])
            if r.evict_ring is not None:
                evicted = (torch.cat([pc[r.evict_ring].to(c.dtype), evicted[0]]),
                           torch.cat([pr[r.evict_ring].to(k_pe.dtype), evicted[1]]))
            packed = (self.content.write(r.evict_dst, evicted[0], checked),
                      self.rope.write(r.evict_dst, evicted[1], checked))
        new_sink = new_tail = None
        if r.new_sink is not None:
            lo, hi = r.new_sink
            new_sink = (c[: hi - lo].to(held), k_pe[: hi - lo].to(held))
            pc[lo:hi], pr[lo:hi] = new_sink
        if r.new_tail is not None:
            new_tail = (c[r.new_tail_src :].to(held), k_pe[r.new_tail_src :].to(held))
            pc[r.new_tail], pr[r.new_tail] = new_tail
        if view_dtype is None:
            return None
        dt = view_dtype
        parts = [sink_old, new_sink]
        if r.pool_old is not None:
            parts.append((self.content.read(r.pool_old, dt), self.rope.read(r.pool_old, dt)))
        if packed is not None:
            parts.append((dequantize(packed[0], self.content.fmt, dt), dequantize(packed[1], self.rope.fmt, dt)))
        parts += [tail_old, new_tail]
        parts = [p for p in parts if p is not None]
        skip = r.band_start - r.evict_start
        band = (evicted[0][skip:], evicted[1][skip:]) if evicted is not None else (c[:0], k_pe[:0])
        return ChunkView(torch.cat([p[0].to(dt) for p in parts]), torch.cat([p[1].to(dt) for p in parts]),
                         band[0].to(held).to(dt), band[1].to(held).to(dt))

    def append_decode(
        self,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        c: torch.Tensor,
        k_pe: torch.Tensor,
        checked: bool = True,
    ) -> None:
        """Append one token per sequence for a decode step, batched, with fixed shapes.

        slots [B] int, block_tables [B, max_blocks] int32, seq_lens [B] int (lengths *before* the token),
        c [B, dc], k_pe [B, dr]. The token leaving the window (position L - recent) shares its ring row with
        the new token, so it is read and quantized first. A sequence with nothing to evict quantizes its new
        token into the pool row of position max(L - recent, 0) instead: a row no reader looks at yet (a sink
        position's, or one rewritten with the real token when it leaves the window), which keeps every shape
        independent of the data. `quantize()` checks its input for NaN and range, which reads it on the host;
        checked=False skips that: no host sync, so the step can be captured in a CUDA graph (the caller
        vouches for finite inputs).
        """
        L, slots = seq_lens.long(), slots.long()
        if self.recent:
            ev = L - self.recent
            evict = (ev >= self.sink)[:, None]
            ring = self.protected_row(ev.clamp_min(self.sink))  # the new token's row too, when evicting
            src_c = torch.where(evict, self.protected_content[slots, ring].to(c.dtype), c)
            src_r = torch.where(evict, self.protected_rope[slots, ring].to(k_pe.dtype), k_pe)
            qpos = ev.clamp_min(0)
        else:  # no ring: the new token is quantized at once (into an unread row while it is a sink token)
            src_c, src_r, qpos = c, k_pe, L
        dst = self.pool_rows(block_tables, qpos[:, None])[:, 0]
        self.content.write(dst, src_c, checked)
        self.rope.write(dst, src_r, checked)
        if self.window:
            # The new token is protected unless recent == 0 and it is past the sink; then its row is
            # rewritten with what it holds.
            keep = ((L < self.sink) | (self.recent > 0))[:, None]
            row = self.protected_row(L).clamp_max(self.window - 1)
            pc, pr = self.protected_content, self.protected_rope
            pc[slots, row] = torch.where(keep, c.to(pc.dtype), pc[slots, row])
            pr[slots, row] = torch.where(keep, k_pe.to(pr.dtype), pr[slots, row])

    # --- readers (the oracle's view) -----------------------------------------------------------------

    def gather(
        self, slot: int, block_table: torch.Tensor, seq_len: int, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized cache of one sequence in position order: (c [L, dc], k_pe [L, dr]) in `dtype`.
        Positions [sink, L - recent) come from the pools, the others from the protected rows; the ranges are
        computed on the host from seq_len, so nothing reads device data (no syncs)."""
        dev = self.protected_content.device
        lo, hi = min(self.sink, seq_len), max(self.sink, seq_len - self.recent)
        parts_c, parts_r = [], []
        for a, b, pooled in ((0, lo, False), (self.sink, hi, True), (max(hi, lo), seq_len, False)):
            if b <= a:
                continue
            pos = torch.arange(a, b, device=dev)
            if pooled:
                rows = self.pool_rows(block_table, pos)
                parts_c.append(self.content.read(rows, dtype))
                parts_r.append(self.rope.read(rows, dtype))
            else:
                rows = self.protected_row(pos)
                parts_c.append(self.protected_content[slot, rows].to(dtype))
                parts_r.append(self.protected_rope[slot, rows].to(dtype))
        if not parts_c:
            return (torch.empty(0, self.kv_lora_rank, dtype=dtype, device=dev),
                    torch.empty(0, self.rope_dim, dtype=dtype, device=dev))
        return torch.cat(parts_c), torch.cat(parts_r)


def make_block_tables(
    seq_lens: list[int], block_size: int, num_blocks: int | None = None, shuffle: bool = True, generator=None
) -> tuple[torch.Tensor, int]:
    """Give each sequence the blocks it needs, disjoint, in shuffled pool order (a stand-in for the engine's
    block manager in tests and benchmarks). Returns (block_tables [B, max_blocks] int32, blocks used).
    Unused table entries are -1; readers never look at them."""
    need = [-(-max(n, 1) // block_size) for n in seq_lens]
    total = sum(need)
    num_blocks = total if num_blocks is None else num_blocks
    if total > num_blocks:
        raise ValueError(f"need {total} blocks, pool has {num_blocks}")
    order = torch.randperm(num_blocks, generator=generator) if shuffle else torch.arange(num_blocks)
    table = torch.full((len(seq_lens), max(need)), -1, dtype=torch.int32)
    start = 0
    for i, k in enumerate(need):
        table[i, :k] = order[start : start + k].to(torch.int32)
        start += k
    return table, total
