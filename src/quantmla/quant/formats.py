"""The one numeric source of truth for cache formats: quantize, dequantize, pack, and count bytes.

Byte layout per token (last dim), for a path of `dim` channels and group size `g`:
  bf16   codes: the values themselves, in the dtype they came in (bf16 when serving; fp32 in exactness
         tests)                                                      -> 2*dim bytes in bf16
  int8   codes: uint8 [dim]; scale, zero: fp16 [dim/g]              -> dim + 4*dim/g bytes
  int4   codes: uint8 [dim/2], channel 2i in the low nibble, 2i+1 in the high nibble; scale, zero fp16 [dim/g]
  int2   codes: uint8 [dim/4], channel 4i+k in bits 2k..2k+1; scale, zero fp16 [dim/g]
  fp8    codes: e4m3 bit patterns as uint8 [dim]; scale fp32 [dim/g] (g=0: fixed scale 1.0, no bytes)
Integer formats are asymmetric: x ~= code * scale + zero, code in [0, 2^bits - 1], zero = group minimum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantmla.config import QuantFormat

FP8_MAX = 448.0  # largest finite float8_e4m3fn


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
    """Pack integer codes in [0, 2^bits) along the last dim, 8/bits per byte, low bits first."""
    if bits == 8:
        return codes.to(torch.uint8)
    per = 8 // bits
    c = codes.to(torch.uint8).unflatten(-1, (-1, per))
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (c << shifts).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_bits: uint8 [..., n] -> uint8 codes [..., n * 8/bits]."""
    if bits == 8:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    return ((packed.unsqueeze(-1) >> shifts) & mask).flatten(-2)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    return pack_bits(codes, 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    return unpack_bits(packed, 4)


def _int_scale_zero(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = x.float().unflatten(-1, (-1, group))
    lo, hi = g.amin(-1), g.amax(-1)
    # Round the fp16 scale up so the group maximum still maps inside the code range after storage.
    scale = ((hi - lo) / (2**bits - 1) * (1 + 2**-10)).clamp_min(2**-24)
    if (scale > 6e4).any() or (lo.abs() > 6e4).any():
        raise ValueError("cannot quantize: values exceed the fp16 range of the scales (|x| > 6e4)")
    # Below 2^-14 fp16 is subnormal and may round down by far more than the 2^-10 margin; step such scales
    # up to the next fp16 value so the group maximum still fits (tiny ranges would otherwise clip).
    s16 = scale.half()
    s16 = torch.where(s16.float() < scale, torch.nextafter(s16, torch.full_like(s16, torch.inf)), s16)
    return s16, lo.half()


def quantize(x: torch.Tensor, fmt: QuantFormat, what: str = "tensor") -> Packed:
    """Quantize along the last dim. Raises ValueError on NaN/Inf or a group that does not divide the dim."""
    fmt.check_dim(x.shape[-1], what)
    if fmt.kind == "bf16":
        return Packed(x)  # passthrough: the protected precision is whatever the model computes in
    check_finite(x, what)
    if fmt.kind == "fp8":
        if fmt.group == 0:
            return Packed(x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8))
        g = x.float().unflatten(-1, (-1, fmt.group))
        scale = (g.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)
        codes = (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return Packed(codes.view(torch.uint8).flatten(-2), scale)
    bits = fmt.bits
    scale, zero = _int_scale_zero(x, bits, fmt.group)
    g = x.float().unflatten(-1, (-1, fmt.group))
    codes = ((g - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).round_().clamp_(0, 2**bits - 1)
    return Packed(pack_bits(codes.flatten(-2), bits), scale, zero)


def dequantize(p: Packed, fmt: QuantFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize (up to rounding), returned in `dtype`."""
    if fmt.kind == "bf16":
        return p.codes.to(dtype)
    if fmt.kind == "fp8":
        vals = p.codes.view(torch.float8_e4m3fn).float()
        if fmt.group == 0:
            return vals.to(dtype)
        return (vals.unflatten(-1, (-1, fmt.group)) * p.scale.unsqueeze(-1)).flatten(-2).to(dtype)
    codes = unpack_bits(p.codes, fmt.bits).float().unflatten(-1, (-1, fmt.group))
    out = codes * p.scale.float().unsqueeze(-1) + p.zero.float().unsqueeze(-1)
    return out.flatten(-2).to(dtype)


def fake_quantize(x: torch.Tensor, fmt: QuantFormat, what: str = "tensor") -> torch.Tensor:
    """quantize then dequantize, in x's dtype: what the model sees after a trip through the cache."""
    return dequantize(quantize(x, fmt, what), fmt, x.dtype)


def bytes_per_token(fmt: QuantFormat, dim: int) -> int:
    """Exact bytes one token of a `dim`-channel path occupies in this format, scales included."""
    fmt.check_dim(dim)
    if fmt.kind == "bf16":
        return 2 * dim
    if fmt.kind == "fp8":
        return dim + (4 * dim // fmt.group if fmt.group else 0)
    return dim * fmt.bits // 8 + 4 * (dim // fmt.group)


def fake_quantize_ste(x: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Differentiable stand-in for fake_quantize, for calibration: rounding passes gradients straight through,
    while the group scale and zero (from the group min/max) stay differentiable. Forward values are exactly
    fake_quantize's. Calibration must still judge its objective with
    the real fake_quantize: the straight-through gradient does not see how the step size drives rounding error.
    """
    if fmt.kind == "bf16":
        return x
    if fmt.kind == "fp8":
        return x + (fake_quantize(x.detach(), fmt) - x).detach()
    qmax = 2**fmt.bits - 1
    g = x.unflatten(-1, (-1, fmt.group))
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (hi - lo).clamp_min(1e-8) / qmax
    q = (g - lo) / scale
    q = q + (q.round().clamp(0, qmax) - q).detach()
    ste = (q * scale + lo).flatten(-2)
    return ste + (fake_quantize(x.detach(), fmt) - ste).detach()
