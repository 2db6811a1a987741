"""quantmla's paged cache inside vLLM's KV cache tensor: one packed row per token.

vLLM gives each MLA layer one tensor [num_blocks, block_size, C] and owns the block tables. quantmla keeps
vLLM's blocks as they are: the token at flat slot `block * block_size + offset` (vLLM's slot_mapping) owns
row `slot` of the tensor, so anything vLLM does to a block (allocate, zero, free) touches only that block's
tokens. A row packs the token's quantized body, the byte layouts of `quantmla.quant.formats` (and so of
`quantmla.cache.paged`), fields ordered by element size so every field stays aligned:

    [4-byte fields (fp8 scales)] [2-byte fields (fp16 scales, zeros; bf16 codes)] [1-byte codes] [pad]

e.g. INT4/INT4 with groups of 64 on the default model (kv_lora_rank 512, rope 64):
    content scale fp16 [8] | content zero fp16 [8] | rope scale fp16 [1] | rope zero fp16 [1] |
    content codes uint8 [256] | rope codes uint8 [32]                        = 324 bytes (BF16: 1152)
The row length is rounded up to a multiple of 4 bytes. With per-layer formats (a calibrated checkpoint's
`layers`) each layer packs its own fields in the same order, and every row is as long as the widest layer's
(vLLM gives all layers one row size); a narrower layer leaves the rest of its row unused. Each field is a
strided view of the tensor ([num_blocks, block_size, width], row stride = the row length), handed to
`PagedMLACache` as its pools, so the cache's own writers and readers (`append`, `append_decode`, `gather`)
run unchanged on vLLM's memory.

The BF16 sink + recent tokens are not in vLLM's tensor (a row has no room for them): they live in the
cache's `protected_content` / `protected_rope` rows [max_seqs, sink + recent, dim], indexed by the slot
`slots.SlotTable` gives each running request.
"""

from __future__ import annotations

import torch

from quantmla.cache.paged import PagedMLACache, PagedPath
from quantmla.config import CacheConfig, QuantFormat
from quantmla.quant.formats import fields

_ALIGN = 4


def _fields(fmt: QuantFormat, dim: int) -> list[tuple[str, torch.dtype, int]]:
    """(name, dtype, elements per token) of one path's pool tensors, in `PagedPath` order."""
    if fmt.axis == "token":
        raise ValueError(f"quantmla's vLLM backend stores one packed row per token; the token-axis format {fmt} "
                         "keeps its scales per block of tokens (served by `quantmla serve` only; for vLLM "
                         "calibrate without `--token-axis`)")
    return [(f.name, f.dtype, f.width) for f in fields(fmt, dim)]


def _plan(cfg: CacheConfig, kv_lora_rank: int, rope_dim: int):
    """[(path, name, dtype, width, byte offset in the row)], row bytes."""
    fields = [(p, *f) for p, (fmt, dim) in (("content", (cfg.content, kv_lora_rank)), ("rope", (cfg.rope, rope_dim)))
              for f in _fields(fmt, dim)]
    fields.sort(key=lambda f: -f[2].itemsize)  # stable: content before rope within a size
    plan, offset = [], 0
    for path, name, dtype, width in fields:
        plan.append((path, name, dtype, width, offset))
        offset += width * dtype.itemsize
    return plan, -(-offset // _ALIGN) * _ALIGN


def row_bytes(cfg: CacheConfig, kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one token's row in vLLM's tensor (the widest layer's, with per-layer formats): what the
    backend reports as the KV cache spec's per-token size, and so what vLLM's capacity figure divides by."""
    cfg.check_dims(kv_lora_rank, rope_dim)
    layers = [cfg.at(i) for i in range(len(cfg.layers))] or [cfg]
    return max(_plan(layer, kv_lora_rank, rope_dim)[1] for layer in layers)


def attach(kv_cache: torch.Tensor, cfg: CacheConfig, kv_lora_rank: int, rope_dim: int, max_seqs: int,
           layer: int = 0) -> PagedMLACache:
    """A `PagedMLACache` for cache index `layer` (its formats `cfg.at(layer)`) whose pools are views of
    vLLM's layer tensor `kv_cache` [num_blocks, block_size, C] (any dtype; C * itemsize must be
    `row_bytes(cfg)`) plus freshly allocated BF16 protected rows for `max_seqs` slots. Raises ValueError if
    the tensor does not have the expected row size or is not row-contiguous."""
    row = row_bytes(cfg, kv_lora_rank, rope_dim)
    cfg = cfg.at(layer)
    plan, _ = _plan(cfg, kv_lora_rank, rope_dim)
    if kv_cache.dim() != 3 or kv_cache.shape[-1] * kv_cache.element_size() != row:
        raise ValueError(f"vLLM's KV cache tensor {tuple(kv_cache.shape)} {kv_cache.dtype} does not have quantmla's "
                         f"{row}-byte rows for {cfg.content}/{cfg.rope}")
    if not kv_cache.is_contiguous():
        raise ValueError(f"vLLM's KV cache tensor has strides {kv_cache.stride()}; quantmla needs one row per "
                         f"token, rows and blocks one after another (vLLM's default layout)")
    num_blocks, block_size = kv_cache.shape[:2]
    raw = kv_cache.view(torch.uint8)  # [NB, P, row]
    tensors: dict[tuple[str, str], torch.Tensor] = {}
    for path, name, dtype, width, offset in plan:
        tensors[path, name] = raw[..., offset: offset + width * dtype.itemsize].view(dtype)
    # Allocate an empty cache with the right protected rows, then point its pools at vLLM's memory.
    cache = PagedMLACache.allocate(cfg, kv_lora_rank, rope_dim, num_blocks=1, max_seqs=max_seqs,
                                   block_size=block_size, device=kv_cache.device)
    for path in ("content", "rope"):
        old: PagedPath = getattr(cache, path)
        setattr(cache, path, PagedPath(old.fmt, old.dim, tensors[path, "codes"], tensors.get((path, "scale")),
                                       tensors.get((path, "zero"))))
    return cache
