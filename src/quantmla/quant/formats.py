"""The one numeric source of truth for cache formats: quantize, dequantize, pack, and count bytes.

Byte layout per token (last dim), for a path of `dim` channels and group size `g`:
  bf16   codes: the values themselves, in the dtype they came in (bf16 when serving; fp32 in exactness
         tests)                                                      -> 2*dim bytes in bf16
  int8   codes: uint8 [dim]; scale, zero: fp16 [dim/g]              -> dim + 4*dim/g bytes
  int4   codes: uint8 [dim/2], channel 2i in the low nibble, 2i+1 in the high nibble; scale, zero fp16 [dim/g]
  int2   codes: uint8 [dim/4], channel 4i+k in bits 2k..2k+1; scale, zero fp16 [dim/g]
  fp8    codes: e4m3 bit patterns as uint8 [dim]; scale fp32 [dim/g] (g=0: fixed scale 1.0, no bytes)
  fp4    codes: uint8 [dim/2], nibbles as int4; a nibble is e2m1: bit 3 sign, bits 0-2 index into
         FP4_VALUES; scale: e4m3 bit patterns as uint8 [dim/g]        -> dim/2 + dim/g bytes (NVFP4-style)
  lmB    (lm4 / lm3 / lm2) codes: index into the B-bit Lloyd-Max levels of N(0, 1), packed as int4/int2, or
         for lm3 8 codes per 3 bytes (one little-endian 24-bit word, channel 8i+k in bits 3k..3k+2);
         scale: fp16 rms [dim/g] (g=0: one per token)          -> dim*B/8 + 2*(dim/g, or 1) bytes
Integer formats are asymmetric: x ~= code * scale + zero, code in [0, 2^bits - 1], zero = group minimum.
With a clipping ratio r < 1 (QuantFormat.clip) the codes span the middle fraction r of the group's range:
zero = min + (max - min) * (1 - r) / 2, scale from (max - min) * r; values beyond clip to the end codes.
The bytes are the same as without clipping, and dequantizing is unchanged (code * scale + zero).
A ranked format (QuantFormat.rank = k, e.g. int8r128) stores channels [0, k) exactly as the format without a
rank stores a k-channel path (bytes: that of k channels); channels [k, dim) are not stored and dequantize to 0.
Token-axis integer formats (QuantFormat.axis == "token", KIVI-style) quantize x [..., n, dim] with n a
multiple of the block of g tokens: codes uint8 [..., n, dim*bits/8] packed along channels as above; scale,
zero fp16 [..., n/g, dim], one per channel and block   -> dim*bits/8 + 4*dim/g bytes per token on average.
Each family's quantizer, dequantizer and tensor list (`fields`, from which bytes_per_token and the paged and
vLLM pools follow) is one `Codec` in CODECS. A new kind of an existing family is one `Kind` in config.KINDS;
a new family adds its `Codec` here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction
from functools import lru_cache

import torch

from quantmla.config import QuantFormat

FP8_MAX = 448.0  # largest finite float8_e4m3fn
E4M3_MIN = 2.0**-9  # smallest positive (subnormal) float8_e4m3fn: the smallest fp4 block scale
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes, by the 3 low bits of the code
FP4_MAX = 6.0


@dataclass
class Packed:
    """A quantized tensor: packed codes plus per-group scale (and zero). Leading dims are untouched."""

    codes: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.zero) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def check_finite(x: torch.Tensor, what: str = "tensor") -> None:
    if not torch.isfinite(x).all():
        bad = (~torch.isfinite(x)).sum().item()
        raise ValueError(f"cannot quantize {what}: it holds {bad} non-finite values (NaN or Inf)")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in [0, 2^bits) along the last dim, 8/bits per byte, low bits first.
    3 bits: 8 codes per 3 bytes, low bits (and bytes) first."""
    if bits == 8:
        return codes.to(torch.uint8)
    if 8 % bits:
        shifts = torch.arange(0, 8 * bits, bits, device=codes.device)
        word = (codes.long().unflatten(-1, (-1, 8)) << shifts).sum(-1, keepdim=True)
        return ((word >> torch.arange(0, 8 * bits, 8, device=codes.device)) & 0xFF).to(torch.uint8).flatten(-2)
    per = 8 // bits
    c = codes.to(torch.uint8).unflatten(-1, (-1, per))
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (c << shifts).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_bits: uint8 [..., n] -> uint8 codes [..., n * 8/bits]."""
    if bits == 8:
        return packed
    if 8 % bits:
        bytes_ = packed.long().unflatten(-1, (-1, bits))
        word = (bytes_ << torch.arange(0, 8 * bits, 8, device=packed.device)).sum(-1, keepdim=True)
        codes = (word >> torch.arange(0, 8 * bits, bits, device=packed.device)) & ((1 << bits) - 1)
        return codes.to(torch.uint8).flatten(-2)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    return ((packed.unsqueeze(-1) >> shifts) & mask).flatten(-2)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    return pack_bits(codes, 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    return unpack_bits(packed, 4)


def _int_scale_zero(x: torch.Tensor, bits: int, group: int, checked: bool = True,
                    clip: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = x.float().unflatten(-1, (-1, group))
    lo, hi = g.amin(-1), g.amax(-1)
    span = hi - lo
    if clip != 1:  # the fused writer (kernels/cache_write.py) repeats these fp32 steps exactly
        lo = lo + span * ((1 - clip) / 2)
        span = span * clip
    # Round the fp16 scale up so the group maximum still maps inside the code range after storage.
    scale = (span / (2**bits - 1) * (1 + 2**-10)).clamp_min(2**-24)
    if checked and ((scale > 6e4).any() or (lo.abs() > 6e4).any()):
        raise ValueError("cannot quantize: values exceed the fp16 range of the scales (|x| > 6e4)")
    # Below 2^-14 fp16 is subnormal and may round down by far more than the 2^-10 margin; step such scales
    # up to the next fp16 value so the group maximum still fits (tiny ranges would otherwise clip).
    s16 = scale.half()
    s16 = torch.where(s16.float() < scale, torch.nextafter(s16, torch.full_like(s16, torch.inf)), s16)
    return s16, lo.half()


def _e4m3_at_least(s: torch.Tensor) -> torch.Tensor:
    """The smallest e4m3 value >= s (s in [0, 448]), as uint8 bit patterns; below 2^-9 the smallest one."""
    s = s.clamp(E4M3_MIN, FP8_MAX)
    bits = s.to(torch.float8_e4m3fn).view(torch.uint8)
    # Round-to-nearest may go down; for positive e4m3 the next bit pattern is the next larger value.
    return bits + (bits.view(torch.float8_e4m3fn).float() < s).to(torch.uint8)


def _quantize_fp4(x: torch.Tensor, fmt: QuantFormat, what: str, checked: bool) -> Packed:
    g = x.float().unflatten(-1, (-1, fmt.group))
    amax = g.abs().amax(-1)
    if checked and (amax > FP4_MAX * FP8_MAX).any():
        raise ValueError(f"cannot quantize to fp4: |x| > {FP4_MAX * FP8_MAX:g} exceeds the e4m3 block scales")
    # Scale rounded up, so the block maximum maps inside +-6 and nothing clips. No per-tensor second scale:
    # blocks with max below 6 * 2^-9 lose resolution (the smallest e4m3 scale).
    scale = _e4m3_at_least(amax / FP4_MAX)
    y = g / scale.view(torch.float8_e4m3fn).float().unsqueeze(-1)
    mids = torch.tensor(FP4_VALUES, device=x.device)
    mag = torch.bucketize(y.abs().clamp(max=FP4_MAX), (mids[1:] + mids[:-1]) / 2)  # nearest; ties go down
    codes = mag.to(torch.uint8) | ((y < 0).to(torch.uint8) << 3)
    return Packed(pack_bits(codes.flatten(-2), 4), scale)


def _dequantize_fp4(p: Packed, fmt: QuantFormat) -> torch.Tensor:
    codes = unpack_bits(p.codes, 4).long()
    vals = torch.tensor(FP4_VALUES, device=codes.device)[codes & 7] * (1 - 2 * (codes >> 3)).float()
    scale = p.scale.view(torch.float8_e4m3fn).float().unsqueeze(-1)
    return (vals.unflatten(-1, (-1, fmt.group)) * scale).flatten(-2)


def _phi(x: float) -> float:
    return math.exp(-x * x / 2) / math.sqrt(2 * math.pi) if math.isfinite(x) else 0.0


def _Phi(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


@lru_cache(maxsize=None)
def lloyd_max_gaussian(bits: int, iters: int = 1000) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(levels, thresholds) of the MSE-optimal 2^bits-level scalar quantizer of N(0, 1), by Lloyd's
    iteration on the exact density: thresholds are the midpoints of levels, levels the conditional means
    E[X | cell] = (phi(a) - phi(b)) / (Phi(b) - Phi(a)). Ascending; Max (1960) tabulates them."""
    n = 2**bits
    levels = [3.0 * (2 * i + 1 - n) / n for i in range(n)]
    for _ in range(iters):
        edges = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
        levels = [(_phi(a) - _phi(b)) / (_Phi(b) - _Phi(a)) for a, b in zip(edges, edges[1:])]
    return tuple(levels), tuple((a + b) / 2 for a, b in zip(levels, levels[1:]))


def _rms_scale(g: torch.Tensor, checked: bool = True) -> torch.Tensor:
    rms = g.pow(2).mean(-1).sqrt()
    if checked and (rms > 6e4).any():
        raise ValueError("cannot quantize: group rms exceeds the fp16 range of the norms (> 6e4)")
    return rms.clamp_min(2**-24).half()


def _quantize_codebook(x: torch.Tensor, fmt: QuantFormat, what: str, checked: bool) -> Packed:
    g = x.float().unflatten(-1, (-1, fmt.group or x.shape[-1]))
    scale = _rms_scale(g, checked)
    _, thresholds = lloyd_max_gaussian(fmt.bits)
    codes = torch.bucketize(g / scale.float().unsqueeze(-1), torch.tensor(thresholds, device=x.device))
    return Packed(pack_bits(codes.flatten(-2), fmt.bits), scale)


def _dequantize_codebook(p: Packed, fmt: QuantFormat) -> torch.Tensor:
    levels = torch.tensor(lloyd_max_gaussian(fmt.bits)[0], device=p.codes.device)
    vals = levels[unpack_bits(p.codes, fmt.bits).long()]
    return (vals.unflatten(-1, (-1, vals.shape[-1] // p.scale.shape[-1])) * p.scale.float().unsqueeze(-1)).flatten(-2)


def _quantize_tokens(x: torch.Tensor, fmt: QuantFormat, what: str, checked: bool) -> Packed:
    """KIVI-style: each channel grouped over blocks of fmt.group tokens (dim -2)."""
    if x.dim() < 2 or x.shape[-2] % fmt.group:
        raise ValueError(f"cannot quantize {what} as {fmt}: needs a multiple of {fmt.group} tokens along dim -2, "
                         f"got shape {tuple(x.shape)}")
    xt = x.transpose(-1, -2)  # [..., dim, n]: the token blocks become the last dim's groups
    scale, zero = _int_scale_zero(xt, fmt.bits, fmt.group, checked, fmt.clip)
    g = xt.float().unflatten(-1, (-1, fmt.group))
    codes = ((g - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).round_().clamp_(0, 2**fmt.bits - 1)
    codes = codes.flatten(-2).transpose(-1, -2)  # [..., n, dim]
    return Packed(pack_bits(codes, fmt.bits), scale.transpose(-1, -2), zero.transpose(-1, -2))


def _dequantize_tokens(p: Packed, fmt: QuantFormat) -> torch.Tensor:
    codes = unpack_bits(p.codes, fmt.bits).float().unflatten(-2, (-1, fmt.group))  # [..., n/g, g, dim]
    out = codes * p.scale.float().unsqueeze(-2) + p.zero.float().unsqueeze(-2)
    return out.flatten(-3, -2)


def _quantize_int(x: torch.Tensor, fmt: QuantFormat, what: str, checked: bool) -> Packed:
    scale, zero = _int_scale_zero(x, fmt.bits, fmt.group, checked, fmt.clip)
    g = x.float().unflatten(-1, (-1, fmt.group))
    codes = ((g - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).round_().clamp_(0, 2**fmt.bits - 1)
    return Packed(pack_bits(codes.flatten(-2), fmt.bits), scale, zero)


def _dequantize_int(p: Packed, fmt: QuantFormat) -> torch.Tensor:
    codes = unpack_bits(p.codes, fmt.bits).float().unflatten(-1, (-1, fmt.group))
    out = codes * p.scale.float().unsqueeze(-1) + p.zero.float().unsqueeze(-1)
    return out.flatten(-2)


def _quantize_fp8(x: torch.Tensor, fmt: QuantFormat, what: str, checked: bool) -> Packed:
    if fmt.group == 0:
        return Packed(x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8))
    g = x.float().unflatten(-1, (-1, fmt.group))
    scale = (g.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)
    codes = (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Packed(codes.view(torch.uint8).flatten(-2), scale)


def _dequantize_fp8(p: Packed, fmt: QuantFormat) -> torch.Tensor:
    vals = p.codes.view(torch.float8_e4m3fn).float()
    if fmt.group == 0:
        return vals
    return (vals.unflatten(-1, (-1, fmt.group)) * p.scale.unsqueeze(-1)).flatten(-2)


@dataclass(frozen=True)
class Field:
    """One tensor of a `Packed`, as rows: `width` elements of `dtype` per row, a row per `tokens` tokens (1;
    a token-axis format's scale and zero: one row per block of fmt.group tokens)."""

    name: str  # "codes", "scale" or "zero": the Packed attribute
    dtype: torch.dtype
    width: int
    tokens: int = 1


def _int_fields(fmt: QuantFormat, dim: int) -> list[Field]:
    return [Field("codes", torch.uint8, dim * fmt.bits // 8), Field("scale", torch.float16, dim // fmt.group),
            Field("zero", torch.float16, dim // fmt.group)]


def _token_fields(fmt: QuantFormat, dim: int) -> list[Field]:
    return [Field("codes", torch.uint8, dim * fmt.bits // 8), Field("scale", torch.float16, dim, fmt.group),
            Field("zero", torch.float16, dim, fmt.group)]


def _fp8_fields(fmt: QuantFormat, dim: int) -> list[Field]:
    scale = [Field("scale", torch.float32, dim // fmt.group)] if fmt.group else []
    return [Field("codes", torch.uint8, dim), *scale]


def _fp4_fields(fmt: QuantFormat, dim: int) -> list[Field]:
    return [Field("codes", torch.uint8, dim // 2), Field("scale", torch.uint8, dim // fmt.group)]


def _codebook_fields(fmt: QuantFormat, dim: int) -> list[Field]:
    return [Field("codes", torch.uint8, dim * fmt.bits // 8),
            Field("scale", torch.float16, dim // fmt.group if fmt.group else 1)]


def _quantize_bf16(x: torch.Tensor, fmt: QuantFormat, what: str, checked: bool) -> Packed:
    return Packed(x)  # passthrough: the protected precision is whatever the model computes in


def _dequantize_bf16(p: Packed, fmt: QuantFormat) -> torch.Tensor:
    return p.codes


def _bf16_fields(fmt: QuantFormat, dim: int) -> list[Field]:
    return [Field("codes", torch.bfloat16, dim)]  # when serving; a CPU model may keep fp32 (`PagedMLACache`)


@dataclass(frozen=True)
class Codec:
    """The numerics of one format family. quantize(x [..., dim] finite, fmt, what, checked) -> Packed;
    dequantize(Packed, fmt) -> float32 [..., dim] (bf16: the stored values as they are); fields(fmt, dim) ->
    the Packed's tensors in order (the byte layouts of the module docstring). dim: the stored channels."""

    quantize: Callable[[torch.Tensor, QuantFormat, str, bool], Packed]
    dequantize: Callable[[Packed, QuantFormat], torch.Tensor]
    fields: Callable[[QuantFormat, int], list[Field]]


CODECS = {  # by QuantFormat.family
    "bf16": Codec(_quantize_bf16, _dequantize_bf16, _bf16_fields),
    "int": Codec(_quantize_int, _dequantize_int, _int_fields),
    "fp8": Codec(_quantize_fp8, _dequantize_fp8, _fp8_fields),
    "fp4": Codec(_quantize_fp4, _dequantize_fp4, _fp4_fields),
    "codebook": Codec(_quantize_codebook, _dequantize_codebook, _codebook_fields),
}
TOKEN_AXIS = Codec(_quantize_tokens, _dequantize_tokens, _token_fields)  # integer kinds grouped along tokens


def codec(fmt: QuantFormat) -> Codec:
    return TOKEN_AXIS if fmt.axis == "token" else CODECS[fmt.family]


def fields(fmt: QuantFormat, dim: int) -> list[Field]:
    """The tensors `quantize` stores for a `dim`-channel path, in Packed order (a ranked format: its rank's)."""
    return codec(fmt).fields(fmt, fmt.stored(dim))


def quantize(x: torch.Tensor, fmt: QuantFormat, what: str = "tensor", checked: bool = True) -> Packed:
    """Quantize along the last dim (token-axis formats: along dim -2, in blocks of fmt.group tokens).
    Raises ValueError on NaN/Inf, on values beyond the range of the scales, or on a group that does not
    divide the dim. checked=False skips the value checks, which read the data on the host (a device sync):
    for a CUDA graph's decode step, where the caller vouches for its input; NaN then yields garbage codes.
    bf16 is a passthrough and checks nothing."""
    fmt.check_dim(x.shape[-1], what)
    if fmt.rank:
        x = x[..., : fmt.rank]
    if checked and fmt.kind != "bf16":
        check_finite(x, what)
    return codec(fmt).quantize(x, fmt, what, checked)


def dequantize(p: Packed, fmt: QuantFormat, dtype: torch.dtype = torch.float32, dim: int | None = None
               ) -> torch.Tensor:
    """Inverse of quantize (up to rounding), returned in `dtype`. dim: the path's channels, needed for a ranked
    format (its unstored channels [rank, dim) come back as zeros)."""
    x = codec(fmt).dequantize(p, fmt).to(dtype)
    if not fmt.rank:
        return x
    if dim is None:
        raise ValueError(f"dequantizing the ranked format {fmt} needs the path's width (dim=)")
    return torch.nn.functional.pad(x, (0, dim - x.shape[-1]))


def fake_quantize(x: torch.Tensor, fmt: QuantFormat, what: str = "tensor") -> torch.Tensor:
    """quantize then dequantize, in x's dtype: what the model sees after a trip through the cache."""
    return dequantize(quantize(x, fmt, what), fmt, x.dtype, x.shape[-1])


def bytes_per_token(fmt: QuantFormat, dim: int) -> int | float:
    """Exact bytes one token of a `dim`-channel path occupies in this format, scales included.
    Token-axis formats: the average over a block of fmt.group tokens (a float when it is not whole)."""
    fmt.check_dim(dim)
    per_token = fields(fmt, dim)
    whole = sum(f.width * f.dtype.itemsize for f in per_token if f.tokens == 1)
    shared = sum(Fraction(f.width * f.dtype.itemsize, f.tokens) for f in per_token if f.tokens > 1)
    return whole + (int(shared) if shared.denominator == 1 else float(shared))


def fake_quantize_ste(x: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Differentiable stand-in for fake_quantize, for calibration: rounding passes gradients straight through,
    while the group scale and zero (from the group min/max) stay differentiable (integer formats, channel or
    token groups; the other kinds pass gradients straight through, quantization error included, which is
    why calibration refuses them). Forward values are exactly fake_quantize's. Calibration must still judge
    its objective with
    the real fake_quantize: the straight-through gradient does not see how the step size drives rounding error.
    """
    if fmt.kind == "bf16":
        return x
    if fmt.rank:  # unstored channels read back as 0: no gradient reaches them through the cache
        return torch.nn.functional.pad(fake_quantize_ste(x[..., : fmt.rank], replace(fmt, rank=0)),
                                       (0, x.shape[-1] - fmt.rank))
    if fmt.axis == "token":  # the same quantizer along tokens: x [..., n, dim], n whole blocks
        return fake_quantize_ste(x.transpose(-1, -2), QuantFormat(fmt.kind, fmt.group, clip=fmt.clip)
                                 ).transpose(-1, -2)
    if fmt.family != "int":
        return x + (fake_quantize(x.detach(), fmt) - x).detach()  # plain straight-through
    qmax = 2**fmt.bits - 1
    g = x.unflatten(-1, (-1, fmt.group))
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    lo, hi = lo + (hi - lo) * ((1 - fmt.clip) / 2), hi - (hi - lo) * ((1 - fmt.clip) / 2)
    scale = (hi - lo).clamp_min(1e-8) / qmax
    q = (g - lo) / scale
    q = q + (q.round().clamp(0, qmax) - q).detach()
    ste = (q * scale + lo).flatten(-2)
    return ste + (fake_quantize(x.detach(), fmt) - ste).detach()
