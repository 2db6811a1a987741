"""QuantMLACache: a drop-in `transformers.Cache` that stores the MLA cache in quantized formats.

MLA models in transformers cache two single-head tensors per layer and call
``cache.update(c, k_pe, layer_idx, ...)`` with
  c     the content latent, [batch, 1, tokens, kv_lora_rank]   (the `keys` slot)
  k_pe  the post-RoPE key,   [batch, 1, tokens, rope_dim]       (the `values` slot)
in the model's dtype (bf16 when serving, fp32 in exactness tests).

Per layer and path, the token axis is split into three parts, in order:
  sink    the first `CacheConfig.sink` tokens, kept as given (input dtype), never quantized;
  body    every token that has left the recent window, quantized with the path's `QuantFormat`;
  recent  the last `CacheConfig.recent` tokens, kept as given.
A token is quantized as soon as it leaves the recent window, also within one long prefill call. Token-axis
(KIVI-style) formats quantize blocks of `group` tokens: tokens that left the window wait, as given, in a
`staging` part between body and recent until a whole block is there (they count in memory_bytes); the rule,
shared with the paged cache, is `quantmla.policy.quantized_end`. With
`CacheConfig.rope_rotation` the RoPE body holds H k_pe (H a randomized Hadamard, applied before quantizing
and undone after dequantizing: QuaRot's online rotation; sink, staging and recent are not rotated). The body is
a `Packed` whose fields grow along dim -2 by concatenation (no per-token Python lists):
  codes [batch, 1, n, packed width] uint8 (or the input dtype for the bf16 passthrough),
  scale / zero [batch, 1, n, dim / group] (fp16 for integer formats, fp32 scale for fp8, absent for bf16
  and per-tensor fp8; token-axis formats [batch, 1, n / group, dim]). Its bytes per token are exactly
  `quant.formats.bytes_per_token(fmt, dim)`.

`update` returns what the cache really holds, sink ++ dequantize(body) ++ recent in the input dtype, so even
the prefill's own queries attend to the quantized history (transformers' QuantizedCache returns the
unquantized prefill instead, which hides the damage from the first forward).

Use: build one cache per batch of sequences, pass it to the model, and read it back from your own variable
(the output names it `cache` in transformers 5.24, `past_key_values` before):
    cache = QuantMLACache(CacheConfig("int4", "int4", sink=4, recent=128))
    model.generate(ids, cache=cache, max_new_tokens=64)            # transformers 5.24: the current name
    model.generate(ids, past_key_values=cache, max_new_tokens=64)  # the classic name: releases without
                                                                    # `cache`; 5.24 accepts it with a
                                                                    # deprecation warning
The same keyword works for `model(ids, ...)`. Which name a model takes: `"cache" in
inspect.signature(model.forward).parameters`. `crop` removes tokens from the end, but tokens quantized when
they left the window stay quantized (later appends refill the window before anything more is quantized), so
`is_croppable` is False: assisted / speculative decoding runs, but tokens that rejected draft tokens pushed out
of the window stay quantized. A token-axis format cannot give back part of a quantized block, so a crop that
reaches into its body raises: with such a format, assisted decoding needs `recent` of at least the number of
draft tokens (rejected drafts are then cut from the window only).

Padding: the cache does not see the attention mask. Tell it each row's left padding, as
`QuantMLACache(config, left_padding=pads)` (pads: one pad count per row, e.g. `left_pads(attention_mask)`),
and each row's sink is its own first `sink` real tokens (positions pad_b .. pad_b + sink - 1), returned as
given. The shared sink tensor holds positions [0, sink); a row's real sink tokens past it are kept, as given,
in that path's `row_sink` [batch, 1, min(sink, max pad), dim] (row b in its first min(pad_b, sink) slots) and
put back over the dequantized body in what `update` returns. The recent window is aligned at the end, so
with channel formats (per token) every real token of a padded row is then stored and returned exactly as the
row alone, unpadded, would store it (also across decode steps, crops, batch selection and reordering and a
prefill in chunks); pads are stored like any token, and the attention mask hides them. Token-axis formats
(`policy.block_of` > 1) still count their blocks from position `sink` over the pads, so beyond its sink a
padded row is stored as today, not as alone. Without `left_padding` the pads are tokens to the cache: they
fill a padded row's sink while its real first tokens are quantized (with sink=0 and channel formats every row
is still stored as alone). The engine (`quantmla.engine`) needs no padding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import Cache, DynamicLayer

from quantmla.config import CacheConfig, QuantFormat
from quantmla.policy import block_of, quantized_end
from quantmla.quant.formats import Packed, check_finite, dequantize, quantize


def _map_packed(p: Packed, fn) -> Packed:
    return Packed(*(None if t is None else fn(t) for t in (p.codes, p.scale, p.zero)))


def _drop_last(t: torch.Tensor, n: int) -> torch.Tensor:
    return t[..., : t.shape[-2] - n, :]


def online_rotation(spec: str, dim: int) -> torch.Tensor | None:
    """The fp32 [dim, dim] matrix of a CacheConfig.rope_rotation spec ("hadamard[:SEED]": H diag(random signs)
    / sqrt(dim), a random orthogonal matrix where dim is not a power of two), or None for ""."""
    if not spec:
        return None
    from quantmla.calibrate.content import random_hadamard

    return random_hadamard(dim, torch.Generator().manual_seed(int(spec.partition(":")[2] or 0)))


def left_pads(attention_mask: torch.Tensor) -> torch.Tensor:
    """Pad counts of a left-padded attention mask [batch, tokens] (1 real, 0 pad): int64 [batch], on the mask's
    device. Raises ValueError naming the row if a row has a pad after a real token (not left padding) or no
    real token at all (its pad count would be its whole length)."""
    if attention_mask.dim() != 2:
        raise ValueError(f"left_pads takes an attention mask [batch, tokens], got {tuple(attention_mask.shape)}")
    real = attention_mask.bool()
    pads = (real.cumsum(-1) == 0).sum(-1)
    for row, (pad, n_real) in enumerate(zip(pads.tolist(), real.sum(-1).tolist())):
        if pad == real.shape[-1]:
            raise ValueError(f"left_pads: row {row} of the attention mask has no real token")
        if pad + n_real != real.shape[-1]:
            raise ValueError(f"left_pads: row {row} of the attention mask has a pad after a real token; this is "
                             "not left padding")
    return pads


def _check_left_padding(left_padding) -> torch.Tensor | None:
    """left_padding as an int64 CPU tensor [batch] (None stays None); ValueError unless one whole count >= 0 per
    row."""
    if left_padding is None:
        return None
    pads = torch.as_tensor(left_padding)
    if pads.dim() != 1 or pads.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise ValueError("left_padding takes one whole pad count per row ([batch] integers), got "
                         f"{pads.dtype} of shape {tuple(pads.shape)}")
    if (pads < 0).any():
        raise ValueError(f"left_padding counts must be >= 0, got {pads.tolist()}")
    return pads.to("cpu", torch.int64)


def _row_sink_slots(pads: torch.Tensor, sink: int, span: int, start: int, end: int):
    """(rows, slots, positions), int64 [k] each: the `row_sink` slots whose token sits at a position in
    [start, end). Slot j of row b holds its real token at position max(pads[b], sink) + j, for
    j < min(pads[b], sink): its real sink tokens past the shared sink."""
    j = torch.arange(span, device=pads.device)
    pos = pads.clamp(min=sink)[:, None] + j
    rows = torch.arange(len(pads), device=pads.device)[:, None].expand_as(pos)
    use = (j < pads.clamp(max=sink)[:, None]) & (pos >= start) & (pos < end)
    return rows[use], j.expand_as(pos)[use], pos[use]


# Row operations (of batch selection and reordering) on any [batch, ...] tensor, on its own device.
def _gather_rows(idx: torch.Tensor):
    return lambda t: t.index_select(0, idx.to(t.device))


def _select_rows(indices):
    return lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices, ...]


def _repeat_rows(repeats: int):
    return lambda t: t.repeat_interleave(repeats, dim=0)


def _cat_packed(a: Packed, b: Packed) -> Packed:
    fields = zip((a.codes, a.scale, a.zero), (b.codes, b.scale, b.zero))
    return Packed(*(None if x is None else torch.cat([x, y], dim=-2) for x, y in fields))


@dataclass
class PathStore:
    """One path (content or RoPE) of one layer, in token order: sink [B,1,s,D] ++ body (Packed, n tokens) ++
    staging [B,1,w,D] (token-axis formats only: w < group) ++ recent [B,1,r,D]. With left padding, row_sink
    [B,1,e,D] also holds each padded row's real sink tokens past position `sink` (module docstring), which
    `append` puts back over the history it returns; e = 0 without padding."""

    fmt: QuantFormat
    what: str  # "layer 3 content": named in every error
    sink: torch.Tensor
    body: Packed
    recent: torch.Tensor
    staging: torch.Tensor | None = None
    rotation: torch.Tensor | None = None  # [D, D] orthogonal: the body holds x @ rotation.T
    row_sink: torch.Tensor | None = None

    @classmethod
    def empty(cls, like: torch.Tensor, fmt: QuantFormat, what: str, rotation: torch.Tensor | None = None,
              row_sink: int = 0) -> PathStore:
        """No tokens yet, for like's batch, width and dtype; row_sink: the slots per row of `row_sink`."""
        none = like[..., :0, :]
        # Quantizing zero tokens gives a body of the right dtypes and trailing shapes to concatenate onto.
        return cls(fmt, what, none.clone(), quantize(none.clone(), fmt, what), none.clone(), none.clone(), rotation,
                   like.new_zeros((like.shape[0], 1, row_sink, like.shape[-1])))

    @property
    def block(self) -> int:
        return block_of(self.fmt)

    @property
    def n_body(self) -> int:
        return self.body.codes.shape[-2]

    def __len__(self) -> int:
        return self.sink.shape[-2] + self.n_body + self.staging.shape[-2] + self.recent.shape[-2]

    def check(self, x: torch.Tensor) -> None:
        """Raise, changing nothing, if `append(x)` would refuse x (another batch size; NaN/Inf where quantized)."""
        if len(self) and x.shape[0] != self.sink.shape[0]:
            raise ValueError(f"{self.what}: this cache holds {self.sink.shape[0]} sequence(s), got a batch of "
                             f"{x.shape[0]}; use one cache per batch (or its batch_repeat_interleave / "
                             "batch_select_indices)")
        if self.fmt.kind != "bf16":
            check_finite(x, self.what)  # fail at the call that brought the NaN, not when it leaves the window

    def append(self, x: torch.Tensor, config: CacheConfig, checked: bool = False,
               pads: torch.Tensor | None = None) -> torch.Tensor:
        """Add tokens x [B,1,n,D]; quantize whatever leaves the window; return the whole history [B,1,T,D].
        checked=True: the caller has run `check(x)` already. pads: int64 [B], each row's left padding; needed
        where `row_sink` has slots (`empty(row_sink=...)`)."""
        if not checked:
            self.check(x)
        if not len(self) and x.shape[0] != self.sink.shape[0]:  # emptied by a crop: its empty rows take x's batch
            self.map(lambda t: t.new_empty((x.shape[0], *t.shape[1:])))
        start = len(self)
        if self.row_sink.shape[-2]:
            # Kept as given before anything is quantized; a token that comes again after a crop is kept again.
            rows, slots, pos = _row_sink_slots(pads, config.sink, self.row_sink.shape[-2], start, start + x.shape[-2])
            self.row_sink[rows, 0, slots] = x[rows, 0, pos - start]
        length = start + x.shape[-2]
        take = min(x.shape[-2], config.sink - self.sink.shape[-2])
        if take > 0:
            self.sink = torch.cat([self.sink, x[..., :take, :]], dim=-2)
            x = x[..., take:, :]
        held = torch.cat([self.staging, self.recent, x], dim=-2)  # unquantized tokens past the sink, in order
        # After a crop the body may hold more tokens than the policy quantizes at this length (they stay
        # quantized): nothing is ready until the policy catches up.
        ready = max(0, quantized_end(length, config.sink, config.recent, self.block) - config.sink - self.n_body)
        if ready:
            block = held[..., :ready, :]
            if self.rotation is not None:
                block = (block.float() @ self.rotation.to(block.device).T).to(block.dtype)
            self.body = _cat_packed(self.body, quantize(block, self.fmt, self.what))
        keep = min(config.recent, held.shape[-2] - ready)
        # clone: do not keep the larger buffers alive
        self.staging = held[..., ready : held.shape[-2] - keep, :].clone()
        self.recent = held[..., held.shape[-2] - keep :, :].clone()
        out = torch.cat([self.sink, self.dequantized_body(), self.staging, self.recent], dim=-2)
        if self.row_sink.shape[-2]:
            rows, slots, pos = _row_sink_slots(pads, config.sink, self.row_sink.shape[-2], 0, length)
            out[rows, 0, pos] = self.row_sink[rows, 0, slots]
        return out

    def dequantized_body(self) -> torch.Tensor:
        """The body in the sink's dtype, rotated back where the path has an online rotation."""
        if self.rotation is None:
            return dequantize(self.body, self.fmt, self.sink.dtype, self.sink.shape[-1])
        body = dequantize(self.body, self.fmt, torch.float32, self.sink.shape[-1])
        return (body @ self.rotation.to(body.device)).to(self.sink.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.sink, *self.body.tensors(), self.staging, self.recent, self.row_sink]

    def map(self, fn) -> None:
        """Apply fn to every stored tensor (batch selection, beam reordering, device moves)."""
        self.sink, self.recent, self.body = fn(self.sink), fn(self.recent), _map_packed(self.body, fn)
        self.staging, self.row_sink = fn(self.staging), fn(self.row_sink)

    def check_crop(self, n: int) -> None:
        """Raise, changing nothing, if the last n tokens cut a quantized block (token-axis formats)."""
        cut = min(max(n - self.recent.shape[-2] - self.staging.shape[-2], 0), self.n_body)
        if cut % self.block:
            raise ValueError(f"{self.what}: cannot crop {cut} quantized tokens out of {self.fmt}'s blocks of "
                             f"{self.block} tokens; assisted or speculative decoding crops its rejected draft "
                             "tokens: with a token-axis format keep `recent` at least the number of draft tokens, "
                             "or use a channel format")

    def crop_last(self, n: int) -> None:
        """Drop the last n tokens, from the recent window first, then staging, the body, then the sink
        (`check_crop` first: a cut through a block would be wrong). `row_sink` keeps its slots: a slot past the
        new length is not returned, and is kept again when its position is appended again."""
        for part in ("recent", "staging"):
            cut = min(n, getattr(self, part).shape[-2])
            setattr(self, part, _drop_last(getattr(self, part), cut))
            n -= cut
        cut = min(n, self.n_body)
        body = self.body
        self.body = Packed(_drop_last(body.codes, cut), *(None if t is None else _drop_last(t, cut // self.block)
                                                          for t in (body.scale, body.zero)))
        self.sink = _drop_last(self.sink, min(n - cut, self.sink.shape[-2]))

    def report(self) -> dict:
        return {"format": str(self.fmt), "quantized_tokens": self.n_body, "staged_tokens": self.staging.shape[-2],
                "protected_tokens": self.sink.shape[-2] + self.recent.shape[-2],
                "row_sink_slots": self.row_sink.shape[-2],
                "bytes": sum(t.numel() * t.element_size() for t in self.tensors())}


class QuantMLALayer(DynamicLayer):
    """One layer of QuantMLACache: a content PathStore (`keys` slot) and a RoPE PathStore (`values` slot).

    Subclasses DynamicLayer for the parts that do not depend on storage (mask sizes, max length), which then
    follow the installed transformers version. `keys`/`values` are left unset: the data lives in
    `self.content` and `self.rope`.
    """

    is_croppable = False  # crop() works, but tokens quantized on leaving the window do not come back to BF16

    def __init__(self, config: CacheConfig = CacheConfig(), layer_idx: int | None = None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.left_padding: torch.Tensor | None = None  # int64 [batch], CPU: QuantMLACache's, set at each update
        self.content: PathStore | None = None
        self.rope: PathStore | None = None

    @property
    def _name(self) -> str:
        return "layer" if self.layer_idx is None else f"layer {self.layer_idx}"

    def _check_shapes(self, c: torch.Tensor, k_pe: torch.Tensor) -> None:
        for what, x in (("content latent (keys)", c), ("rope key (values)", k_pe)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] != 1:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"QuantMLACache {self._name}: expected an MLA {what} of shape "
                                 f"[batch, 1, tokens, dim], got {shape}; is this an MLA model?")
        if c.shape[0] != k_pe.shape[0] or c.shape[2] != k_pe.shape[2]:
            raise ValueError(f"QuantMLACache {self._name}: content {tuple(c.shape)} and rope {tuple(k_pe.shape)} "
                             "disagree on batch or tokens")
        if self.content is not None and (c.shape[-1], k_pe.shape[-1]) != (
                self.content.sink.shape[-1], self.rope.sink.shape[-1]):
            raise ValueError(f"QuantMLACache {self._name}: widths changed from ({self.content.sink.shape[-1]}, "
                             f"{self.rope.sink.shape[-1]}) to ({c.shape[-1]}, {k_pe.shape[-1]})")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._check_shapes(key_states, value_states)
        # Fitted to the widths as the CLI, the engine and the evals fit them (`QuantFormat.fit`: the default group
        # where it does not divide, a group wider than the path): CacheConfig("int4", "int4") then serves
        # MiniCPM3's 32 RoPE channels as `--rope int4` does.
        self.config = replace(self.config, content=self.config.content.fit(key_states.shape[-1]),
                              rope=self.config.rope.fit(value_states.shape[-1]))
        self.config.content.check_dim(key_states.shape[-1], f"{self._name} content")
        self.config.rope.check_dim(value_states.shape[-1], f"{self._name} rope")
        self.device = key_states.device
        # Slots for the real sink tokens that padding pushes past the shared sink: min(pad, sink) per row.
        row_sink = 0 if self.left_padding is None else min(self.config.sink, int(self.left_padding.max()))
        self.content = PathStore.empty(key_states, self.config.content, f"{self._name} content", row_sink=row_sink)
        rotation = online_rotation(self.config.rope_rotation, value_states.shape[-1])
        self.rope = PathStore.empty(value_states, self.config.rope, f"{self._name} rope", rotation, row_sink)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store c [B,1,n,dc] and k_pe [B,1,n,dr]; return the held history of each, [B,1,T,*], input dtype."""
        if self.left_padding is not None and len(self.left_padding) != key_states.shape[0]:
            raise ValueError(f"QuantMLACache {self._name}: left_padding has {len(self.left_padding)} pad counts, one "
                             f"per row, but the batch has {key_states.shape[0]} rows (generate repeats each row "
                             "max(num_beams, num_return_sequences) times: repeat_interleave the counts as well)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_shapes(key_states, value_states)
        # Both paths are checked before either stores, so a refused call (NaN in k_pe) leaves neither path a
        # call ahead of the other (later calls would return histories of different lengths).
        self.content.check(key_states)
        self.rope.check(value_states)
        pads = self.left_padding
        return (self.content.append(key_states, self.config, checked=True, pads=pads),
                self.rope.append(value_states, self.config, checked=True, pads=pads))

    def get_seq_length(self) -> int:
        return len(self.content) if self.is_initialized else 0

    def _paths(self) -> list[PathStore]:
        return [self.content, self.rope] if self.is_initialized else []

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in self._paths() for t in p.tensors()]

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def reset(self) -> None:
        self.content = self.rope = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last -tokens_to_remove tokens (transformers' convention: a negative count)."""
        self.check_crop(tokens_to_remove)  # both paths can be cut, or neither is
        for p in self._paths():
            p.crop_last(-tokens_to_remove)

    def check_crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove, as DynamicLayer.crop does")
        for p in self._paths():
            p.check_crop(-tokens_to_remove)

    def _map(self, fn) -> None:
        for p in self._paths():
            p.map(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        # Exact: the body is quantized per token and per sequence, so rows can be gathered without a round trip.
        self._map(_gather_rows(beam_idx))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(_select_rows(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(_repeat_rows(repeats))

    def offload(self):
        self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        self._map(lambda t: t.to(self.device, non_blocking=True))


class QuantMLACache(Cache):
    """A transformers `Cache` for MLA models holding the content latent and the RoPE key in quantized formats.

    config:     formats of the two paths and the protected tokens (`sink`, `recent`), see CacheConfig; with
                per-layer formats (`CacheConfig.layers`) layer i stores `config.at(i)`'s.
    num_layers: number of `cache.update` layer indices the model uses (LongCat-Flash: two per decoder layer);
                None adds layers lazily as they are first updated.
    left_padding: for a left-padded batch, each row's pad count: a list of ints or an integer tensor [batch],
                e.g. `left_pads(attention_mask)`; every update must then have that many rows (ValueError
                otherwise; generate's beam search repeats rows before the first update, so repeat the counts
                too). Each row's sink is then its first `sink` real tokens, and with channel formats each row
                is stored exactly as alone (module docstring, "Padding"). None (default): no padding.

    Layout, update semantics and how to pass it to `model(...)` / `generate(...)`: see the module docstring.
    memory_bytes() counts every stored tensor (numel * element_size): packed codes, scales, zeros and the
    protected tokens in their input dtype, the row sinks of left padding included.
    """

    def __init__(self, config: CacheConfig = CacheConfig(), num_layers: int | None = None, left_padding=None):
        # Refused here: the layers read it lazily, so a wrong type would fail only inside the model's forward
        # (None: cache_config_of on a checkpoint never calibrated).
        if not isinstance(config, CacheConfig):
            hint = (" (cache_config_of returns None for a checkpoint without a quantmla section: one that "
                    "`quantmla calibrate` did not write)" if config is None else "")
            raise TypeError(f"QuantMLACache takes a CacheConfig, e.g. CacheConfig('int4', 'int4'), got "
                            f"{type(config).__name__}{hint}")
        self.config = config
        self.num_layers = num_layers
        # The one copy: it follows the rows through batch selection and reordering, and each update hands it to
        # its layer.
        self.left_padding = _check_left_padding(left_padding)
        layers = [] if num_layers is None else [QuantMLALayer(config.at(i), i) for i in range(num_layers)]
        super().__init__(layers=layers)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # Cache.update can only replicate a layer class without arguments; ours needs the config and its index.
        if self.num_layers is not None and layer_idx >= self.num_layers:
            raise ValueError(f"QuantMLACache was built for {self.num_layers} layers but got layer_idx={layer_idx} "
                             "(LongCat-Flash uses two per decoder layer); pass num_layers=None to add them lazily")
        while len(self.layers) <= layer_idx:
            self.layers.append(QuantMLALayer(self.config.at(len(self.layers)), len(self.layers)))
        self.layers[layer_idx].left_padding = self.left_padding
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _map_pads(self, fn) -> None:
        if self.left_padding is not None:
            self.left_padding = fn(self.left_padding)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_pads(_gather_rows(beam_idx))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_pads(_select_rows(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_pads(_repeat_rows(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """`QuantMLALayer.crop` on every layer, checked on all of them before any is cut: a crop through a
        token-axis block raises and leaves the cache as it was."""
        for layer in self.layers:
            layer.check_crop(tokens_to_remove)
        super().crop(tokens_to_remove)

    def memory_bytes(self) -> int:
        """Total bytes really held by every layer: sum of numel * element_size of every stored tensor."""
        return sum(layer.memory_bytes() for layer in self.layers)

    def held_tokens(self) -> int:
        """Tokens held per layer, over the whole batch (batch * sequence length)."""
        first = next((layer for layer in self.layers if layer.is_initialized), None)
        return 0 if first is None else first.content.sink.shape[0] * first.get_seq_length()

    def bytes_per_token(self) -> float:
        """memory_bytes / held tokens (batch * sequence) / layers: comparable to formats.bytes_per_token sums."""
        layers = sum(layer.is_initialized for layer in self.layers)
        tokens = self.held_tokens()
        return self.memory_bytes() / tokens / layers if tokens and layers else 0.0

    def memory_report(self) -> dict:
        """Per path: format, quantized, staged and protected tokens and row-sink slots (left padding) per layer
        (one value where every layer agrees, else a list in layer order: a calibrated checkpoint's formats differ
        per layer), and bytes over all layers."""
        live = [layer for layer in self.layers if layer.is_initialized]
        report = {"layers": len(live), "tokens": live[0].get_seq_length() if live else 0,
                  "bytes": self.memory_bytes(), "bytes_per_token": self.bytes_per_token()}
        for path in ("content", "rope"):
            parts = [getattr(layer, path).report() for layer in live]
            if parts:
                values = {k: [p[k] for p in parts] for k in parts[0]}
                report[path] = {k: v[0] if len(set(v)) == 1 else v for k, v in values.items()}
                report[path]["bytes"] = sum(values["bytes"])
        return report
