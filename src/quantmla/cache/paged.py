"""The paged, packed MLA cache of one layer: pools of fixed-size blocks plus BF16 protected tokens.

Layout (one layer; the engine keeps one `PagedMLACache` per layer and one block table per sequence,
shared by all layers). `P` = page size in tokens (`block_size`), `NB` = pool blocks, `dc` = kv_lora_rank,
`dr` = rope dims, `g` = a path's group size, `S` = max sequences (protected slots), `W` = sink + ring, per
path (ring = recent for channel formats, recent + g - 1 for token-axis ones; see below).

Body pools, one `PagedPath` per cache path (content: dim = dc, rope: dim = dr), byte layouts exactly those
of `quantmla.quant.formats` (the pool holds `quantize()`'s output, row for row):
  int8/int4/int2  codes uint8   [NB, P, dim*bits/8]   int4: channel 2i low nibble, 2i+1 high nibble of byte i;
                                                      int2: channel 4i+k in bits 2k..2k+1 of byte i
                  scale fp16    [NB, P, dim/g]        x ~= code * scale + zero (a clipping ratio,
                                                      QuantFormat.clip, changes only how scale/zero are chosen)
                  zero  fp16    [NB, P, dim/g]        ranked (`int8r128`): dim is the rank, the rest reads as 0
  token-axis      codes uint8   [NB, P, dim*bits/8]   as above, one row per token
  int8/int4/int2  scale fp16    [NB, P/g, dim]        one per channel and block of g tokens (KIVI-style;
  (`int4:t64`)    zero  fp16    [NB, P/g, dim]        g must divide P)
  fp8             codes uint8   [NB, P, dim]          e4m3 bit patterns
                  scale fp32    [NB, P, dim/g]        x ~= e4m3(code) * scale  (g = 0: no scale, 1.0)
  bf16            codes bf16    [NB, P, dim]          the values themselves
Token at position p of a sequence lives in pool row `(block_table[p // P], p % P)`. Only positions that have
been quantized are ever written there; the rows of protected positions stay unused (the first block of a
sequence therefore wastes `sink` rows, a few hundred bytes). A token-axis path quantizes blocks of g tokens
counted from sink (`quantmla.policy`): block [s, s + g) keeps its scale and zero in the page where it
starts, at scale row ((s % P) // g) of block_table[s // P], i.e. at flat scale row pool_row(s) // g
(`scale_rows`); exactly P/g blocks start in each page, and a block may end in the next page.

Protected tokens (BF16, never quantized): `protected_content` bf16 [S, W_content, dc] and `protected_rope`
bf16 [S, W_rope, dr], indexed by the sequence's slot. What a path holds quantized follows
`quantmla.policy`: for a sequence of length L, positions [sink, Q) are quantized with
Q = quantized_end(L, sink, recent, block), block = g for a token-axis path and 1 otherwise: a channel path
quantizes a token at the step it drops out of the last `recent` positions, a token-axis path a whole block
at the step its last token does (until then its tokens wait in the ring: staged). So at most
ring = recent + block - 1 positions past the sink are unquantized (`rings`, per path), and a path's protected
rows hold its positions [0, min(L, sink)) and [Q, L): row p for sink position p (p < sink), row
sink + (p - sink) % ring for p >= sink (a ring); the ring's other rows are stale. Content and rope decide
separately: with different blocks their Q differ.
When both paths are bf16 there is nothing to protect: W = 0 and every token goes straight to the pool.

Use: `cache = PagedMLACache.allocate(CacheConfig(...), dc, dr, num_blocks, max_seqs, block_size=64,
device=...)`; per sequence a block table int32 [max_blocks] (`make_block_tables` stands in for the engine's
block manager) and a slot; `cache.append(slot, table, seq_len, c, k_pe)` writes n new tokens (prefill),
`cache.append_decode(slots, tables, seq_lens, c, k_pe)` one token for each sequence of a batch;
`cache.gather(...)` is the dequantized view the reference attention uses; the decode kernel is
`quantmla.kernels.mla_decode(q_nope_absorbed, q_pe, cache, block_tables, seq_lens, slots, sm_scale)`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from quantmla.config import CacheConfig, QuantFormat
from quantmla.policy import block_of, block_start, quantized_end, ring_size
from quantmla.quant.formats import Packed, dequantize, fields, quantize

PAGED_KINDS = ("bf16", "fp8", "int8", "int4", "int2")  # what the pools and the decode kernel read


@dataclass
class PagedPath:
    """One cache path's pools (see the module docstring for shapes, dtypes and byte layouts).

    scale/zero are None where the format has none (bf16; zero also for fp8; scale for fp8 with group 0).
    Rows are flat: pool row = block * P + offset; scale rows likewise, of the scale/zero pools (for channel
    formats the token's own row; for token-axis ones `PagedMLACache.scale_rows`).
    """

    fmt: QuantFormat
    dim: int
    codes: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None

    @property
    def block(self) -> int:
        return block_of(self.fmt)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.zero) if t is not None]

    def row_layout_problem(self, row_align: int = 1, base_align: int = 1) -> str | None:
        """Why a kernel that addresses the pools as whole rows cannot read them, or None: every pool [NB, P, w]
        must have contiguous rows and whole blocks of rows (stride(0) = P * stride(1); rows may lie further
        apart than their width, as in vLLM's packed rows), code rows `row_align` bytes apart (a multiple) from
        a `base_align`-byte aligned start, and the scale and zero pools one row stride."""
        for t in self.tensors():
            if t.stride(-1) != 1 or t.stride(0) != t.shape[1] * t.stride(1):
                return f"needs pools of whole contiguous rows, got strides {t.stride()}"
        if (self.codes.stride(1) * self.codes.element_size()) % row_align or self.codes.data_ptr() % base_align:
            return f"needs {row_align}-byte aligned code rows"
        if self.scale is not None and self.zero is not None and self.scale.stride(1) != self.zero.stride(1):
            return "needs the scale and zero pools to share a row stride"
        return None

    def write(self, rows: torch.Tensor, x: torch.Tensor, checked: bool = True, scale_rows: torch.Tensor | None = None,
              keep: torch.Tensor | None = None) -> Packed:
        """Quantize x [n, dim] with `quantize()` and store it: codes at flat pool rows [n], scale/zero at
        `scale_rows` ([n / block]: token-axis, x is whole blocks in order; default `rows`). keep [n] bool:
        where False the pools keep what they hold (constant within a block). Returns what was quantized
        (in the pools' dtypes). checked=False: no value checks, so no host sync."""
        p = quantize(x, self.fmt, "cache", checked)
        stored = [val.to(pool.dtype) for pool, val in zip(self.tensors(), p.tensors())]
        for i, (pool, val) in enumerate(zip(self.tensors(), stored)):
            at = rows if i == 0 or scale_rows is None else scale_rows
            flat = pool.view(-1, pool.shape[-1])
            if keep is not None:
                val = torch.where(keep[:: x.shape[0] // max(val.shape[0], 1), None], val, flat[at])
            flat[at] = val
        return Packed(*stored)

    def read(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32, scale_rows: torch.Tensor | None = None
             ) -> torch.Tensor:
        """Dequantize the tokens at flat pool rows [n] (scales at `scale_rows` [n], default `rows`) -> [n, dim]
        in `dtype`, via `dequantize()` (a token-axis path reads one scale row per token: the same arithmetic)."""
        flat = [t.view(-1, t.shape[-1]) for t in self.tensors()]
        at = rows if scale_rows is None else scale_rows
        fmt = replace(self.fmt, group=1) if self.block > 1 else self.fmt
        return dequantize(Packed(flat[0][rows], *(t[at] for t in flat[1:])), fmt, dtype, self.dim)

    @property
    def page_bytes(self) -> int:
        """Bytes of one pool block (P tokens), scales and zeros included."""
        return sum(t[0].numel() * t.element_size() for t in self.tensors())


def _alloc_path(fmt: QuantFormat, dim: int, num_blocks: int, block_size: int, device, fill,
                dtype=torch.bfloat16) -> PagedPath:
    pools = []
    for f in fields(fmt, dim):  # a ranked format's pools hold its first `rank` channels only
        shape = (num_blocks, block_size // f.tokens, f.width)
        if f.name == "codes" and f.dtype == torch.uint8:  # 0xFF is NaN in e4m3 and the top code for integers
            pools.append(torch.full(shape, 0 if fill == 0 else 0xFF, dtype=torch.uint8, device=device))
        else:
            pools.append(torch.full(shape, fill, dtype=dtype if fmt.kind == "bf16" else f.dtype, device=device))
    return PagedPath(fmt, dim, *pools)


@dataclass(frozen=True)
class ChunkRows:
    """Where a chunk of new tokens at positions [start, end) of one sequence goes in one path (of `block`
    tokens per quantized block), and what attention reads.

    With S = sink and Q = quantized_end(end), after the chunk the path holds positions [S, Q) quantized and
    the rest protected. In position order (E = quantized_end(start): the quantized region before the chunk):
      [0, min(S, end))   sink, BF16: protected rows [0, sink_old) (old), then rows new_sink = (lo, hi) taking
                         the chunk's first hi - lo tokens
      [S, E)             quantized before the chunk: pool rows `pool_old` [E - S] int64 (scales at
                         `pool_old_scale`)
      [E, Q)             quantized by this chunk (whole blocks): old tokens from ring rows `evict_ring`, then
                         the chunk's tokens evict_fresh = (lo, hi) (indices into the chunk); stored at pool rows
                         `evict_dst`, their scales at `evict_scale` (one per block; token-axis only)
      [Q, end)           BF16: old tokens at ring rows `tail_old`, then the chunk's tokens from index
                         new_tail_src on, written to ring rows `new_tail`
    The band [band_start, Q), band_start = quantized_end(start + 1): positions quantized in the served cache
    after the chunk but not in the cache its first query sees, so every unquantized copy a query of the chunk
    may still see of a position the served cache has quantized. Index tensors are None where the part is
    empty; all live on the block table's device. They depend only on positions, the block table, page size,
    sink, recent, block and ring, so an engine builds them once per chunk for all layers alike.
    """

    start: int
    end: int
    sink_old: int
    new_sink: tuple[int, int] | None
    pool_old: torch.Tensor | None
    pool_old_scale: torch.Tensor | None
    evict_ring: torch.Tensor | None
    evict_fresh: tuple[int, int]
    evict_dst: torch.Tensor | None
    evict_scale: torch.Tensor | None
    tail_old: torch.Tensor | None
    new_tail_src: int
    new_tail: torch.Tensor | None
    evict_start: int  # E
    q_end: int  # Q
    band_start: int

    @classmethod
    def build(cls, block_table: torch.Tensor, start: int, n: int, block_size: int, sink: int, recent: int,
              block: int = 1, ring: int | None = None) -> ChunkRows:
        end, dev = start + n, block_table.device
        ring = recent if ring is None else ring
        q_end, e = quantized_end(end, sink, recent, block), quantized_end(start, sink, recent, block)

        def positions(lo, hi, step=1):
            return torch.arange(lo, hi, step, device=dev) if hi > lo else None

        def pool(pos):
            return None if pos is None else block_table.long()[pos // block_size] * block_size + pos % block_size

        def scale(pos):  # see PagedMLACache.scale_rows
            return None if pos is None or block == 1 else pool(block_start(pos, sink, block)) // block

        def ring_rows(lo, hi):
            pos = positions(lo, hi)
            return None if pos is None else sink + (pos - sink) % max(ring, 1)

        tail_lo = max(q_end, start)
        return cls(
            start, end,
            sink_old=min(sink, start),
            new_sink=(start, min(sink, end)) if start < min(sink, end) else None,
            pool_old=pool(positions(sink, e)),
            pool_old_scale=scale(positions(sink, e)),
            evict_ring=ring_rows(e, min(q_end, start)),
            evict_fresh=(max(e, start) - start, max(q_end, start) - start),
            evict_dst=pool(positions(e, q_end)),
            evict_scale=scale(positions(e, q_end, block)),
            tail_old=ring_rows(q_end, start),
            new_tail_src=tail_lo - start,
            new_tail=ring_rows(tail_lo, end),
            evict_start=e,
            q_end=q_end,
            band_start=quantized_end(start + 1, sink, recent, block),
        )  # fmt: skip


@dataclass
class ChunkView:
    """What a prefill chunk's attention reads, in `view_dtype`, one tensor per path: `content` [end + band,
    dc] and `rope` [end + band, dr] hold the cache as served after the chunk in position order (quantized
    positions dequantized), then that path's band [band_start, Q) (`ChunkRows`, that path's) in BF16:
    quantized in the served cache, but maybe still unquantized for some of the chunk's queries (as stored in
    the ring: rounded to the protected rows' dtype). One tensor, so that one gather reads both."""

    content: torch.Tensor
    rope: torch.Tensor
    end: int

    @property
    def c(self) -> torch.Tensor:
        return self.content[: self.end]

    @property
    def k_pe(self) -> torch.Tensor:
        return self.rope[: self.end]

    @property
    def band_c(self) -> torch.Tensor:
        return self.content[self.end :]

    @property
    def band_r(self) -> torch.Tensor:
        return self.rope[self.end :]


@dataclass
class PagedMLACache:
    """One layer's paged cache: body pools for quantized tokens and BF16 rows for protected tokens."""

    config: CacheConfig
    kv_lora_rank: int
    rope_dim: int
    block_size: int
    content: PagedPath
    rope: PagedPath
    protected_content: torch.Tensor  # bf16 [max_seqs, sink + rings[0], dc]
    protected_rope: torch.Tensor  # bf16 [max_seqs, sink + rings[1], dr]
    sink: int  # effective: 0 when both paths are bf16
    recent: int
    rings: tuple[int, int]  # ring rows of content and rope: recent + block - 1 (0 when both paths are bf16)

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
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        for fmt in (config.content, config.rope):
            if fmt.kind not in PAGED_KINDS:
                raise ValueError(f"the paged cache stores {', '.join(PAGED_KINDS)}, not {fmt}")
            if fmt.axis == "token" and fmt.group < 2:  # block 1 would read as a channel format everywhere
                raise ValueError(f"the paged cache needs a token-axis block of at least 2 tokens, got {fmt} (one "
                                 f"scale and zero per value); use a channel format such as {fmt.kind}")
            if fmt.axis == "token" and block_size % fmt.group:
                raise ValueError(f"the paged cache keeps a token-axis format's scales per page: {fmt}'s block of "
                                 f"{fmt.group} tokens must divide the page size {block_size}")
        if getattr(config, "rope_rotation", ""):
            raise ValueError(f"the paged cache has no online rotation; {config.rope_rotation!r} would be ignored")
        all_bf16 = config.content.kind == "bf16" and config.rope.kind == "bf16"
        sink, recent = (0, 0) if all_bf16 else (config.sink, config.recent)
        rings = (0, 0) if all_bf16 else tuple(ring_size(recent, block_of(f)) for f in (config.content, config.rope))
        prot_c = torch.full((max_seqs, sink + rings[0], kv_lora_rank), fill, dtype=dtype, device=device)
        prot_r = torch.full((max_seqs, sink + rings[1], rope_dim), fill, dtype=dtype, device=device)
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
            rings,
        )

    @property
    def window(self) -> int:
        """Protected rows per sequence of the path with the longer ring (sink + ring; channel formats: sink
        + recent for both)."""
        return self.sink + max(self.rings)

    @property
    def num_blocks(self) -> int:
        return self.content.codes.shape[0]

    @property
    def page_bytes(self) -> int:
        """Exact pool bytes of one page (both paths, scales and zeros included)."""
        return self.content.page_bytes + self.rope.page_bytes

    @property
    def body_bytes_per_token(self) -> int | float:
        """Pool bytes per quantized token, page_bytes / P (a float where that is not whole)."""
        per = self.page_bytes / self.block_size
        return int(per) if per.is_integer() else per

    def memory_bytes(self) -> int:
        """Bytes of every pool and protected tensor."""
        tensors = [*self.content.tensors(), *self.rope.tensors(), self.protected_content, self.protected_rope]
        return sum(t.numel() * t.element_size() for t in tensors)

    def paths(self):
        """(path, protected rows, ring) of content and rope, in that order."""
        return ((self.content, self.protected_content, self.rings[0]), (self.rope, self.protected_rope, self.rings[1]))

    def quantized_end(self, path: PagedPath, length):
        """Positions [sink, Q) of `path` are in the pool once `length` (int or tensor) tokens are cached."""
        return quantized_end(length, self.sink, self.recent, path.block)

    def protected_row(self, pos: torch.Tensor, ring: int) -> torch.Tensor:
        """Protected row of positions that are in a path's window (sink rows, then its ring of `ring` rows)."""
        return torch.where(pos < self.sink, pos, self.sink + (pos - self.sink).remainder(max(ring, 1)))

    def pool_rows(self, block_table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Flat pool rows (block * P + offset) of positions `pos` under `block_table` ([..., max_blocks])."""
        blocks = torch.gather(block_table.long(), -1, pos // self.block_size)
        return blocks * self.block_size + pos % self.block_size

    def scale_rows(self, path: PagedPath, block_table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Flat rows of `path`'s scale/zero pools for positions `pos` (>= sink): a channel format's scales sit
        in the token's own row; a token-axis block's in the page where the block starts, at row
        pool_row(block start) // block."""
        if path.block == 1:
            return self.pool_rows(block_table, pos)
        return self.pool_rows(block_table, block_start(pos, self.sink, path.block)) // path.block

    # --- writers -------------------------------------------------------------------------------------

    def chunk_rows(self, block_table: torch.Tensor, start: int, n: int) -> tuple[ChunkRows, ChunkRows]:
        """The rows a chunk of n new tokens at positions [start, start + n) writes and reads (`ChunkRows`),
        one per path (content, rope; the same object when their blocks agree). Depends only on positions,
        the block table, page size, the window and the blocks: an engine builds it once per chunk and hands it
        to every layer's cache laid out alike."""
        build = {k: ChunkRows.build(block_table, start, n, self.block_size, self.sink, self.recent, *k)
                 for k in dict.fromkeys((p.block, ring) for p, _, ring in self.paths())}
        return tuple(build[p.block, ring] for p, _, ring in self.paths())

    def append(self, slot: int, block_table: torch.Tensor, seq_len: int, c: torch.Tensor, k_pe: torch.Tensor,
               checked: bool = True):
        """Append n tokens (c [n, dc], k_pe [n, dr], positions seq_len .. seq_len+n-1) to one sequence.

        Host-driven (prefill, tests). block_table [max_blocks] int32 must already cover the new length.
        What the chunk completes is quantized (old tokens from the ring, new ones straight from the input),
        then the new tokens that stay protected are written to the sink rows or the ring. checked=False skips
        the NaN/range checks (each a host sync; the engine's prefill vouches for its activations).
        """
        if c.shape[0]:
            self.write_chunk(slot, self.chunk_rows(block_table, seq_len, c.shape[0]), c, k_pe, checked)

    def write_chunk(self, slot: int, rows: tuple[ChunkRows, ChunkRows], c: torch.Tensor, k_pe: torch.Tensor,
                    checked: bool = True, view_dtype: torch.dtype | None = None) -> ChunkView | None:
        """`append` with precomputed rows (`chunk_rows`); with `view_dtype`, also return what attention reads
        (`ChunkView`).

        The view is built from the values just written (quantized tokens dequantized from the very codes
        stored), so it equals `gather(slot, table, end, view_dtype)` without reading new tokens back.
        Every range is a host integer in `rows`: nothing here reads device data unless checked.
        """
        views = [self._write_path(path, prot[slot], r, x, checked, view_dtype)
                 for (path, prot, _), r, x in zip(self.paths(), rows, (c, k_pe))]
        if view_dtype is None:
            return None
        return ChunkView(*views, rows[0].end)

    def _write_path(self, path: PagedPath, prot: torch.Tensor, r: ChunkRows, x: torch.Tensor, checked: bool,
                    dt: torch.dtype | None):
        """One path of `write_chunk`: prot [W, dim] its protected rows of the slot, x [n, dim] the chunk.
        Returns served [end, dim] ++ band in dt (`ChunkView`), or None without dt."""
        held = prot.dtype
        # Old protected rows are read (copied: advanced indexing) before the chunk's new tokens overwrite the
        # ring; sink_old stays a view, as new sink tokens only go to rows [start, sink), past it.
        sink_old = prot[: r.sink_old] if r.sink_old else None
        tail_old = prot[r.tail_old] if r.tail_old is not None else None
        evicted = packed = None
        if r.evict_dst is not None:
            evicted = x[slice(*r.evict_fresh)]
            if r.evict_ring is not None:
                evicted = torch.cat([prot[r.evict_ring].to(x.dtype), evicted])
            packed = path.write(r.evict_dst, evicted, checked, r.evict_scale)
        new_sink = new_tail = None
        if r.new_sink is not None:
            lo, hi = r.new_sink
            new_sink = x[: hi - lo].to(held)
            prot[lo:hi] = new_sink
        if r.new_tail is not None:
            new_tail = x[r.new_tail_src :].to(held)
            prot[r.new_tail] = new_tail
        if dt is None:
            return None
        parts = [sink_old, new_sink]
        if r.pool_old is not None:
            parts.append(path.read(r.pool_old, dt, r.pool_old_scale))
        if packed is not None:
            parts.append(dequantize(packed, path.fmt, dt, path.dim))
        band = evicted[r.band_start - r.evict_start :] if evicted is not None else x[:0]
        parts += [tail_old, new_tail, band.to(held)]
        return torch.cat([p.to(dt) for p in parts if p is not None])

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
        c [B, dc], k_pe [B, dr]. Per path, what the step completes is quantized first, then the new token goes
        to its protected row (a sink row, or its ring row: the row of what may have just been quantized).
        Channel path: the token leaving the window (position L - recent) shares its ring row with the new token
        when ring = recent, so it is read and quantized first. A sequence with nothing to evict quantizes its
        new token into the pool row of position max(L - recent, 0) instead: a row no reader looks at yet (a
        sink position's, or one rewritten with the real token when it leaves the window), which keeps every
        shape independent of the data. Token-axis path (block g): a sequence whose step completes the block
        [Q - g, Q) (Q = quantized_end(L + 1)) quantizes it from the ring (with recent = 0 the new token is its
        last); every sequence computes a block, and the others write back what their pool rows hold.
        `quantize()` checks its input for NaN and range, which reads it on the host; checked=False skips that:
        no host sync, so the step can be captured in a CUDA graph (the caller vouches for finite inputs).
        """
        L, slots = seq_lens.long(), slots.long()
        for (path, prot, ring), x in zip(self.paths(), (c, k_pe)):
            if path.block > 1:
                self._decode_block(path, prot, ring, slots, block_tables, L, x, checked)
            elif self.recent:
                ev = L - self.recent
                evict = (ev >= self.sink)[:, None]
                row = self.protected_row(ev.clamp_min(self.sink), ring)  # the new token's row too, when evicting
                src = torch.where(evict, prot[slots, row].to(x.dtype), x)
                path.write(self.pool_rows(block_tables, ev.clamp_min(0)[:, None])[:, 0], src, checked)
            else:  # no ring: the new token is quantized at once (into an unread row while it is a sink token)
                path.write(self.pool_rows(block_tables, L[:, None])[:, 0], x, checked)
            if prot.shape[1]:
                # The new token is protected unless there is no ring and it is past the sink; then its row is
                # rewritten with what it holds.
                keep = ((L < self.sink) | (ring > 0))[:, None]
                row = self.protected_row(L, ring).clamp_max(prot.shape[1] - 1)
                prot[slots, row] = torch.where(keep, x.to(prot.dtype), prot[slots, row])

    def _decode_block(self, path, prot, ring, slots, block_tables, L, x, checked):
        """append_decode's quantization for a token-axis path (block g > 1), fixed shapes."""
        g = path.block
        q = self.quantized_end(path, L + 1)
        done = q > self.quantized_end(path, L)  # [B]: the step completes block [q - g, q)
        pos = (q - g)[:, None] + torch.arange(g, device=L.device)  # [B, g]
        pos = torch.minimum(pos.clamp_min(0), L[:, None])  # in the table; only read where done
        held = prot[slots[:, None], self.protected_row(pos, ring)].to(x.dtype)
        src = torch.where((pos == L[:, None])[..., None], x[:, None], held)  # recent = 0: the new token
        src = torch.where(done[:, None, None], src, 0)  # no NaN checks on rows it does not store
        path.write(self.pool_rows(block_tables, pos).flatten(), src.flatten(0, 1), checked,
                   self.scale_rows(path, block_tables, pos[:, :1].clamp_min(self.sink))[:, 0],
                   keep=done[:, None].expand(-1, g).flatten())

    # --- readers (the oracle's view) -----------------------------------------------------------------

    def gather(
        self, slot: int, block_table: torch.Tensor, seq_len: int, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized cache of one sequence in position order: (c [L, dc], k_pe [L, dr]) in `dtype`.
        Per path, positions [sink, quantized_end(L)) come from the pools, the others from the protected rows;
        the ranges are computed on the host from seq_len, so nothing reads device data (no syncs)."""
        dev = self.protected_content.device
        out = []
        for path, prot, ring in self.paths():
            lo, hi = min(self.sink, seq_len), self.quantized_end(path, seq_len)
            parts = []
            for a, b, pooled in ((0, lo, False), (self.sink, hi, True), (max(hi, lo), seq_len, False)):
                if b <= a:
                    continue
                pos = torch.arange(a, b, device=dev)
                if pooled:
                    rows, srows = self.pool_rows(block_table, pos), self.scale_rows(path, block_table, pos)
                    parts.append(path.read(rows, dtype, srows))
                else:
                    parts.append(prot[slot, self.protected_row(pos, ring)].to(dtype))
            out.append(torch.cat(parts) if parts else torch.empty(0, path.dim, dtype=dtype, device=dev))
        return out[0], out[1]


def make_block_tables(
    seq_lens: list[int], block_size: int, num_blocks: int | None = None, generator=None
) -> tuple[torch.Tensor, int]:
    """Give each sequence the blocks it needs, disjoint, in shuffled pool order (a stand-in for the engine's
    block manager in tests and benchmarks). Returns (block_tables [B, max_blocks] int32, blocks used).
    Unused table entries are -1; readers never look at them."""
    need = [-(-max(n, 1) // block_size) for n in seq_lens]
    total = sum(need)
    num_blocks = total if num_blocks is None else num_blocks
    if total > num_blocks:
        raise ValueError(f"need {total} blocks, pool has {num_blocks}")
    order = torch.randperm(num_blocks, generator=generator)
    table = torch.full((len(seq_lens), max(need)), -1, dtype=torch.int32)
    start = 0
    for i, k in enumerate(need):
        table[i, :k] = order[start : start + k].to(torch.int32)
        start += k
    return table, total
