"""Frozen, validated configuration: cache formats, the cache policy, and the MLA description of a layer.

Everything below the CLI receives these objects explicitly; nothing reads flags or globals.
"""

from __future__ import annotations

import math

import numbers
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Kind:
    """What a format kind is: its bits per code, its default channels per scale group, and its family, which
    picks the quantizer in `quant.formats` (int: asymmetric code * scale + zero; fp8; fp4: e2m1 with e4m3
    block scales; codebook: Lloyd-Max levels times a per-group rms; bf16: the values themselves)."""

    bits: int
    default_group: int
    family: str


# Default groups: fp8 128 like FlashMLA's 656-byte row; the integer kinds 64; fp4 16 as NVFP4's blocks; the
# codebook kinds 0 = one norm per token over the whole path (TurboQuant).
KINDS = {
    "bf16": Kind(16, 0, "bf16"),
    "fp8": Kind(8, 128, "fp8"),
    "int8": Kind(8, 64, "int"),
    "int4": Kind(4, 64, "int"),
    "int2": Kind(2, 64, "int"),
    "fp4": Kind(4, 16, "fp4"),
    "lm4": Kind(4, 0, "codebook"),
    "lm3": Kind(3, 0, "codebook"),
    "lm2": Kind(2, 0, "codebook"),
}
# Tokens per block of a token-axis (KIVI-style) format spelled without a count, e.g. `int4:t`.
DEFAULT_TOKEN_GROUP = 32
ROPE_ROTATIONS = ("", "hadamard")
# Clipping ratios calibration tries per path and layer (`calibrate.space`); 1.0 = none.
CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5)


@dataclass(frozen=True)
class QuantFormat:
    """How one cache path (content or RoPE) is stored per token.

    kind:  bf16 (passthrough), fp8 (e4m3 with fp32 scales), int8 / int4 / int2 (asymmetric, fp16 scale + zero),
           fp4 (e2m1 codes, an e4m3 scale per block: NVFP4-style), lm4 / lm3 / lm2 (Lloyd-Max codebook for a
           Gaussian, fp16 rms per group: TurboQuant-style, meant for rotated vectors).
    group: channels that share one scale (and zero). 0 means one scale for the whole tensor, which only fp8
           supports: a fixed per-tensor scale of 1.0, as vLLM's default FP8 KV cache does; for the codebook
           kinds 0 means one norm per token over the whole path.
    axis:  "channel" (groups of channels within a token) or "token" (integer kinds only, KIVI-style: each
           channel is grouped over `group` consecutive tokens, one scale + zero per channel and block).
    clip:  integer kinds only: the fraction of each group's range [min, max] the codes span, centred on the
           range's midpoint (1.0: the whole range, nothing clipped). Values outside clip to the end codes; a
           smaller step trades clipping error for rounding error (`quant.formats`).
    rank:  integer kinds, channel axis only: store just the first `rank` channels of the path (a multiple of
           the group); the others read back as 0 (0: store every channel). Meant for a path rotated so that
           its energy sits in the leading channels (calibration's principal-axes start, `calibrate.content`):
           the dropped channels cost no bytes, so the bits go where the signal is.
    Spelled on the command line as ``int4`` or ``int4:32`` (kind:group), ``int4:t64`` for the token axis,
    ``r256`` appended for a rank and ``c0.9`` for a clipping ratio: ``int4c0.9``, ``int4:32c0.9``,
    ``int4:t64c0.9``, ``int8r128``, ``int4:32r256c0.9``.
    """

    kind: str
    group: int = -1  # -1: the kind's default
    axis: str = "channel"
    clip: float = 1.0
    rank: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown cache format {self.kind!r}; supported: {', '.join(KINDS)}")
        if self.group == -1:
            object.__setattr__(self, "group", KINDS[self.kind].default_group)
        if self.group < 0:
            raise ValueError(f"group size must be >= 0, got {self.group}")
        if self.kind == "bf16" and self.group != 0:
            object.__setattr__(self, "group", 0)
        if self.family in ("int", "fp4") and self.group == 0:
            per = "tokens per scale block" if self.axis == "token" else "channels per scale"
            raise ValueError(f"{self.kind} needs a group size > 0 ({per})")
        if self.axis not in ("channel", "token"):
            raise ValueError(f"axis must be 'channel' or 'token', got {self.axis!r}")
        if self.axis == "token" and not self.is_integer:
            raise ValueError(f"{self.kind} cannot group along tokens; only int8/int4/int2 can (e.g. int4:t64)")
        object.__setattr__(self, "clip", float(self.clip))
        if not 0 < self.clip <= 1:
            raise ValueError(f"clipping ratio must be in (0, 1], got {self.clip}")
        if self.clip != 1 and not self.is_integer:
            raise ValueError(f"{self.kind} has no clipping ratio; only int8/int4/int2 do (e.g. int4c0.9)")
        if self.rank:
            if not self.is_integer or self.axis != "channel":
                raise ValueError(f"only channel-grouped int8/int4/int2 store a rank (e.g. int8r128), not {self}")
            if self.rank < 0:
                raise ValueError(f"a rank must be positive, got {self.rank}")
            if self.rank % self.group:
                raise ValueError(f"{self}: the rank must be a multiple of the group ({self.group}); spell a group "
                                 f"that divides it, e.g. {self.kind}:{math.gcd(self.rank, self.group)}r{self.rank}")

    @property
    def bits(self) -> int:
        return KINDS[self.kind].bits

    @property
    def family(self) -> str:
        return KINDS[self.kind].family

    @property
    def is_integer(self) -> bool:
        return self.family == "int"

    def stored(self, dim: int) -> int:
        """Channels of a `dim`-channel path this format stores: its rank, or all of them."""
        return self.rank or dim

    @classmethod
    def parse(cls, spec: str | QuantFormat) -> QuantFormat:
        if isinstance(spec, QuantFormat):
            return spec
        # No kind has a "c" or an "r" in its name: after a "c" comes the clipping ratio, after an "r" the rank.
        base, has_clip, clip_text = str(spec).strip().lower().partition("c")
        try:
            clip = float(clip_text) if has_clip else 1.0
        except ValueError:
            raise ValueError(f"bad format {spec!r}: expected KIND[:GROUP or :tTOKENS][rRANK][cCLIP], e.g. int4, "
                             "int4:32, int4:t64, int8r128, int4:32c0.9") from None
        base, has_rank, rank = base.partition("r")
        if has_rank and (not rank.isdigit() or not int(rank)):  # rank 0 means "every channel": not a spelling
            raise ValueError(f"bad format {spec!r}: expected a positive rank after 'r', e.g. int8r128")
        kind, _, group = base.partition(":")
        if group.startswith("t"):  # token axis: int4:t64 (or int4:t for the default block)
            tokens = group[1:]
            if tokens and not tokens.isdigit():
                raise ValueError(f"bad format {spec!r}: expected KIND:tTOKENS, e.g. int4:t64")
            return cls(kind, int(tokens) if tokens else DEFAULT_TOKEN_GROUP, "token", clip, int(rank or 0))
        if group and not group.isdigit():
            raise ValueError(f"bad format {spec!r}: expected KIND or KIND:GROUP, e.g. int4 or int4:32")
        if kind == "bf16" and group:  # a spelled group would be dropped silently
            raise ValueError(f"bad format {spec!r}: bf16 stores the values themselves, with no groups; write bf16")
        return cls(kind, int(group) if group else -1, "channel", clip, int(rank or 0))

    def check_dim(self, dim: int, path: str = "cache") -> None:
        """Raise if the group size does not divide the path's width."""
        if self.group and self.axis == "channel" and dim % self.group:
            fits = max(g for g in range(1, min(self.group, dim) + 1) if dim % g == 0)
            raise ValueError(f"{path} format {self}: group {self.group} does not divide its {dim} channels; "
                             f"give a group that does, e.g. {self.kind}:{fits}")
        stored = self.stored(dim)  # a ranked format packs only its leading `rank` channels
        if self.bits in (4, 2) and stored % (8 // self.bits):
            raise ValueError(f"{path} format {self}: {stored} channels cannot be packed {8 // self.bits} per byte")
        if self.bits == 3 and stored % 8:
            raise ValueError(f"{path} format {self}: {stored} channels cannot be packed 8 per 3 bytes")
        if self.rank > dim:
            raise ValueError(f"{path} format {self}: rank {self.rank} exceeds its {dim} channels")

    def fit(self, dim: int) -> QuantFormat:
        """This format for a path of `dim` channels: a group wider than the path becomes the whole path; the
        kind's default group where it does not divide the path becomes the largest power of two (>= 8) that
        does, e.g. int4 on 96 channels int4:32 (powers of two: what the decode kernels take). Any other
        group is kept as given (`check_dim` then says what is wrong)."""
        if self.axis != "channel" or self.rank or not self.group:
            return self
        if self.group > dim:
            return QuantFormat(self.kind, dim, clip=self.clip)
        if dim % self.group and self.group == KINDS[self.kind].default_group and self.kind != "fp4":  # NVFP4: 16
            fits = dim & -dim  # the largest power of two dividing dim
            if fits >= 8:
                return QuantFormat(self.kind, min(fits, self.group), clip=self.clip)
        return self

    def __str__(self) -> str:
        clip = "" if self.clip == 1 else f"c{self.clip!r}"
        rank = f"r{self.rank}" if self.rank else ""
        if self.axis == "token":
            return f"{self.kind}:t{self.group}{clip}"
        if self.kind == "bf16" or self.group == KINDS[self.kind].default_group:
            return self.kind + rank + clip
        return f"{self.kind}:{self.group}{rank}{clip}"


@dataclass(frozen=True)
class CacheConfig:
    """Formats of the two cache paths and which tokens stay in BF16.

    sink:   the first `sink` tokens of every sequence are never quantized (attention sinks).
    recent: the most recent `recent` tokens stay in BF16; a token is quantized when it leaves this window.
    rope_rotation: "" (none) or "hadamard[:SEED]": an online rotation of the RoPE path's quantized body
            (QuaRot). A Hadamard does not commute with RoPE, so it cannot be folded into the weights: the
            cache rotates keys before quantizing and rotates back after dequantizing (a kernel would rotate
            the query instead). Protected tokens are not rotated.
    layers: per-layer formats, one (content, rope) pair per cache index (what a calibration chose layer by
            layer); empty: every layer uses `content` / `rope`. `at(i)` is layer i's config. Where layers are
            given, `content` / `rope` name the format the choice started from (reports, tools that read one).
    """

    content: QuantFormat = field(default_factory=lambda: QuantFormat("int4"))
    rope: QuantFormat = field(default_factory=lambda: QuantFormat("int4"))
    sink: int = 4
    recent: int = 128
    rope_rotation: str = ""
    layers: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "content", QuantFormat.parse(self.content))
        object.__setattr__(self, "rope", QuantFormat.parse(self.rope))
        object.__setattr__(self, "layers", tuple((QuantFormat.parse(c), QuantFormat.parse(r))
                                                 for c, r in self.layers))
        if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in (self.sink, self.recent)):
            raise ValueError(f"sink and recent must be whole numbers of tokens, got sink={self.sink!r}, "
                             f"recent={self.recent!r}")
        if self.sink < 0 or self.recent < 0:
            raise ValueError(f"sink and recent must be >= 0, got sink={self.sink}, recent={self.recent}")
        kind, _, seed = self.rope_rotation.partition(":")
        if kind not in ROPE_ROTATIONS or (seed and not seed.isdigit()) or (seed and not kind):
            raise ValueError(f"bad rope_rotation {self.rope_rotation!r}: expected '' or 'hadamard[:SEED]'")

    def check_dims(self, kv_lora_rank: int, rope_dim: int) -> None:
        for i, (content, rope) in enumerate(((self.content, self.rope), *self.layers)):
            where = "" if i == 0 else f"layer {i - 1} "
            content.check_dim(kv_lora_rank, where + "content")
            rope.check_dim(rope_dim, where + "rope")

    def at(self, layer: int) -> CacheConfig:
        """Layer `layer`'s config (one format per path). Raises for a layer the per-layer formats lack."""
        if not self.layers:
            return self
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"this cache config has formats for {len(self.layers)} layers, not for layer {layer}")
        content, rope = self.layers[layer]
        return replace(self, content=content, rope=rope, layers=())

    @property
    def per_layer(self) -> tuple:
        """(content, rope) of every layer, or of the one shared format pair: [(QuantFormat, QuantFormat)]."""
        return self.layers or ((self.content, self.rope),)

    def fit(self, kv_lora_rank: int, rope_dim: int) -> CacheConfig:
        """The config for a model's dims (small test models have paths narrower than the default groups)."""
        cfg = CacheConfig(self.content.fit(kv_lora_rank), self.rope.fit(rope_dim), self.sink, self.recent,
                          self.rope_rotation, tuple((c.fit(kv_lora_rank), r.fit(rope_dim)) for c, r in self.layers))
        cfg.check_dims(kv_lora_rank, rope_dim)
        return cfg

    def to_dict(self) -> dict:
        d = {"content": str(self.content), "rope": str(self.rope), "sink": self.sink, "recent": self.recent}
        if self.rope_rotation:
            d["rope_rotation"] = self.rope_rotation
        if self.layers:
            d["layers"] = [[str(c), str(r)] for c, r in self.layers]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CacheConfig:
        return cls(d["content"], d["rope"], int(d.get("sink", 4)), int(d.get("recent", 128)),
                   d.get("rope_rotation", ""), tuple(tuple(pair) for pair in d.get("layers", ())))

    @classmethod
    def bf16(cls) -> CacheConfig:
        return cls("bf16", "bf16")
