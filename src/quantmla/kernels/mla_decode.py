"""Absorbed-MLA decode straight from the paged, packed cache: one Triton kernel, its launcher, and the
plain-torch reference beside them.

Math (per sequence b, head h, over the L cached tokens u; see `quantmla.mla`):
    s[h, u] = sm_scale * (q~[h] . c[u] + q_pe[h] . k_pe[u])
    out[h]  = sum_u softmax(s[h])_u c[u]                 (latent space, kv_lora_rank dims)
    lse[h]  = logsumexp_u s[h, u]                        (natural log; -inf for an empty sequence)
The cache is a `PagedMLACache` (quantmla.cache.paged): quantized body tokens in pools (int8/int4/int2 with
fp16 scale + zero per group of channels, or per channel and block of g tokens for token-axis (KIVI-style)
formats; fp8 e4m3 with fp32 scale per group; or bf16), protected sink + ring tokens in BF16 rows. Both kinds
of token go through the same online softmax. kv_lora_rank, rope dims and group sizes are compile-time
constants (powers of two): 512/64 and MiniCPM3's 256/32 are the same code.

Entry point: `mla_decode(q_nope_absorbed, q_pe, cache, block_tables, seq_lens, slots, sm_scale,
max_seq_len=..., out_dtype=...)` -> (out [B, H, dc], lse [B, H]); `decode` is the same function.

Kernel design (flash-decoding):
  - one program = (head block, split, sequence). A head block holds BLOCK_H heads (all of them for
    H <= 16), so each cache tile is read and dequantized once for all those heads, and both products
    (scores and values) are tensor-core `tl.dot`s on bf16 operands with fp32 accumulation;
  - a sequence's work is counted in BLOCK_N-token tiles (body tiles are page-aligned: one block-table
    entry per tile, consecutive pool rows, so addresses are a scalar base plus fixed offsets), then the
    protected rows; the tiles are cut into `num_splits` equal runs. Each program writes its normalized
    partial output and log-sum-exp, `_combine_kernel` merges them (skipped when num_splits == 1);
  - which positions each path holds quantized is `quantmla.policy`'s rule (positions [sink, q) with
    q = quantized_end(L), per path: a token-axis path quantizes whole blocks of g tokens, so its q trails a
    channel path's by up to g - 1). Body tiles cover [sink, min(q_c, q_r)); the protected tiles cover the
    sink positions and [min(q_c, q_r), L) in position order, each path read from its ring (recent + g - 1
    rows for a token-axis path, `PagedMLACache.rings`) where the position is past its own q and, when the
    two paths' blocks differ, from its pool where not;
  - token-axis scales: a body tile's rows [BLOCK_N] each read their block's scale row (the block's first
    position's pool row // g, in the page where the block starts: `PagedMLACache.scale_rows`), [BLOCK_N]
    x [dim] broadcast over the codes; a tile of BLOCK_N > g tokens spans several blocks;
  - a ranked content format (channels [0, rank) stored, the rest read as 0) with a power-of-two rank has
    body tiles only rank channels wide: the scores and values of the body multiply over the stored channels
    alone, into an accumulator of rank channels that is widened into the full one after the protected rows
    (`_widen`); other ranks compute all channels with the unstored groups masked to 0;
  - dequantization happens on the tile in registers. On the GPU, integer codes go through inline PTX
    (`_int_dequant_ptx`): bit tricks put each code into a bf16 mantissa and bf16x2 fmas apply scale and
    zero, 2 instructions per value and no int->float conversions (token-axis: one call per code of a byte,
    each with its channels' scales, `_split_codes`). Elsewhere (the CPU interpreter) the same math is
    plain Triton. Nibbles are unpacked with `tl.join` + `tl.reshape`, which keeps both
    nibbles of a byte in one thread: no shuffles; the scale/zero broadcast happens in a [BLOCK_N, groups,
    bytes-per-group] view of the tile;
  - every shape is fixed by the launcher's arguments (batch, heads, max_seq_len), lengths are read on the
    device: no host syncs, no data-dependent allocations, safe to capture in a CUDA graph.
Which kernel runs for a cache, head count and batch is `decode_kernel_name`'s choice: on a GPU the int4/int2
and fp8 caches mostly go to the CUDA kernel of `mla_decode_cuda` (few heads), which dequantizes into tensor-core
register fragments instead of through a shared-memory tile (this kernel's limit), or on Hopper above 32 heads to
the many-heads kernel of `mla_decode_many_heads` (Q held in shared memory, 64 heads per CTA). Measurements and
profiles: docs/design.md, "Decode kernels", and benchmarks/results/decode_kernel*.md.
"""

from __future__ import annotations

import importlib
import math
import os
from dataclasses import dataclass

import torch

try:  # the reference works without triton; the kernel needs it
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

from quantmla.cache.paged import PagedMLACache, PagedPath
from quantmla.kernels.mla_decode_cuda import decode_kernel_name
from quantmla.mla import latent_attention

LOG2E = 1.4426950408889634
COMBINE_CHUNK = 8  # splits `_combine_kernel` reads at once
KIND_CODE = {"bf16": 0, "fp8": 1, "int8": 2, "int4": 2, "int2": 2}


# ---------------------------------------------------------------------------------------------------------
# Reference (plain torch, fp64 by default): the oracle for the kernel.
# ---------------------------------------------------------------------------------------------------------


def mla_decode_reference(
    q_nope_absorbed: torch.Tensor,
    q_pe: torch.Tensor,
    cache: PagedMLACache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor | None = None,
    sm_scale: float = 1.0,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode on the dequantized cache (via `PagedMLACache.gather`, i.e. `quantmla.quant.dequantize`).

    q_nope_absorbed [B, H, dc], q_pe [B, H, dr]; returns out [B, H, dc] and lse [B, H] in `dtype`.
    An empty sequence gives out = 0 and lse = -inf.
    """
    B, H, dc = q_nope_absorbed.shape
    slots = torch.arange(B) if slots is None else slots
    out = torch.zeros(B, H, dc, dtype=dtype, device=q_nope_absorbed.device)
    lse = torch.full((B, H), -math.inf, dtype=dtype, device=q_nope_absorbed.device)
    for b in range(B):
        L = int(seq_lens[b])
        if L == 0:
            continue
        c, k_pe = cache.gather(int(slots[b]), block_tables[b], L, dtype)
        o, l = latent_attention(q_nope_absorbed[b][None, :, None], q_pe[b][None, :, None], c[None], k_pe[None],
                                sm_scale, causal=False, dtype=dtype)
        out[b], lse[b] = o[0, :, 0], l[0, :, 0]
    return out, lse


# ---------------------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape.

    block_h: heads per program (a power of two >= 16: tl.dot needs 16 rows); block_n: tokens per tile
    (clipped to divide the page); num_warps, num_stages: Triton's; scores_t / values_t: compute the
    scores as c q^T / the values as c^T p^T (tokens or channels as the M dimension of the tensor-core
    tile) instead of q c^T / p c; asm: dequantize integer codes with inline PTX (GPU only);
    ctas_per_sm: programs the split count aims to keep resident per SM; min_split: fewest tokens a split
    is given (`num_splits_for`; each split costs a partial output write and read of block_h * dc * 4
    bytes); maxnreg: a register cap per thread (more programs per SM, at the price of spills), None for the
    compiler's choice.
    """

    block_h: int = 16
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    scores_t: bool = False
    values_t: bool = False
    asm: bool = True
    ctas_per_sm: int = 2
    min_split: int = 64
    maxnreg: int | None = None


def default_config(cache: PagedMLACache, num_heads: int) -> KernelConfig:
    """Launch defaults: the fastest candidates of benchmarks/decode_kernel.py on an H200 at B=16, 64K
    (benchmarks/results/decode_kernel.md). A token-axis content path, or a token-axis RoPE path at many
    heads, gets no software pipelining (num_stages 1): pipelined, its scale and zero rows per token need
    258-313 KB of shared memory, more than an H100/H200 block has (measured on the H200,
    decode_kernel_formats.md; the same figures from `kernels.offline`, which puts these launches at 92-147 KB
    with one stage). They launch and are right on the H200 (tests/test_mla_decode.py), but slowly: token-axis
    content 0.13-0.33x the bf16 kernel, a token-axis RoPE path 0.55-0.59x (decode_kernel_token_axis.md)."""
    content_t, rope_t = cache.content.block > 1, cache.rope.block > 1
    if num_heads <= 16:
        if cache.content.fmt.kind == "fp8":
            return KernelConfig(block_h=16, block_n=32, num_warps=4, num_stages=3, ctas_per_sm=2)
        return KernelConfig(block_h=16, block_n=64, num_warps=4, num_stages=1 if content_t else 2, ctas_per_sm=2)
    return KernelConfig(block_h=64, block_n=64, num_warps=8, num_stages=1 if content_t or rope_t else 2,
                        ctas_per_sm=1)


def _int_dequant_ptx(bits: int, code: int | None = None) -> str:
    """PTX for tl.inline_asm_elementwise (pack=4): 4 code bytes -> 8/bits bf16 tensors of 4 values each
    (with `code` = k: only the tensor of code k of each byte, its own scale and zero operands: token-axis
    scales differ per channel, so per code of a byte).

    Operands: outputs $0.. (per output tensor k, two b32 registers: elements (0,1) and (2,3)), then the code
    word (byte e = element e), then bf16x2 pairs of the scale's high part, its low part (scale - high) and
    the centred zero. `prmt` reorders the bytes to (b0, b2, b1, b3), so one shift + `lop3` puts code k of
    (b0, b1) or of (b2, b3) into the low mantissa bits of bf16 128.0 (0x4300): 128 + code, exact. Then
    (128 + code) * 1 - (128 + mid) = code - mid (exact), and two bf16x2 fmas apply the scale (high, then
    low part: the fp16 scale survives to ~2^-16) and the centred zero z + mid * scale. Centring
    (mid = 2^(bits-1)) keeps the bf16 rounding of the zero small: the group minimum is a large number, the
    group centre a small one. 2 codes per 4 instructions, no int->float conversions.
    """
    codes = range(8 // bits) if code is None else [code]
    n_out = len(codes)
    mask = (1 << bits) - 1
    mid = 1 << (bits - 1)
    neg = 0xC300 | mid  # bf16 of -(128 + mid): its ulp is 1, so mid lands in the low mantissa bits
    w, sh0, sh1, sl0, sl1, z0, z1 = (f"${2 * n_out + i}" for i in range(7))
    lines = [
        "{",
        ".reg .b32 y, t, u, one, m128;",
        "mov.b32 one, 0x3F803F80;",
        f"mov.b32 m128, 0x{neg:04X}{neg:04X};",
        f"prmt.b32 y, {w}, 0, 0x3120;",
    ]
    for o, k in enumerate(codes):
        for half, (sh, sl, z) in enumerate(((sh0, sl0, z0), (sh1, sl1, z1))):
            shift = 8 * half + bits * k  # code k of byte pair (b0,b1) at bit 0, of (b2,b3) at bit 8
            src = "y"
            if shift:
                lines.append(f"shr.u32 t, y, {shift};")
                src = "t"
            lines.append(f"lop3.b32 t, {src}, 0x{mask:04X}{mask:04X}, 0x43004300, 0xEA;")  # (x & m) | magic
            lines.append("fma.rn.bf16x2 t, t, one, m128;")
            lines.append(f"fma.rn.bf16x2 u, t, {sh}, {z};")
            lines.append(f"fma.rn.bf16x2 ${2 * o + half}, t, {sl}, u;")
    lines.append("}")
    return "\n".join(lines)


if triton is not None:
    _PTX_INT4 = tl.constexpr(_int_dequant_ptx(4))
    _PTX_INT2 = tl.constexpr(_int_dequant_ptx(2))
    _CONSTRAINTS_INT4 = tl.constexpr("=r," * 4 + "r,r,r,r,r,r,r")
    _CONSTRAINTS_INT2 = tl.constexpr("=r," * 8 + "r,r,r,r,r,r,r")
    # Token-axis: one call per code of a byte, each with that code's channels' scale and zero.
    _PTX_INT4_0, _PTX_INT4_1 = (tl.constexpr(_int_dequant_ptx(4, k)) for k in range(2))
    _PTX_INT2_0, _PTX_INT2_1, _PTX_INT2_2, _PTX_INT2_3 = (tl.constexpr(_int_dequant_ptx(2, k)) for k in range(4))
    _CONSTRAINTS_ONE = tl.constexpr("=r," * 2 + "r,r,r,r,r,r,r")

    @triton.jit
    def _opaque(v):
        """An identity the compiler cannot see through: without it the dequantization is recomputed once
        per consumer layout (the two products want the tile in different register layouts)."""
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=tl.bfloat16, is_pure=False, pack=2)

    @triton.jit
    def _split_codes(x, BITS: tl.constexpr, BLOCK_N: tl.constexpr, GB: tl.constexpr):
        """x [BLOCK_N, DIM] per channel -> one [BLOCK_N, 1, GB] tensor per code of a byte (channel
        (8 / BITS) * i + k of byte i for code k), in code order, as the token-axis PTX calls take them."""
        if BITS == 4:
            return tl.split(tl.reshape(x, [BLOCK_N, 1, GB, 2]))
        else:
            even, odd = tl.split(tl.reshape(x, [BLOCK_N, 1, GB, 2, 2]))  # code 2a + b: split b, then a
            c0, c2 = tl.split(even)
            c1, c3 = tl.split(odd)
            return c0, c1, c2, c3

    @triton.jit
    def _scale_rows(bt_row, pos, rows, valid, SINK: tl.constexpr, PAGE: tl.constexpr, BLK: tl.constexpr):
        """Flat scale/zero rows of positions pos [BLOCK_N] (pool rows `rows`): the rows themselves for channel
        formats (BLK = 1); for a token-axis path (block BLK) the pool row of the block's first position // BLK
        (`PagedMLACache.scale_rows`; a block that began in the previous page keeps its scales there)."""
        if BLK == 1:
            return rows
        else:
            s = SINK + (tl.maximum(pos, SINK) - SINK) // BLK * BLK
            page = tl.load(bt_row + s // PAGE, mask=valid, other=0).to(tl.int64)
            return (page * PAGE + s % PAGE) // BLK

    @triton.jit
    def _load_tile(
        codes_ptr,
        scale_ptr,
        zero_ptr,
        rows,
        sz_rows,
        valid,
        DIM: tl.constexpr,
        KIND: tl.constexpr,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        TOKEN: tl.constexpr,
        SCALED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ASM: tl.constexpr,
        ROW: tl.constexpr,
        SZ_ROW: tl.constexpr,
        NGS: tl.constexpr,
    ):
        """Pool rows `rows` [BLOCK_N] (int64) -> bf16 [BLOCK_N, DIM]; invalid rows read as 0. NGS: the groups
        the pool stores (DIM // GROUP, fewer for a ranked format: the other channels read as 0, unloaded). Scale/zero come from
        rows `sz_rows` [BLOCK_N] of their pools: one per group of GROUP channels, or with TOKEN (a token-axis
        path; GROUP = DIM) one per channel. ROW / SZ_ROW: elements from one row to the next in the codes /
        scale and zero pools (their widths for contiguous pools; more where the pools are fields of one
        packed row, as in vLLM's cache tensor). Rows computed as row0 + arange keep the addresses a scalar
        base plus loop-invariant offsets. ASM: integer codes are dequantized by `_int_dequant_ptx` (GPU only;
        the interpreter runs the plain-Triton path)."""
        if KIND == 0:  # bf16 values, used as they are
            d = tl.arange(0, DIM)
            x = tl.load(codes_ptr + rows[:, None] * ROW + d[None, :], mask=valid[:, None], other=0.0)
            return x.to(tl.bfloat16)
        else:
            # View the tile as [BLOCK_N, groups, bytes per group] so a group's scale broadcasts over its bytes.
            NG: tl.constexpr = DIM // GROUP
            GB: tl.constexpr = GROUP * BITS // 8
            g = tl.arange(0, NG)
            j = tl.arange(0, GB)
            ptr = codes_ptr + rows[:, None, None] * ROW + g[None, :, None] * GB + j[None, None, :]
            if NGS < NG:  # ranked: groups past the stored ones are neither read nor nonzero
                vg = valid[:, None] & (g < NGS)[None, :]
            else:
                vg = valid[:, None]
            w = tl.load(ptr, mask=vg[:, :, None], other=0)  # uint8 [BLOCK_N, NG, GB]
            if TOKEN:  # one scale and zero per channel: [BLOCK_N, DIM]
                sg = sz_rows[:, None] * SZ_ROW + tl.arange(0, DIM)[None, :]
            else:
                sg = sz_rows[:, None] * SZ_ROW + g[None, :]
            if KIND == 1:  # fp8: e4m3 bit patterns times an fp32 group scale
                v = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                if SCALED:
                    v = v * tl.load(scale_ptr + sg, mask=valid[:, None], other=0.0)[:, :, None]
                v = tl.reshape(v, [BLOCK_N, DIM]).to(tl.bfloat16)
            else:  # asymmetric integers: x = code * scale + zero
                sc = tl.load(scale_ptr + sg, mask=vg, other=0.0).to(tl.float32)
                zr = tl.load(zero_ptr + sg, mask=vg, other=0.0).to(tl.float32)
                if ASM and BITS < 8:  # the PTX takes code - mid, so its zero is the group centre z + mid * scale
                    zc = (zr + (1 << (BITS - 1)) * sc).to(tl.bfloat16)
                    s_hi = sc.to(tl.bfloat16)
                    s_lo = (sc - s_hi.to(tl.float32)).to(tl.bfloat16)
                    if TOKEN:  # per channel, so per code of a byte: one call per code, each its own operands
                        if BITS == 4:  # byte i holds channels 2i (low nibble) and 2i+1 (high nibble)
                            h0, h1 = _split_codes(s_hi, BITS, BLOCK_N, GB)
                            l0, l1 = _split_codes(s_lo, BITS, BLOCK_N, GB)
                            z0, z1 = _split_codes(zc, BITS, BLOCK_N, GB)
                            lo = tl.inline_asm_elementwise(_PTX_INT4_0, _CONSTRAINTS_ONE, [w, h0, l0, z0],
                                                           dtype=tl.bfloat16, is_pure=True, pack=4)
                            hi = tl.inline_asm_elementwise(_PTX_INT4_1, _CONSTRAINTS_ONE, [w, h1, l1, z1],
                                                           dtype=tl.bfloat16, is_pure=True, pack=4)
                            v = tl.join(lo, hi)
                        else:  # byte i holds channel 4i+k in bits 2k..2k+1
                            h0, h1, h2, h3 = _split_codes(s_hi, BITS, BLOCK_N, GB)
                            l0, l1, l2, l3 = _split_codes(s_lo, BITS, BLOCK_N, GB)
                            z0, z1, z2, z3 = _split_codes(zc, BITS, BLOCK_N, GB)
                            c0 = tl.inline_asm_elementwise(_PTX_INT2_0, _CONSTRAINTS_ONE, [w, h0, l0, z0],
                                                           dtype=tl.bfloat16, is_pure=True, pack=4)
                            c1 = tl.inline_asm_elementwise(_PTX_INT2_1, _CONSTRAINTS_ONE, [w, h1, l1, z1],
                                                           dtype=tl.bfloat16, is_pure=True, pack=4)
                            c2 = tl.inline_asm_elementwise(_PTX_INT2_2, _CONSTRAINTS_ONE, [w, h2, l2, z2],
                                                           dtype=tl.bfloat16, is_pure=True, pack=4)
                            c3 = tl.inline_asm_elementwise(_PTX_INT2_3, _CONSTRAINTS_ONE, [w, h3, l3, z3],
                                                           dtype=tl.bfloat16, is_pure=True, pack=4)
                            v = tl.join(tl.join(c0, c2), tl.join(c1, c3))
                    else:
                        zc = zc[:, :, None]
                        s_lo = s_lo[:, :, None]
                        s_hi = s_hi[:, :, None]
                        if BITS == 4:  # byte i holds channels 2i (low nibble) and 2i+1 (high nibble)
                            lo, hi = tl.inline_asm_elementwise(
                                _PTX_INT4, _CONSTRAINTS_INT4, [w, s_hi, s_lo, zc],
                                dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
                            )  # fmt: skip
                            v = tl.join(lo, hi)
                        else:  # byte i holds channel 4i+k in bits 2k..2k+1
                            c0, c1, c2, c3 = tl.inline_asm_elementwise(
                                _PTX_INT2, _CONSTRAINTS_INT2, [w, s_hi, s_lo, zc],
                                dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
                            )  # fmt: skip
                            v = tl.join(tl.join(c0, c2), tl.join(c1, c3))
                    v = tl.reshape(v, [BLOCK_N, DIM])
                else:
                    w = w.to(tl.int32)
                    if BITS == 4:
                        w = tl.reshape(tl.join(w & 15, w >> 4), [BLOCK_N, NG, GROUP])
                    elif BITS == 2:
                        w = tl.join(tl.join(w & 3, (w >> 4) & 3), tl.join((w >> 2) & 3, w >> 6))
                        w = tl.reshape(w, [BLOCK_N, NG, GROUP])
                    # 0x4B000000 is 2^23 as fp32: OR-ing a code into its mantissa gives 2^23 + code, exact.
                    f = (w | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                    if TOKEN:
                        v = (tl.reshape(f, [BLOCK_N, DIM]) * sc + zr).to(tl.bfloat16)
                    else:
                        v = tl.reshape(f * sc[:, :, None] + zr[:, :, None], [BLOCK_N, DIM]).to(tl.bfloat16)
            if ASM:
                v = _opaque(v)
            return v

    @triton.jit
    def _mm(a, b, acc, F32: tl.constexpr):
        """acc + a @ b on the tensor cores (bf16 in, fp32 out). The CPU interpreter multiplies bf16 as raw
        integers, so there (F32) the operands are widened first; the values are the same bf16 numbers."""
        if F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        return tl.dot(a, b, acc)

    # The helpers whose result's shape depends on an orientation (S_T, V_T) keep one return: compiled Triton
    # (3.6) also generates the code after a constexpr `if X: return ...` and refuses the function when the two
    # shapes differ. The interpreter runs plain Python and never sees this, so the GPU tests cover it.
    @triton.jit
    def _load_queries(q_ptr, bh, hmask, D: tl.constexpr, W: tl.constexpr, S_T: tl.constexpr):
        """Channels [0, W) of the queries q [B, H, D] of heads bh, as bf16 [BH, W] ([W, BH] with S_T)."""
        d = tl.arange(0, W)
        if S_T:
            q = tl.load(q_ptr + bh[None, :] * D + d[:, None], mask=hmask[None, :], other=0.0)
        else:
            q = tl.load(q_ptr + bh[:, None] * D + d[None, :], mask=hmask[:, None], other=0.0)
        return q.to(tl.bfloat16)

    @triton.jit
    def _zeros_acc(BH: tl.constexpr, W: tl.constexpr, V_T: tl.constexpr):
        if V_T:
            acc = tl.zeros([W, BH], tl.float32)
        else:
            acc = tl.zeros([BH, W], tl.float32)
        return acc

    @triton.jit
    def _rescale(acc, alpha, V_T: tl.constexpr):
        if V_T:
            acc = acc * alpha[None, :]
        else:
            acc = acc * alpha[:, None]
        return acc

    @triton.jit
    def _double(acc, V_T: tl.constexpr):
        """acc [BH, W] ([W, BH] with V_T) -> [BH, 2W] with channels [W, 2W) zero. join gives [.., W, 2]; the
        permute puts the pair axis before the channels, so the reshape lays out all of acc, then the zeros."""
        z = tl.zeros(acc.shape, tl.float32)
        if V_T:
            wide = tl.reshape(tl.permute(tl.join(acc, z), (2, 0, 1)), [2 * acc.shape[0], acc.shape[1]])
        else:
            wide = tl.reshape(tl.permute(tl.join(acc, z), (0, 2, 1)), [acc.shape[0], 2 * acc.shape[1]])
        return wide

    @triton.jit
    def _widen(acc, W: tl.constexpr, D: tl.constexpr, V_T: tl.constexpr):
        """Pad the channels [0, W) of acc with zeros up to D (W, D powers of two, D <= 16 W)."""
        if W < D:
            acc = _double(acc, V_T)
        if 2 * W < D:
            acc = _double(acc, V_T)
        if 4 * W < D:
            acc = _double(acc, V_T)
        if 8 * W < D:
            acc = _double(acc, V_T)
        return acc

    @triton.jit
    def _softmax_step(
        qn, qp, c, r, valid, m_i, l_i, acc, qk_scale, S_T: tl.constexpr, V_T: tl.constexpr, F32: tl.constexpr
    ):
        """One tile of the online softmax (base 2): scores, running max/sum rescale, p @ c.

        Scores: S_T=False: s [BH, BN] = q c^T (qn [BH, DC], qp [BH, DR]);
                S_T=True:  s^T [BN, BH] = c q^T (qn [DC, BH], qp [DR, BH]): the tokens are the M dimension,
                           so a 64-token tile fills a Hopper tensor-core tile however few the heads.
        Values: V_T=False: acc [BH, DC] += p c;  V_T=True: acc^T [DC, BH] += c^T p^T.
        m_i, l_i: [BH] running max (base 2) and sum.
        """
        if S_T:
            s = _mm(c, qn, tl.zeros([c.shape[0], qn.shape[1]], tl.float32), F32)
            s = _mm(r, qp, s, F32)
            s = tl.trans(tl.where(valid[:, None], s * qk_scale, float("-inf")))  # [BH, BN]
        else:
            s = _mm(qn, tl.trans(c), tl.zeros([qn.shape[0], c.shape[0]], tl.float32), F32)
            s = _mm(qp, tl.trans(r), s, F32)
            s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds at least one valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_T:
            acc = _mm(tl.trans(c), tl.trans(p.to(tl.bfloat16)), acc * alpha[None, :], F32)
        else:
            acc = _mm(p.to(tl.bfloat16), c, acc * alpha[:, None], F32)
        return m_new, l_i, acc

    @triton.jit(do_not_specialize=["bt_stride", "H", "num_splits", "min_split"])
    def _mla_decode_kernel(
        qn_ptr,  # [B, H, DC] any float dtype, contiguous
        qp_ptr,  # [B, H, DR]
        cc_ptr,  # content pool codes / scale / zero
        cs_ptr,
        cz_ptr,
        rc_ptr,  # rope pool codes / scale / zero
        rs_ptr,
        rz_ptr,
        pc_ptr,  # protected content bf16 [slots, SINK + C_RING, DC]
        pr_ptr,  # protected rope bf16 [slots, SINK + R_RING, DR]
        bt_ptr,  # block tables int32 [B, bt_stride]
        bt_stride,
        lens_ptr,  # int32 [B]
        slots_ptr,  # int32 [B]
        o_ptr,  # [B, num_splits, H, DC] (fp32 partials, or the output when num_splits == 1)
        lse_ptr,  # fp32 [B, num_splits, H]
        H,
        num_splits,  # splits in the grid (sized for max_seq_len)
        min_split,  # > 0: each sequence takes `num_splits_for` at its own length (this its min_split); 0: all
        qk_scale,  # sm_scale * log2(e)
        DC: tl.constexpr,
        DR: tl.constexpr,
        C_KIND: tl.constexpr,
        C_BITS: tl.constexpr,
        C_GROUP: tl.constexpr,
        C_SCALED: tl.constexpr,
        C_ROW: tl.constexpr,
        C_SZ_ROW: tl.constexpr,
        R_KIND: tl.constexpr,
        R_BITS: tl.constexpr,
        R_GROUP: tl.constexpr,
        R_SCALED: tl.constexpr,
        R_ROW: tl.constexpr,
        R_SZ_ROW: tl.constexpr,
        C_NGS: tl.constexpr,  # scale groups each path stores (fewer than dim / group for a ranked format)
        R_NGS: tl.constexpr,
        DCB: tl.constexpr,  # content channels the body tiles compute: DC, or a ranked format's stored rank
        C_BLK: tl.constexpr,  # tokens per quantized block: 1, or a token-axis format's group
        R_BLK: tl.constexpr,
        PAGE: tl.constexpr,
        SINK: tl.constexpr,
        RECENT: tl.constexpr,
        C_RING: tl.constexpr,  # ring rows of each path's protected rows (recent + block - 1)
        R_RING: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        S_T: tl.constexpr,
        V_T: tl.constexpr,
        USE_ASM: tl.constexpr,
        F32_DOT: tl.constexpr,
    ):
        # Head blocks vary fastest, so the programs that share a cache chunk run side by side (L2 reuse); splits
        # slowest, so the live splits of all sequences come before the empty ones a loose max_seq_len adds.
        hb = tl.program_id(0)
        b = tl.program_id(1)
        split = tl.program_id(2)

        L = tl.load(lens_ptr + b)
        MIXED: tl.constexpr = C_BLK != R_BLK
        # Positions [SINK, q_c) / [SINK, q_r) of content / rope are quantized (quantmla.policy's
        # quantized_end); the body tiles cover [SINK, q_hi), quantized in both paths.
        q_c = SINK + tl.maximum(L - RECENT - SINK, 0) // C_BLK * C_BLK
        q_r = SINK + tl.maximum(L - RECENT - SINK, 0) // R_BLK * R_BLK
        q_hi = tl.minimum(q_c, q_r)
        n_q = q_hi - SINK
        # Work is counted in tiles of BLOCK_N positions. Body tiles are page-aligned (BLOCK_N divides PAGE),
        # so a tile is BLOCK_N consecutive rows of one pool block; the first and last are partly masked.
        t_lo = SINK // BLOCK_N
        nt_q = tl.where(n_q > 0, tl.cdiv(q_hi, BLOCK_N) - t_lo, 0)
        n_s = tl.minimum(L, SINK)
        n_p = n_s + tl.maximum(L - q_hi, 0)  # protected work: the sink positions, then [q_hi, L)
        nt = nt_q + tl.cdiv(n_p, BLOCK_N)
        # This sequence's own split count, num_splits_for at its length (the grid's is for max_seq_len): the
        # splits past it are empty and write lse = -inf alone. root = ceil(sqrt(L) / 2), exactly.
        L1 = tl.maximum(L, 1)
        root = tl.ceil(tl.sqrt(L1.to(tl.float32)) * 0.5).to(tl.int32)
        root = root - (4 * (root - 1) * (root - 1) >= L1).to(tl.int32) + (4 * root * root < L1).to(tl.int32)
        own = tl.minimum(tl.minimum(num_splits, tl.cdiv(L1, tl.maximum(min_split, 1))), root)
        own = tl.where(min_split > 0, tl.maximum(own, 1), num_splits)
        per_split = tl.cdiv(nt, own)
        t_start = split * per_split
        t_end = tl.minimum(t_start + per_split, nt)

        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < H
        dc = tl.arange(0, DC)
        bh = b * H + heads
        # A ranked content path (DCB < DC) stores only channels [0, DCB): the body tiles multiply over those
        # alone, into their own accumulator acc_b, and the protected rows (all DC channels) into acc.
        RANKED: tl.constexpr = DCB < DC
        busy = hmask & (tl.zeros_like(heads) + t_start < t_end)  # an empty split reads no queries either
        qn = _load_queries(qn_ptr, bh, busy, DC, DCB, S_T)
        qp = _load_queries(qp_ptr, bh, busy, DR, DR, S_T)
        acc_b = _zeros_acc(BLOCK_H, DCB, V_T)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)

        # Quantized body, one block-table entry per tile.
        bt_row = bt_ptr + b.to(tl.int64) * bt_stride
        for t in range(t_start, tl.minimum(t_end, nt_q)):
            pos0 = (t + t_lo) * BLOCK_N
            pos = pos0 + tl.arange(0, BLOCK_N)
            valid = (pos >= SINK) & (pos < q_hi)
            rows = tl.load(bt_row + pos0 // PAGE).to(tl.int64) * PAGE + pos0 % PAGE + tl.arange(0, BLOCK_N)
            cs = _scale_rows(bt_row, pos, rows, valid, SINK, PAGE, C_BLK)
            rs = _scale_rows(bt_row, pos, rows, valid, SINK, PAGE, R_BLK)
            c = _load_tile(cc_ptr, cs_ptr, cz_ptr, rows, cs, valid, DCB, C_KIND, C_BITS, C_GROUP, C_BLK > 1, C_SCALED, BLOCK_N, USE_ASM, C_ROW, C_SZ_ROW, C_NGS)
            r = _load_tile(rc_ptr, rs_ptr, rz_ptr, rows, rs, valid, DR, R_KIND, R_BITS, R_GROUP, R_BLK > 1, R_SCALED, BLOCK_N, USE_ASM, R_ROW, R_SZ_ROW, R_NGS)
            m_i, l_i, acc_b = _softmax_step(qn, qp, c, r, valid, m_i, l_i, acc_b, qk_scale, S_T, V_T, F32_DOT)

        if RANKED:  # the protected rows need every channel of the queries and of the output
            qn = _load_queries(qn_ptr, bh, hmask, DC, DC, S_T)
            acc = _zeros_acc(BLOCK_H, DC, V_T)
        else:
            acc = acc_b

        # Protected BF16 rows, in position order: the sink positions, then [q_hi, L) from each path's ring
        # (row SINK + (p - SINK) % ring). A path reads a position from its ring where it is unquantized in
        # that path (p >= its q); where the paths' blocks differ (MIXED), positions in [q_hi, q) of the path
        # that quantized further come from its pool.
        if SINK + C_RING + R_RING > 0:
            slot = tl.load(slots_ptr + b).to(tl.int64)
            for t in range(tl.maximum(t_start, nt_q) - nt_q, t_end - nt_q):
                i = t * BLOCK_N + tl.arange(0, BLOCK_N)
                valid = i < n_p
                p = tl.where(i < n_s, i, q_hi + i - n_s)
                bf_c = valid & ((p < SINK) | (p >= q_c))
                bf_r = valid & ((p < SINK) | (p >= q_r))
                rows_c = slot * (SINK + C_RING) + tl.where(p < SINK, p, SINK + (p - SINK) % (C_RING + (C_RING == 0)))
                rows_r = slot * (SINK + R_RING) + tl.where(p < SINK, p, SINK + (p - SINK) % (R_RING + (R_RING == 0)))
                c = _load_tile(pc_ptr, pc_ptr, pc_ptr, rows_c, rows_c, bf_c, DC, 0, 16, DC, False, False, BLOCK_N, USE_ASM, DC, DC, 1)
                r = _load_tile(pr_ptr, pr_ptr, pr_ptr, rows_r, rows_r, bf_r, DR, 0, 16, DR, False, False, BLOCK_N, USE_ASM, DR, DR, 1)
                if MIXED:
                    pooled_c = valid & ~bf_c
                    pooled_r = valid & ~bf_r
                    prow = tl.load(bt_row + p // PAGE, mask=valid, other=0).to(tl.int64) * PAGE + p % PAGE
                    cs = _scale_rows(bt_row, p, prow, pooled_c, SINK, PAGE, C_BLK)
                    rs = _scale_rows(bt_row, p, prow, pooled_r, SINK, PAGE, R_BLK)
                    c_q = _load_tile(cc_ptr, cs_ptr, cz_ptr, prow, cs, pooled_c, DC, C_KIND, C_BITS, C_GROUP, C_BLK > 1, C_SCALED, BLOCK_N, USE_ASM, C_ROW, C_SZ_ROW, C_NGS)
                    r_q = _load_tile(rc_ptr, rs_ptr, rz_ptr, prow, rs, pooled_r, DR, R_KIND, R_BITS, R_GROUP, R_BLK > 1, R_SCALED, BLOCK_N, USE_ASM, R_ROW, R_SZ_ROW, R_NGS)
                    c = tl.where(bf_c[:, None], c, c_q)
                    r = tl.where(bf_r[:, None], r, r_q)
                m_prev = m_i
                m_i, l_i, acc = _softmax_step(qn, qp, c, r, valid, m_i, l_i, acc, qk_scale, S_T, V_T, F32_DOT)
                if RANKED:  # keep acc_b on the running max too
                    acc_b = _rescale(acc_b, tl.exp2(m_prev - m_i), V_T)
        if RANKED:
            acc = acc + _widen(acc_b, DCB, DC, V_T)

        # An empty split stores lse = -inf alone (the combine reads no output where lse is -inf); an empty
        # sequence with one split stores out = 0 too (there the output is the result).
        ok = l_i > 0
        l_safe = tl.where(ok, l_i, 1.0)
        lse = tl.where(ok, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        row = (b * num_splits + split) * H + heads
        write = hmask & (ok | (tl.zeros_like(heads) + num_splits == 1))  # (a tensor: the interpreter)
        if V_T:
            out = acc / l_safe[None, :]
            tl.store(o_ptr + row[None, :] * DC + dc[:, None], out.to(o_ptr.dtype.element_ty), mask=write[None, :])
        else:
            out = acc / l_safe[:, None]
            tl.store(o_ptr + row[:, None] * DC + dc[None, :], out.to(o_ptr.dtype.element_ty), mask=write[:, None])
        tl.store(lse_ptr + row, lse, mask=hmask)

    @triton.jit(do_not_specialize=["H", "num_splits"])
    def _combine_kernel(po_ptr, plse_ptr, o_ptr, lse_ptr, H, num_splits, DC: tl.constexpr, CH: tl.constexpr):
        """Merge the splits of one (head, sequence): weights exp(lse_s - max), renormalized. The splits are read
        CH at a time (a grid sized for a loose max_seq_len holds many); an empty split (lse -inf) wrote no
        output, and none is read."""
        h = tl.program_id(0)
        b = tl.program_id(1)
        row0 = b * num_splits * H + h
        s = tl.arange(0, CH)
        m = tl.full([CH], float("-inf"), tl.float32)
        for s0 in range(0, num_splits, CH):
            m = tl.maximum(m, tl.load(plse_ptr + row0 + (s0 + s) * H, mask=s0 + s < num_splits, other=float("-inf")))
        mx = tl.max(m, 0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)  # all splits empty: weights 0, lse -inf
        dc = tl.arange(0, DC)
        acc = tl.zeros([DC], tl.float32)
        tot = tl.zeros([CH], tl.float32)
        for s0 in range(0, num_splits, CH):
            lse_s = tl.load(plse_ptr + row0 + (s0 + s) * H, mask=s0 + s < num_splits, other=float("-inf"))
            w = tl.exp(lse_s - mx)
            live = (lse_s > float("-inf"))[:, None] & (dc < DC)[None, :]
            po = tl.load(po_ptr + (row0 + (s0 + s) * H)[:, None] * DC + dc[None, :], mask=live, other=0.0)
            acc += tl.sum(w[:, None] * po, 0)
            tot += w
        total = tl.sum(tot, 0)
        ok = total > 0
        out = acc / tl.where(ok, total, 1.0)
        tl.store(o_ptr + (b * H + h) * DC + dc, out.to(o_ptr.dtype.element_ty))
        tl.store(lse_ptr + b * H + h, tl.where(ok, mx + tl.log(tl.where(ok, total, 1.0)), float("-inf")))


def _path_args(path: PagedPath) -> tuple[list[torch.Tensor], tuple[int, int, int, bool]]:
    """Pool pointers (a stand-in where the format has no scale/zero) and the path's constexprs."""
    fmt, codes = path.fmt, path.codes
    scale = path.scale if path.scale is not None else codes
    zero = path.zero if path.zero is not None else codes
    group = _group(path)
    if path.dim & (path.dim - 1) or group & (group - 1):
        raise ValueError(f"the kernel needs power-of-two dims and groups, got dim {path.dim}, group {group}")
    return [codes, scale, zero], (KIND_CODE[fmt.kind], fmt.bits, group, path.scale is not None)


def unsupported_reason(cache: PagedMLACache) -> str | None:
    """Why the Triton decode kernel (and the fused cache writer, which shares its layout code) cannot run this
    cache on a GPU, or None: both need power-of-two dims and groups, and tensor-core tiles of at least 16
    tokens (the default tile and the page) and 16 channels per path."""
    for name, path in (("content", cache.content), ("rope", cache.rope)):
        group = _group(path)
        if path.dim & (path.dim - 1) or group & (group - 1):
            return f"needs power-of-two dims and groups; the {name} path has dim {path.dim}, group {group}"
    if min(math.gcd(KernelConfig.block_n, cache.block_size), cache.content.dim, cache.rope.dim) < 16:
        return (f"needs tiles of at least 16 tokens and channels; page {cache.block_size}, dims "
                f"{cache.content.dim}/{cache.rope.dim}")
    return None


def _group(path: PagedPath) -> int:
    """Channels per group as the kernel lays out the codes (token-axis: the whole path as one group)."""
    return path.dim if path.fmt.axis == "token" else path.fmt.group or path.dim


def _stored_groups(path: PagedPath) -> int:
    """Scale groups of a token the pool stores (for a ranked format, those of its first `rank` channels)."""
    return path.fmt.stored(path.dim) // _group(path)


def _body_channels(path: PagedPath) -> int:
    """Content channels the body tiles compute: a ranked format's stored rank where it is a power of two of
    at least 16 (a tensor-core tile) and 1/16 of the channels, else all of them (the unstored read as 0)."""
    width = path.fmt.stored(path.dim)
    narrow = width < path.dim and width & (width - 1) == 0 and width >= max(16, path.dim // 16)
    return width if narrow else path.dim


def _row_strides(path: PagedPath) -> tuple[int, int]:
    """Elements from one pool row to the next in the codes and in the scale/zero pools. A pool [NB, P, width]
    may have rows further apart than its width (fields of one packed row, as in vLLM's cache tensor), but
    each row must be contiguous and each block a whole run of rows (stride(0) = P * stride(1))."""
    if (why := path.row_layout_problem()) is not None:
        raise ValueError(f"the kernel {why}")
    return path.codes.stride(1), (path.scale.stride(1) if path.scale is not None else 0)


def num_splits_for(batch: int, num_heads: int, max_seq_len: int, cfg: KernelConfig, num_sms: int) -> int:
    """Splits of a sequence of max_seq_len tokens: enough programs to keep every SM busy (cfg.ctas_per_sm),
    about sqrt(L) / 2 of them (each split costs a partial output write and read; the balance grows with the
    square root of the length: on the H200 at B = 1 the fastest counts were 16 / 32 / 64 at 1 / 4 / 16 K,
    benchmarks/results/decode_kernel_min_split.md), and none shorter than cfg.min_split tokens. The kernel
    applies the same rule to each sequence's own length, within this count."""
    programs = max(batch * triton.cdiv(num_heads, cfg.block_h), 1)  # an empty batch launches nothing
    want = max(1, round(num_sms * cfg.ctas_per_sm / programs))
    length = max(max_seq_len, 1)
    root = -(-(math.isqrt(length - 1) + 1) // 2)  # ceil(sqrt(length) / 2)
    return max(1, min(want, root, triton.cdiv(length, cfg.min_split)))


@dataclass(frozen=True)
class Launch:
    """One Triton launch: grid, positional arguments (tensors, ints, floats and the constexprs, in the
    kernel's parameter order), launch options, and the outputs the caller reads afterwards (the decode
    kernel's (out, lse, part_o, part_lse) of `split_outputs`; none for the cache writer)."""

    grid: tuple[int, ...]
    args: tuple
    options: dict
    outputs: tuple


def triton_launch(q_nope_absorbed, q_pe, cache: PagedMLACache, block_tables, seq_lens, slots, sm_scale: float,
                  cfg: KernelConfig, num_splits: int, out_dtype: torch.dtype, *, asm: bool,
                  interpreting: bool, min_split: int = 0) -> Launch:
    """The launch `mla_decode` makes (arguments as there); asm / interpreting: the USE_ASM and F32_DOT
    constexprs; min_split > 0: each sequence takes `num_splits_for` (with this min_split) at its own length,
    within the grid's num_splits; 0: every sequence uses all num_splits. Apart from running it, so that
    `kernels.offline` can compile the very same launch for a GPU the machine does not have."""
    B, H, dc = q_nope_absorbed.shape
    dr = q_pe.shape[-1]
    qn, qp, slots, outputs = launch_inputs(q_nope_absorbed, q_pe, slots, num_splits, out_dtype)
    part_o, part_lse = outputs[2:]
    c_ptrs, c_const = _path_args(cache.content)
    r_ptrs, r_const = _path_args(cache.rope)
    block_n = math.gcd(cfg.block_n, cache.block_size)  # body tiles must not cross a page
    if not interpreting and min(block_n, dc, dr) < 16:
        raise ValueError(f"on the GPU the kernel needs pages, kv_lora_rank and rope dims of at least 16 tokens or "
                         f"channels (tensor-core tiles); got page {cache.block_size}, dims {dc}/{dr}")  # fmt: skip
    args = (qn, qp, *c_ptrs, *r_ptrs, cache.protected_content, cache.protected_rope,
            block_tables, block_tables.stride(0), seq_lens, slots, part_o, part_lse,
            H, num_splits, min_split, sm_scale * LOG2E,
            dc, dr, *c_const, *_row_strides(cache.content), *r_const, *_row_strides(cache.rope),
            _stored_groups(cache.content), _stored_groups(cache.rope), _body_channels(cache.content), cache.content.block, cache.rope.block, cache.block_size, cache.sink, cache.recent, *cache.rings,
            cfg.block_h, block_n, cfg.scores_t, cfg.values_t, asm, interpreting)  # fmt: skip
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.maxnreg:
        options["maxnreg"] = cfg.maxnreg
    return Launch((triton.cdiv(H, cfg.block_h), B, num_splits), args, options, outputs)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: pretend to be an H100/H200 so the split logic is exercised
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


# The other kernels' launchers by `decode_kernel_name`'s name: (module, function), looked up at each call. They
# share `mla_decode`'s contract, plus num_sms.
LAUNCHERS = {
    "cuda": ("quantmla.kernels.mla_decode_cuda", "mla_decode_cuda"),
    "heads": ("quantmla.kernels.mla_decode_many_heads", "mla_decode_many_heads"),
    "gluon": ("quantmla.kernels.mla_decode_gluon", "mla_decode_gluon"),
}


def mla_decode(
    q_nope_absorbed: torch.Tensor,
    q_pe: torch.Tensor,
    cache: PagedMLACache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor | None = None,
    sm_scale: float = 1.0,
    *,
    max_seq_len: int | None = None,
    out_dtype: torch.dtype = torch.float32,
    num_splits: int | None = None,
    config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode one query token per sequence against a `PagedMLACache`.

    q_nope_absorbed [B, H, dc] (W_uk-absorbed queries) and q_pe [B, H, dr] (post-RoPE), bf16 or fp32,
        contiguous; they are rounded to bf16 for the tensor cores.
    block_tables [B, max_blocks] int32 (pool block of each page of each sequence; unused entries ignored),
    seq_lens [B] int32 (cached tokens per sequence, 0 allowed), slots [B] int32 (protected-row slot of each
        sequence; default arange(B)), sm_scale: softmax scale.
    max_seq_len: an upper bound on seq_lens, used to size the split; pass it (no host sync) when capturing
        a CUDA graph; None reads seq_lens.max() (one sync).
    Kernel: `decode_kernel_name(cache, H, device, batch=B)` says which: this module's Triton kernel, the CUDA
        kernel of `mla_decode_cuda` (int4/int2 and fp8 caches; "auto" picks it where it measured faster, see
        `auto_kernel`; $QUANTMLA_DECODE_KERNEL=cuda forces it), the many-heads Hopper kernel of
        `mla_decode_many_heads` ("auto" above 32 heads except batches of very few head blocks;
        $QUANTMLA_DECODE_KERNEL=heads forces it), or with $QUANTMLA_DECODE_KERNEL=gluon the few-heads Hopper
        kernel of `mla_decode_gluon` (INT4/INT4 channel groups of 64, 512/64 dims, H <= 16; opt-in);
        an explicit `config` always means Triton. num_splits: Triton's splits, or the CUDA kernel's body splits.
    Returns out [B, H, dc] in out_dtype (fp32 or bf16) and lse [B, H] fp32 (natural log; -inf if L = 0).
    """
    if triton is None:
        raise RuntimeError("mla_decode needs triton; use mla_decode_reference on machines without it")
    B, H, dc = q_nope_absorbed.shape
    dr = q_pe.shape[-1]
    if (dc, dr) != (cache.kv_lora_rank, cache.rope_dim) or q_pe.shape[:2] != (B, H):
        raise ValueError(f"queries {tuple(q_nope_absorbed.shape)}/{tuple(q_pe.shape)} do not match the cache")
    dev = q_nope_absorbed.device
    # The kernels read entry i of a row as base + i: a transposed table or strided lengths / slots would be
    # read at the wrong entries. No copy where they are already unit-stride (CUDA-graph capture is unaffected).
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens, slots = seq_lens.contiguous(), None if slots is None else slots.contiguous()
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if B else 0
    kernel = decode_kernel_name(cache, H, dev, batch=B) if config is None else "triton"
    if kernel in LAUNCHERS:
        module, name = LAUNCHERS[kernel]
        launch = getattr(importlib.import_module(module), name)
        return launch(q_nope_absorbed, q_pe, cache, block_tables, seq_lens, slots, sm_scale, max_seq_len=max_seq_len,
                      out_dtype=out_dtype, num_splits=num_splits, num_sms=_sm_count(dev))  # fmt: skip
    cfg = config or default_config(cache, H)
    if num_splits is not None and num_splits < 1:  # 0 splits would launch nothing: zeros, lse -inf
        raise ValueError(f"num_splits must be >= 1 (or None: sized for max_seq_len), got {num_splits}")
    min_split = 0  # a caller's num_splits holds for every sequence
    if num_splits is None:  # sized for max_seq_len; each sequence takes num_splits_for at its own length
        num_splits, min_split = num_splits_for(B, H, max_seq_len, cfg, _sm_count(dev)), cfg.min_split
    launch = triton_launch(q_nope_absorbed, q_pe, cache, block_tables, seq_lens, slots, sm_scale, cfg, num_splits,
                           out_dtype, asm=cfg.asm and not _interpreting(), interpreting=_interpreting(),
                           min_split=min_split)
    try:
        _mla_decode_kernel[launch.grid](*launch.args, **launch.options)
    except OutOfResources as e:
        token = [f"{name} {p.fmt}" for name, p in (("content", cache.content), ("rope", cache.rope)) if p.block > 1]
        if not token:
            raise
        # A token-axis tile loads one scale and zero row per token: with two pipeline stages a content path,
        # or a RoPE path at 128 heads, did not fit an H200's shared memory (decode_kernel_formats.md); with
        # default_config's one stage they fit there, but a GPU with less shared memory per block can refuse.
        raise ValueError(f"the decode kernel cannot launch the token-axis {', '.join(token)} at {H} heads on this "
                         f"GPU ({e}); serve channel-grouped formats here (calibrate without --token-axis)") from e
    out, lse, part_o, part_lse = launch.outputs
    combine_splits(part_o, part_lse, out, lse)
    return out, lse


def launch_inputs(q_nope_absorbed, q_pe, slots, num_splits: int, out_dtype: torch.dtype) -> tuple:
    """(qn, qp, slots, outputs) of a decode launch: the queries contiguous, slots int32 [B] (arange(B) for None),
    and the `split_outputs` of num_splits."""
    B, H, dc = q_nope_absorbed.shape
    dev = q_nope_absorbed.device
    if slots is None:
        slots = torch.arange(B, dtype=torch.int32, device=dev)
    outputs = split_outputs(B, H, dc, num_splits, out_dtype, dev)
    return q_nope_absorbed.contiguous(), q_pe.contiguous(), slots, outputs


def split_outputs(B: int, H: int, dc: int, num_splits: int, out_dtype: torch.dtype, device) -> tuple:
    """(out [B, H, dc] out_dtype, lse [B, H] fp32, part_o, part_lse): what a decode launch with num_splits
    writes, i.e. out and lse themselves for one split, else fp32 partials [B, splits, H, dc] / [B, splits, H]
    for `combine_splits`."""
    out = torch.empty(B, H, dc, dtype=out_dtype, device=device)
    lse = torch.empty(B, H, dtype=torch.float32, device=device)
    if num_splits == 1:
        return out, lse, out, lse
    part_o = torch.empty(B, num_splits, H, dc, dtype=torch.float32, device=device)
    return out, lse, part_o, torch.empty(B, num_splits, H, dtype=torch.float32, device=device)


def combine_splits(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge the partials of `split_outputs` into out / lse (nothing to do for one split)."""
    if part_o is not out:
        B, num_splits, H, dc = part_o.shape
        _combine_kernel[(H, B)](part_o, part_lse, out, lse, H, num_splits, dc, COMBINE_CHUNK, num_warps=4)


decode = mla_decode  # the kernel's entry point; quantmla.decode_step.decode_step is a whole layer's step
