"""Cache formats: quantize / dequantize / pack, and exact byte accounting."""

from quantmla.quant.formats import (
    Packed,
    bytes_per_token,
    check_finite,
    dequantize,
    fake_quantize,
    pack_bits,
    pack_int4,
    quantize,
    unpack_bits,
    unpack_int4,
)

__all__ = [
    "Packed",
    "bytes_per_token",
    "check_finite",
    "dequantize",
    "fake_quantize",
    "pack_bits",
    "pack_int4",
    "quantize",
    "unpack_bits",
    "unpack_int4",
]
