"""Property tests of the cache formats: packing, error bounds, exact byte counts, and clear errors.

The error bounds are derived from quantmla.quant.formats, not tuned to pass:
- integer formats store scale s and zero z in fp16; a value is coded as round((x - z) / s) clamped to
  [0, 2^b - 1]. Unclamped, the error is at most s/2. The scale is rounded up so the group maximum stays in
  range, so clamping only happens where the fp16 zero z rounded away from the group minimum lo, and there
  the error is at most |z - lo|. Hence |x - deq| <= s/2 + |z - lo| (+ fp32 arithmetic rounding).
- fp8 (e4m3, 3 mantissa bits) codes x / scale with an fp32 scale: relative error 2^-4 for normal codes and an
  absolute 2^-10 (half the 2^-9 subnormal spacing) in code units below 2^-6, i.e. |x| / 16 + scale / 1024.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantmla.config import KINDS, QuantFormat
from quantmla.quant.formats import (
    FP8_MAX,
    Packed,
    bytes_per_token,
    dequantize,
    fake_quantize,
    fake_quantize_ste,
    pack_bits,
    quantize,
    unpack_bits,
)

FAST = settings(max_examples=40, deadline=None)
INT_KINDS = ("int8", "int4", "int2")

leading_shapes = st.lists(st.integers(1, 3), min_size=0, max_size=3).map(tuple)
groups = st.sampled_from([8, 16, 32, 64])


def _tensor(seed: int, shape: tuple[int, ...], log10_scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Heavy-ish tails and an offset, so groups are neither centred nor uniformly spread.
    x = torch.randn(shape, generator=g) ** 3 + 0.5 * torch.randn(shape[:-1] + (1,), generator=g)
    # |x| <= 30 keeps the largest scale (1e3) inside the fp16 range quantize refuses to leave (|x| <= 6e4).
    return x.clamp(-30, 30) * 10.0**log10_scale


# --- packing -------------------------------------------------------------------------------------------


@FAST
@given(bits=st.sampled_from([8, 4, 2]), lead=leading_shapes, n_bytes=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip(bits, lead, n_bytes, seed):
    n = n_bytes * 8 // bits
    codes = torch.randint(0, 2**bits, lead + (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == lead + (n_bytes,)
    assert torch.equal(unpack_bits(packed, bits), codes)


def test_pack_layout_is_low_bits_first():
    # int4: channel 2i in the low nibble; int2: channel 4i+k in bits 2k..2k+1 (the documented byte layout).
    assert pack_bits(torch.tensor([0x1, 0x2]), 4).tolist() == [0x21]
    assert pack_bits(torch.tensor([1, 2, 3, 0]), 2).tolist() == [0b00_11_10_01]


# --- error bounds --------------------------------------------------------------------------------------


@FAST
@given(kind=st.sampled_from(INT_KINDS), group=groups, lead=leading_shapes, n_groups=st.integers(1, 4),
       log10_scale=st.floats(-6, 3), seed=st.integers(0, 2**16))
def test_integer_error_is_half_a_step(kind, group, lead, n_groups, log10_scale, seed):
    fmt = QuantFormat(kind, group)
    x = _tensor(seed, lead + (group * n_groups,), log10_scale)
    p = quantize(x, fmt)
    deq = dequantize(p, fmt)
    assert deq.shape == x.shape and deq.dtype == torch.float32

    g = x.unflatten(-1, (-1, group))
    s, z = p.scale.float(), p.zero.float()
    lo = g.amin(-1)
    # fp32 rounding of (x - z) / s and of code * s + z: a few ulps of the group's magnitude.
    arith = 2**-20 * g.abs().amax(-1)
    bound = s / 2 + (z - lo).abs() + arith
    err = (g - deq.unflatten(-1, (-1, group))).abs().amax(-1)
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"
    # The zero's fp16 rounding must be a small slack, not the dominant term that hides a bad scale.
    assert ((z - lo).abs() <= 2**-11 * lo.abs() + 2**-25).all()
    # The scale covers the group's range over the code count (so the top code never clips) and is at most one
    # fp16 step above it (relative 2^-10 when normal, 2^-24 absolute when subnormal): not something looser.
    step = (g.amax(-1) - lo) / (2**fmt.bits - 1)
    assert (s >= step).all()
    assert (s <= (step * (1 + 2**-10)).clamp_min(2**-24) * (1 + 2**-10) + 2**-24).all()


@FAST
@given(group=st.sampled_from([0, 16, 32, 128]), lead=leading_shapes, log10_scale=st.floats(-3, 2),
       seed=st.integers(0, 2**16))
def test_fp8_relative_error(group, lead, log10_scale, seed):
    fmt = QuantFormat("fp8", group)
    x = _tensor(seed, lead + (128,), log10_scale)
    if group == 0:
        x = x.clamp(-FP8_MAX, FP8_MAX)  # a fixed scale of 1 clips beyond the e4m3 range by design
    p = quantize(x, fmt)
    deq = dequantize(p, fmt)
    scale = p.scale.float().repeat_interleave(group, -1) if group else torch.ones_like(x)
    bound = x.abs() / 16 + scale / 1024 + 2**-22 * x.abs()
    assert ((x - deq).abs() <= bound).all()


def test_fewer_bits_give_larger_errors():
    x = torch.randn(64, 512)
    err = {k: (fake_quantize(x, QuantFormat(k, 64)) - x).pow(2).mean().item() for k in ("int2", "int4", "int8")}
    assert err["int2"] > 10 * err["int4"] > 100 * err["int8"] > 0
    # A 4-bit step is (range / 15); for N(0, 1) groups of 64 the range is ~4.7, so MSE ~ step^2 / 12 ~ 8e-3.
    assert 3e-3 < err["int4"] < 2e-2
    fp8 = (fake_quantize(x, QuantFormat("fp8")) - x).pow(2).mean().item()
    assert 0 < fp8 < err["int4"]


def test_bf16_is_a_passthrough():
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    p = quantize(x, QuantFormat("bf16"))
    assert p.codes is x and p.scale is None and torch.equal(dequantize(p, QuantFormat("bf16"), x.dtype), x)


# --- byte accounting -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dim", [64, 128, 512, 576])
@pytest.mark.parametrize("group", [-1, 16, 32, 64])
def test_bytes_per_token_is_what_is_stored(kind, dim, group):
    fmt = QuantFormat(kind, group)
    x = torch.randn(2, 1, 5, dim, dtype=torch.bfloat16)  # bf16 passthrough stores the input dtype
    if fmt.group and dim % fmt.group:  # e.g. fp8's default 128 over 576 channels: refused, not stored
        with pytest.raises(ValueError, match="does not divide"):
            quantize(x, fmt)
        return
    p = quantize(x, fmt)
    assert p.nbytes == bytes_per_token(fmt, dim) * 2 * 5


def test_reference_byte_counts():
    # A BF16 row of 512 + 64 channels is 1152 B; FlashMLA's FP8 latent is 512 + 4 * 4 B of scales.
    assert bytes_per_token(QuantFormat("bf16"), 512) + bytes_per_token(QuantFormat("bf16"), 64) == 1152
    assert bytes_per_token(QuantFormat("fp8"), 512) == 528
    assert bytes_per_token(QuantFormat("int4"), 512) == 256 + 8 * 4
    assert bytes_per_token(QuantFormat("int2", 32), 64) == 16 + 2 * 4
    assert bytes_per_token(QuantFormat("fp8", 0), 64) == 64


# --- errors --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fp8", "int8", "int4", "int2"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises(kind, bad):
    x = torch.randn(4, 64)
    x[2, 5] = bad
    with pytest.raises(ValueError, match="non-finite.*NaN or Inf"):
        quantize(x, QuantFormat(kind, 32), "content")


@pytest.mark.parametrize("kind", ["int8", "int4", "int2"])
def test_out_of_fp16_range_raises(kind):
    with pytest.raises(ValueError, match="fp16 range"):
        quantize(torch.full((1, 64), 7e4), QuantFormat(kind, 32))


@pytest.mark.parametrize("spec", ["fp8:32", "int8:32", "int4:32", "int2:32", "fp4", "lm3", "int4:t16"])
def test_unchecked_quantize_is_the_same_minus_the_checks(spec):
    """checked=False (the CUDA-graph writer) gives the same bytes on good input and lets bad input through."""
    fmt = QuantFormat.parse(spec)
    x = torch.randn(32, 64) * 3
    for a, b in zip(quantize(x, fmt).tensors(), quantize(x, fmt, checked=False).tensors()):
        assert torch.equal(a, b)
    x[3, 7] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, fmt)
    quantize(x, fmt, checked=False)


@pytest.mark.parametrize("kind", ["fp8", "int8", "int4", "int2"])
def test_group_must_divide_dim(kind):
    with pytest.raises(ValueError, match="group 32 does not divide its 48 channels"):
        quantize(torch.randn(2, 48), QuantFormat(kind, 32), "rope")
    with pytest.raises(ValueError, match="does not divide"):
        bytes_per_token(QuantFormat(kind, 32), 48)


def test_odd_widths_cannot_be_packed():
    with pytest.raises(ValueError, match="cannot be packed"):
        QuantFormat("int2", 6).check_dim(6)


def test_ranked_formats_must_pack_their_stored_channels():
    """A ranked format packs only its leading `rank` channels: int4:25r75 on 200 channels (an even path)
    stores 75, which no whole number of bytes holds; refused up front, not a crash in the packer."""
    with pytest.raises(ValueError, match="75 channels cannot be packed 2 per byte"):
        QuantFormat.parse("int4:25r75").check_dim(200)
    QuantFormat.parse("int4:25r100").check_dim(200)
    QuantFormat.parse("int8:25r75").check_dim(200)


@pytest.mark.parametrize("spec", ["int3", "fp6", "bf8", "", "int4:x", "int4:-2", "int4:0", "fp4:0",
                                  "lm3:t32", "int4:tx", "int4:t0", "bf16:8"])
def test_bad_format_names_raise(spec):
    with pytest.raises(ValueError):
        QuantFormat.parse(spec)


@FAST
@given(kind=st.sampled_from(list(KINDS)), group=st.sampled_from([-1, 0, 8, 32, 64, 128]))
def test_parse_round_trips_str(kind, group):
    if (kind.startswith("int") or kind == "fp4") and group == 0:
        return  # rejected, covered above
    fmt = QuantFormat(kind, group)
    assert QuantFormat.parse(str(fmt)) == fmt
    assert QuantFormat.parse(str(fmt).upper()) == fmt
    assert str(fmt) == kind or str(fmt) == f"{kind}:{fmt.group}"
    assert fmt.group == (KINDS[kind].default_group if group == -1 else 0 if kind == "bf16" else group)


# --- ranked formats ------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec,rank", [("int8r128", 128), ("int4:32r96", 96), ("int2r64c0.8", 64)])
def test_ranked_format_stores_its_leading_channels_and_zeros_the_rest(spec, rank):
    """A ranked format stores channels [0, rank) byte for byte as the unranked format stores a rank-channel
    path, reads the others back as 0, and counts only the stored bytes."""
    fmt = QuantFormat.parse(spec)
    assert fmt.rank == rank and QuantFormat.parse(str(fmt)) == fmt
    x = _tensor(3, (2, 5, 512), 0.0)
    full = replace(fmt, rank=0)
    p, lead = quantize(x, fmt), quantize(x[..., :rank].contiguous(), full)
    assert all(torch.equal(a, b) for a, b in zip(p.tensors(), lead.tensors()))
    out = dequantize(p, fmt, dim=512)
    assert out.shape == x.shape and torch.equal(out[..., rank:], torch.zeros_like(out[..., rank:]))
    assert torch.equal(out[..., :rank], dequantize(lead, full))
    assert torch.equal(fake_quantize(x, fmt), out)
    assert bytes_per_token(fmt, 512) == bytes_per_token(full, rank) == p.nbytes // 10
    with pytest.raises(ValueError, match="dim="):
        dequantize(p, fmt)


def test_ranked_straight_through_passes_no_gradient_to_dropped_channels():
    fmt = QuantFormat.parse("int4:16r32")
    x = _tensor(5, (4, 64), 0.0).requires_grad_(True)
    y = fake_quantize_ste(x, fmt)
    assert torch.equal(y.detach(), fake_quantize(x.detach(), fmt))
    y.sum().backward()
    assert torch.equal(x.grad[:, 32:], torch.zeros(4, 32)) and (x.grad[:, :32] != 0).any()


@pytest.mark.parametrize("spec,match", [("int8r100", "^int8r100: .*multiple.* e.g. int8:4r100$"),
                                        ("int8r32", "e.g. int8:32r32"), ("fp8r128", "only channel"),
                                        ("int4:t64r64", "only channel"), ("int4r", "rank after"),
                                        ("int4r0", "positive rank"),
                                        ("bf16r64", "only channel")])
def test_bad_ranks_raise(spec, match):
    with pytest.raises(ValueError, match=match):
        QuantFormat.parse(spec)


def test_rank_wider_than_the_path_raises():
    with pytest.raises(ValueError, match="exceeds"):
        quantize(torch.zeros(2, 64), QuantFormat.parse("int8r128"))


@pytest.mark.parametrize("spec, dim, fitted", [("int4", 96, "int4:32"), ("int4:64", 96, "int4:32"),
                                               ("fp8", 320, "fp8:64"), ("int2", 48, "int2:48"),
                                               ("int4", 512, "int4"), ("fp4", 24, "fp4"), ("int4", 100, "int4"),
                                               ("int4:40", 96, "int4:40"), ("int4:t64", 96, "int4:t64")])
def test_fit_gives_a_default_group_the_path_can_take(spec, dim, fitted):
    """Only the kind's default group adapts (to a power of two >= 8 dividing the path); a group the user
    spelled otherwise, NVFP4's 16 and token-axis blocks stay, and check_dim says what would fit."""
    assert str(QuantFormat.parse(spec).fit(dim)) == fitted
    if dim % max(QuantFormat.parse(fitted).group, 1) and QuantFormat.parse(fitted).axis == "channel":
        with pytest.raises(ValueError, match="give a group that does, e.g."):
            QuantFormat.parse(fitted).check_dim(dim)

