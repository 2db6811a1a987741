"""Hopper (sm_90) decode kernel for many heads (64 per CTA) over a quantized paged cache, in Triton's Gluon.

Contract: the same as `quantmla.kernels.mla_decode.mla_decode` (which runs it where `decode_kernel_name` says
"heads": by default above 32 heads on Hopper, except for batches of very few head blocks):
    mla_decode_many_heads(q_nope_absorbed [B, H, dc], q_pe [B, H, dr] (bf16 or fp32), cache: PagedMLACache,
                          block_tables int32 [B, max_blocks], seq_lens int32 [B] (0 allowed), slots int32 [B] or
                          None, sm_scale, *, max_seq_len, out_dtype (fp32 or bf16), num_splits=None)
        -> out [B, H, dc] (out_dtype), lse [B, H] fp32 (natural log; -inf for an empty sequence).
No host syncs when max_seq_len is given: CUDA-graph capturable (compile outside the capture).

What it takes (`unsupported_reason` names the first thing that is not; Triton's kernel reads the rest):
  - a CUDA device of compute capability 9.x (wgmma), Triton 3.6-3.9 with `triton.experimental.gluon`;
  - content int4 / int2 / fp8 in channel groups (fp8 also without a scale), rope the same or bf16; no ranked or
    token-axis paths; power-of-two kv_lora_rank 64..512 and rope dims 16..128;
  - pages of a multiple of 64 tokens; bf16 protected rows (sink + ring), contiguous; pools of whole rows (row
    strides may exceed the widths, as in vLLM's packed rows), code rows 4-byte aligned.

Design (FlashMLA's split of the work between two warpgroups, with the dequantization in front of it). One CTA
= 8 warps = (64 heads, sequence, split: the grid's order, live splits first). Q [64 heads, dc + dr] is staged
once in shared memory and stays there as the A operand of the scores, so no registers hold it (Triton's kernel
keeps it in registers and, at 64 heads per program, spills: 376 bytes of stack per thread at int4/int4). Per
tile of 64 tokens:
  - all 8 warps dequantize the tile into one of two fp16 shared-memory tiles K [64 tokens, dc] and K_pe
    [64, dr] (`_dequant_ptx`: 3 instructions per 2 codes); protected rows are copied there. Each thread loads
    16 code bytes of one token, and a warp's lanes run along the bytes of a group, then along tokens, so each
    16-byte store of the tile lands in a different bank under its 128-byte swizzle;
  - S [64 heads, 64 tokens] = Q K^T + Q_pe K_pe^T: `warpgroup_mma`, each warpgroup 32 of the tokens;
  - online softmax in base 2 over the token axis (the row max crosses the two warpgroups); P (fp16) to shared
    memory;
  - O [64 heads, dc] += P K: each warpgroup accumulates half of the channels in registers (128 fp32 per thread
    at dc = 512); K is the same shared tile, read as the MN-major B operand;
  - software pipeline: tile t's P K runs while tile t + 1 is dequantized into the other buffer and its scores
    are issued; tile t + 2's codes are prefetched into L2 (`prefetch.global.L2`).
Split-K over `num_splits` (about one CTA per SM, splits of at least 256 tokens) merged by the Triton
`_combine_kernel`, lse out.

Numbers: the tensor cores take fp16 (K, Q, P) with fp32 accumulation. The dequantized values are
(code - mid) * scale + (zero + mid * scale) rounded once to fp16 (the scales are stored in fp16); protected rows
round bf16 -> fp16. Q is scaled by the power of two 2^-e that keeps the CTA's largest |q| below 2^14 (exact;
S is scaled back), so large queries cannot overflow; cache values beyond fp16's range (65504) would. Against the
fp64 reference on the same int4/int4 caches its output has an rms error of 4.5e-4, Triton's integer kernel
(bf16 operands) 6.4e-3, the CUDA kernel 2.7e-3 (H200, benchmarks/results/decode_kernel_heads.md).
"""

from __future__ import annotations

import math

import torch

from quantmla.cache.paged import PagedMLACache

LOG2E = 1.4426950408889634
BLOCK_H, BLOCK_N, NUM_WARPS = 64, 64, 8
# Scheduling constexprs (experiments: `variant=` of the launcher, benchmarks/decode_kernel_heads_ab.py): the L2
# prefetch distance in tiles.
VARIANT = dict(PF_AHEAD=2)
KINDS = {"bf16": 0, "fp8": 1, "int4": 2, "int2": 2}

try:  # Gluon is experimental (TRITON_VERSIONS in mla_decode_gluon); elsewhere the module imports and refuses to launch
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    # one barrier of the CTA's threads: `thread_barrier` in Triton 3.6, `barrier` from 3.7 on
    _barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
    _GLUON_ERROR = None
except Exception as e:  # pragma: no cover - exercised where gluon is missing or different
    gluon = None
    _GLUON_ERROR = f"{type(e).__name__}: {e}"


def _dequant_ptx(bits: int) -> str:
    """PTX for gl.inline_asm_elementwise (pack = 4): a word of 4 code bytes -> 8 / bits fp16 tensors of 4 values
    each, code * scale + zero.

    Operands: outputs $0.. (two b32 registers per output tensor k: elements (0, 1) and (2, 3)), then the code
    word (byte e = element e), the scale's fp16 pairs (elements (0, 1) and (2, 3)) and the centred zero's
    z + mid * scale (mid = 2^(bits - 1)). `prmt` reorders the bytes to (b0, b2, b1, b3), so one shift + `lop3`
    puts code k of (b0, b1) or of (b2, b3) into the low mantissa bits of fp16 1024.0 (0x6400): 1024 + code,
    exact. `sub` of 1024 + mid leaves code - mid (exact) and one `fma` rounds (code - mid) * scale + zc once.
    Output tensor k holds code k of each byte. 3 instructions per 2 codes (plus a shift), no conversions."""
    n_out, mask, mid = 8 // bits, (1 << bits) - 1, 1 << (bits - 1)
    w, s0, s1, z0, z1 = (f"${2 * n_out + i}" for i in range(5))
    lines = ["{", ".reg .b32 y, t, m;", f"mov.b32 m, 0x{0x6400 | mid:04X}{0x6400 | mid:04X};",
             f"prmt.b32 y, {w}, 0, 0x3120;"]
    for k in range(n_out):
        for half, (sc, z) in enumerate(((s0, z0), (s1, z1))):
            shift = 8 * half + bits * k  # code k of byte pair (b0, b1) at bit 0, of (b2, b3) at bit 8
            src = "y"
            if shift:
                lines.append(f"shr.u32 t, y, {shift};")
                src = "t"
            lines.append(f"lop3.b32 t, {src}, 0x{mask:04X}{mask:04X}, 0x64006400, 0xEA;")  # (x & m) | magic
            lines.append("sub.f16x2 t, t, m;")
            lines.append(f"fma.rn.f16x2 ${2 * k + half}, t, {sc}, {z};")
    return "\n".join(lines + ["}"])


def _dequant_constraints(bits: int) -> str:
    """`_dequant_ptx(bits)`'s constraints: 8 / bits outputs of two registers, the word, two scale and two zero
    registers."""
    return ",".join(["=r"] * (2 * (8 // bits)) + ["r"] * 5)


if gluon is not None:
    _PTX4, _PTX2 = gl.constexpr(_dequant_ptx(4)), gl.constexpr(_dequant_ptx(2))
    _CON4, _CON2 = gl.constexpr(_dequant_constraints(4)), gl.constexpr(_dequant_constraints(2))

    @gluon.jit
    def _dequant(codes_ptr, scale_ptr, zero_ptr, rows, valid, DIM: gl.constexpr, KIND: gl.constexpr,
                 BITS: gl.constexpr, GROUP: gl.constexpr, GB: gl.constexpr, SCALED: gl.constexpr,
                 ROW: gl.constexpr, SZ_ROW: gl.constexpr, L3: gl.constexpr):
        """Pool rows `rows` [64] (int64, SliceLayout(1, SliceLayout(2, L3))) -> fp16 [64, DIM]; invalid rows
        read as 0 (codes are finite and their scale and zero are masked; fp8 bytes may be NaN and are masked).
        L3: the layout of the [64, DIM / GROUP, GB] view of a row (GB: bytes per group; a bf16 path is one
        group of DIM elements), 4 consecutive bytes per thread at least (one PTX pack)."""
        NG: gl.constexpr = DIM // GROUP
        g = gl.arange(0, NG, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        j = gl.arange(0, GB, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        w = gl.load(codes_ptr + rows[:, None, None] * ROW + g[None, :, None] * GB + j[None, None, :])
        sg = rows[:, None] * SZ_ROW + g[None, :]
        if KIND == 0:  # bf16 values
            return gl.reshape(gl.where(valid[:, None, None], w.to(gl.float32), 0.0), [64, DIM]).to(gl.float16)
        elif KIND == 1:  # fp8 e4m3 times an fp32 group scale
            v = w.to(gl.float8e4nv, bitcast=True).to(gl.float32)
            if SCALED:
                v = v * gl.load(scale_ptr + sg, mask=valid[:, None], other=0.0)[:, :, None]
            v = gl.where(valid[:, None, None], v, 0.0)
            return gl.reshape(v, [64, DIM]).to(gl.float16)
        else:  # x = code * scale + zero, by the PTX on (code - mid) with the centred zero z + mid * scale
            sc = gl.load(scale_ptr + sg, mask=valid[:, None], other=0.0).to(gl.float32)
            zr = gl.load(zero_ptr + sg, mask=valid[:, None], other=0.0).to(gl.float32)
            zc = gl.broadcast((zr + (1 << (BITS - 1)) * sc).to(gl.float16)[:, :, None], w)[0]
            s16 = gl.broadcast(sc.to(gl.float16)[:, :, None], w)[0]
            if BITS == 4:  # byte i holds channels 2i (low nibble) and 2i+1 (high nibble)
                lo, hi = gl.inline_asm_elementwise(_PTX4, _CON4, [w, s16, zc], dtype=(gl.float16, gl.float16),
                                                   is_pure=True, pack=4)
                v = gl.join(lo, hi)
            else:  # byte i holds channel 4i + k in bits 2k, 2k + 1
                c0, c1, c2, c3 = gl.inline_asm_elementwise(
                    _PTX2, _CON2, [w, s16, zc], dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
                    is_pure=True, pack=4)  # fmt: skip
                v = gl.join(gl.join(c0, c2), gl.join(c1, c3))
            return gl.reshape(v, [64, DIM])

    @gluon.jit
    def _load_rows(ptr, rows, DIM: gl.constexpr, L2: gl.constexpr):
        """bf16 rows [64, DIM] of a contiguous pool (rows in SliceLayout(1, L2)) as fp16."""
        d = gl.arange(0, DIM, layout=gl.SliceLayout(0, L2))
        return gl.load(ptr + rows[:, None] * DIM + d[None, :]).to(gl.float32).to(gl.float16)

    @gluon.jit
    def _prot_rows(t, slot, n_s, n_p, q_hi, layout: gl.constexpr, SINK: gl.constexpr, RING: gl.constexpr):
        """Protected tile t's 64 row indices (the sink positions, then [q_hi, L) in the ring); invalid ones read
        the last valid row (its finite values; they get p = 0)."""
        i = gl.minimum(t * 64 + gl.arange(0, 64, layout=layout), n_p - 1)
        p = gl.where(i < n_s, i, q_hi + i - n_s)
        return slot * (SINK + RING) + gl.where(p < SINK, p, SINK + (p - SINK) % (RING + (RING == 0)))

    @gluon.jit
    def _fill(t, buf, k_s, kr_s, nt_q, t_lo, bt_row, q_hi, n_s, n_p, slot, cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr,
              rz_ptr, pc_ptr, pr_ptr, DC: gl.constexpr, DR: gl.constexpr, C_KIND: gl.constexpr,
              C_BITS: gl.constexpr, C_GROUP: gl.constexpr, C_GB: gl.constexpr, C_SCALED: gl.constexpr,
              R_KIND: gl.constexpr, R_BITS: gl.constexpr, R_GROUP: gl.constexpr, R_GB: gl.constexpr,
              R_SCALED: gl.constexpr, C_ROW: gl.constexpr, C_SZ_ROW: gl.constexpr, R_ROW: gl.constexpr,
              R_SZ_ROW: gl.constexpr, PAGE: gl.constexpr, SINK: gl.constexpr, C_RING: gl.constexpr,
              R_RING: gl.constexpr, LC: gl.constexpr, LR: gl.constexpr, LPC: gl.constexpr, LPR: gl.constexpr):
        """Tile t's fp16 rows into buffer `buf` of k_s / kr_s: a body tile dequantized (t < nt_q), else
        protected tile t - nt_q copied. Invalid rows hold 0 or a valid row's values (finite either way)."""
        if t < nt_q:
            pos0 = (t + t_lo) * 64
            row0 = gl.load(bt_row + pos0 // PAGE).to(gl.int64) * PAGE + pos0 % PAGE
            tc = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, LC)))
            tr = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, LR)))
            k_s.index(buf).store(_dequant(cc_ptr, cs_ptr, cz_ptr, row0 + tc, (pos0 + tc >= SINK) & (pos0 + tc < q_hi),
                                          DC, C_KIND, C_BITS, C_GROUP, C_GB, C_SCALED, C_ROW, C_SZ_ROW, LC))
            kr_s.index(buf).store(_dequant(rc_ptr, rs_ptr, rz_ptr, row0 + tr, (pos0 + tr >= SINK) & (pos0 + tr < q_hi),
                                           DR, R_KIND, R_BITS, R_GROUP, R_GB, R_SCALED, R_ROW, R_SZ_ROW, LR))
        else:
            tp = t - nt_q
            rc = _prot_rows(tp, slot, n_s, n_p, q_hi, gl.SliceLayout(1, LPC), SINK, C_RING)
            k_s.index(buf).store(_load_rows(pc_ptr, rc, DC, LPC))
            rr = _prot_rows(tp, slot, n_s, n_p, q_hi, gl.SliceLayout(1, LPR), SINK, R_RING)
            kr_s.index(buf).store(_load_rows(pr_ptr, rr, DR, LPR))

    @gluon.jit
    def _softmax(s, t, nt_q, t_lo, q_hi, n_p, qk_scale, m_i, l_i, SINK: gl.constexpr, S_L: gl.constexpr):
        """Tile t's online-softmax step (base 2) on its scores s [64 heads, 64 tokens]: (p, alpha, m, l)."""
        tok = gl.arange(0, 64, layout=gl.SliceLayout(0, S_L))
        if t < nt_q:  # body tile: positions [SINK, q_hi)
            pos = (t + t_lo) * 64 + tok
            valid = (pos >= SINK) & (pos < q_hi)
        else:  # protected tile: its rows below n_p
            valid = (t - nt_q) * 64 + tok < n_p
        s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))  # finite: every tile holds a valid token
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    _PREFETCH_PTX = gl.constexpr("prefetch.global.L2 [$1];\nmov.b32 $0, 0;")

    @gluon.jit
    def _prefetch(ptrs):
        gl.inline_asm_elementwise(_PREFETCH_PTX, "=r,l", [ptrs], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _prefetch_tile(t, t_lo, bt_row, cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr, C_ROW: gl.constexpr,
                       C_SZ_ROW: gl.constexpr, R_ROW: gl.constexpr, R_SZ_ROW: gl.constexpr, C_BYTES: gl.constexpr,
                       R_BYTES: gl.constexpr, PAGE: gl.constexpr, PF: gl.constexpr):
        """prefetch.global.L2 of body tile t's codes (every 128-byte line of a row) and scale / zero rows, so
        that its loads a tile later hit L2."""
        pos0 = (t + t_lo) * 64
        rows = (gl.load(bt_row + pos0 // PAGE).to(gl.int64) * PAGE + pos0 % PAGE
                + gl.arange(0, 64, layout=gl.SliceLayout(1, PF)))
        ln = gl.arange(0, 4, layout=gl.SliceLayout(0, PF))
        for k in gl.static_range((C_BYTES + 511) // 512):
            _prefetch(cc_ptr + rows[:, None] * C_ROW + gl.minimum(128 * (4 * k + ln), C_BYTES - 1)[None, :])
        _prefetch(rc_ptr + rows[:, None] * R_ROW + gl.minimum(128 * ln, R_BYTES - 1)[None, :])
        if C_SZ_ROW > 0:
            _prefetch(cs_ptr + rows * C_SZ_ROW)
            _prefetch(cz_ptr + rows * C_SZ_ROW)
        if R_SZ_ROW > 0:
            _prefetch(rs_ptr + rows * R_SZ_ROW)
            _prefetch(rz_ptr + rows * R_SZ_ROW)

    @gluon.jit
    def _scores(q_s, qr_s, k_s, kr_s, buf, S_L: gl.constexpr):
        """The scores MMAs of the tile in buffer `buf`, issued (not waited for): Q K^T + Q_pe K_pe^T."""
        s = warpgroup_mma(q_s, k_s.index(buf).permute((1, 0)), gl.zeros([64, 64], gl.float32, layout=S_L),
                          use_acc=False, is_async=True)
        return warpgroup_mma(qr_s, kr_s.index(buf).permute((1, 0)), s, is_async=True)

    @gluon.jit(do_not_specialize=["bt_stride", "H", "num_splits", "want", "min_tiles"])
    def _many_heads_kernel(
        qn_ptr, qp_ptr,  # [B, H, DC], [B, H, DR] bf16/fp32, contiguous
        cc_ptr, cs_ptr, cz_ptr,  # content codes / scale / zero pools
        rc_ptr, rs_ptr, rz_ptr,  # rope codes / scale / zero
        pc_ptr, pr_ptr,  # protected bf16 [slots, SINK + ring, DC] / [.., DR]
        bt_ptr, bt_stride, lens_ptr, slots_ptr,
        o_ptr, lse_ptr,  # [B, num_splits, H, DC], fp32 [B, num_splits, H]
        H, num_splits, want, min_tiles, qk_scale,  # splits: `split_length`'s (want, min_tiles), grid num_splits
        DC: gl.constexpr, DR: gl.constexpr,
        C_KIND: gl.constexpr, C_BITS: gl.constexpr, C_GROUP: gl.constexpr, C_GB: gl.constexpr,
        C_SCALED: gl.constexpr,
        R_KIND: gl.constexpr, R_BITS: gl.constexpr, R_GROUP: gl.constexpr, R_GB: gl.constexpr,
        R_SCALED: gl.constexpr,
        C_ROW: gl.constexpr, C_SZ_ROW: gl.constexpr, R_ROW: gl.constexpr, R_SZ_ROW: gl.constexpr,
        PAGE: gl.constexpr, SINK: gl.constexpr, RECENT: gl.constexpr, C_RING: gl.constexpr, R_RING: gl.constexpr,
        S_L: gl.constexpr, O_L: gl.constexpr, LC: gl.constexpr, LR: gl.constexpr, LPC: gl.constexpr,
        LPR: gl.constexpr, Q_SL: gl.constexpr, QR_SL: gl.constexpr, P_SL: gl.constexpr, PF: gl.constexpr,
        PF_AHEAD: gl.constexpr,
    ):
        h0 = gl.program_id(0) * 64
        b = gl.program_id(1)
        split = gl.program_id(2)
        L = gl.load(lens_ptr + b)
        q_hi = SINK + gl.maximum(L - RECENT - SINK, 0)  # positions [SINK, q_hi) are quantized
        n_q = q_hi - SINK
        t_lo: gl.constexpr = SINK // 64
        nt_q = gl.where(n_q > 0, (q_hi + 63) // 64 - t_lo, 0)
        n_s = gl.minimum(L, SINK)
        n_p = n_s + gl.maximum(L - q_hi, 0)
        nt = nt_q + (n_p + 63) // 64
        # `split_length` at this sequence's own length, within the grid's num_splits (sized for max_seq_len):
        # the splits past the last tile are empty and write lse = -inf alone.
        per_split = gl.maximum(gl.maximum(min_tiles, (nt + want - 1) // want), (nt + num_splits - 1) // num_splits)
        t_start = split * per_split
        t_end = gl.minimum(t_start + per_split, nt)

        # Q [64 heads, DC] and [64, DR] in shared memory for the whole CTA (padded heads are 0), in fp16 times
        # 2^-e, the power of two that keeps the CTA's largest |q| below 2^14 (exact; S is scaled back by 2^e)
        hq = gl.arange(0, 64, layout=gl.SliceLayout(1, LPC))
        dq = gl.arange(0, DC, layout=gl.SliceLayout(0, LPC))
        busy = t_start < t_end  # an empty split reads no Q either
        q = gl.load(qn_ptr + (b * H + h0 + hq)[:, None] * DC + dq[None, :], mask=((h0 + hq < H) & busy)[:, None],
                    other=0.0).to(gl.float32)
        hr = gl.arange(0, 64, layout=gl.SliceLayout(1, LPR))
        dr = gl.arange(0, DR, layout=gl.SliceLayout(0, LPR))
        qr = gl.load(qp_ptr + (b * H + h0 + hr)[:, None] * DR + dr[None, :], mask=((h0 + hr < H) & busy)[:, None],
                     other=0.0).to(gl.float32)
        amax = gl.maximum(gl.max(gl.max(gl.abs(q), 1), 0), gl.max(gl.max(gl.abs(qr), 1), 0))
        e = gl.maximum(gl.ceil(gl.log2(gl.maximum(amax, 1.0))) - 14.0, 0.0)
        q_s = gl.allocate_shared_memory(gl.float16, [64, DC], Q_SL, (q * gl.exp2(-e)).to(gl.float16))
        qr_s = gl.allocate_shared_memory(gl.float16, [64, DR], QR_SL, (qr * gl.exp2(-e)).to(gl.float16))
        qk_scale = qk_scale * gl.exp2(e)
        k_s = gl.allocate_shared_memory(gl.float16, [2, 64, DC], Q_SL)  # double-buffered K tiles
        kr_s = gl.allocate_shared_memory(gl.float16, [2, 64, DR], QR_SL)
        p_s = gl.allocate_shared_memory(gl.float16, [64, 64], P_SL)

        o = gl.zeros([64, DC], gl.float32, layout=O_L)
        m_i = gl.full([64], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        l_i = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, S_L))
        bt_row = bt_ptr + b.to(gl.int64) * bt_stride
        slot = gl.load(slots_ptr + b).to(gl.int64)
        # Software pipeline: tile t's P . K MMA runs while tile t + 1 is dequantized into the other buffer and
        # its scores MMA is issued; only the softmax waits for the tensor cores.
        if t_start < t_end:
            _fill(t_start, 0, k_s, kr_s, nt_q, t_lo, bt_row, q_hi, n_s, n_p, slot, cc_ptr, cs_ptr, cz_ptr, rc_ptr,
                  rs_ptr, rz_ptr, pc_ptr, pr_ptr, DC, DR, C_KIND, C_BITS, C_GROUP, C_GB, C_SCALED, R_KIND, R_BITS,
                  R_GROUP, R_GB, R_SCALED, C_ROW, C_SZ_ROW, R_ROW, R_SZ_ROW, PAGE, SINK, C_RING, R_RING, LC, LR,
                  LPC, LPR)
            fence_async_shared()
            _barrier()
            s = warpgroup_mma_wait(0, deps=[_scores(q_s, qr_s, k_s, kr_s, 0, S_L)])
            p, alpha, m_i, l_i = _softmax(s, t_start, nt_q, t_lo, q_hi, n_p, qk_scale, m_i, l_i, SINK, S_L)
            p_s.store(p.to(gl.float16))
            fence_async_shared()
            _barrier()
        for t in range(t_start, t_end):
            i = (t - t_start) % 2
            o_run = warpgroup_mma(p_s, k_s.index(i), o, is_async=True)
            if t + 1 < t_end:
                # the other buffer was last read by tile t - 1's MMAs, which every warp has waited for
                _fill(t + 1, 1 - i, k_s, kr_s, nt_q, t_lo, bt_row, q_hi, n_s, n_p, slot, cc_ptr, cs_ptr, cz_ptr,
                      rc_ptr, rs_ptr, rz_ptr, pc_ptr, pr_ptr, DC, DR, C_KIND, C_BITS, C_GROUP, C_GB, C_SCALED,
                      R_KIND, R_BITS, R_GROUP, R_GB, R_SCALED, C_ROW, C_SZ_ROW, R_ROW, R_SZ_ROW, PAGE, SINK, C_RING,
                      R_RING, LC, LR, LPC, LPR)
                if t + PF_AHEAD < nt_q:
                    _prefetch_tile(t + PF_AHEAD, t_lo, bt_row, cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr, C_ROW,
                                   C_SZ_ROW, R_ROW, R_SZ_ROW, DC * C_BITS // 8, DR * R_BITS // 8, PAGE, PF)
                fence_async_shared()
                _barrier()
                s_run = _scores(q_s, qr_s, k_s, kr_s, 1 - i, S_L)
                o = warpgroup_mma_wait(1, deps=[o_run])  # groups complete in order: tile t's P . K is done
                s = warpgroup_mma_wait(0, deps=[s_run])
                p, alpha, m_i, l_i = _softmax(s, t + 1, nt_q, t_lo, q_hi, n_p, qk_scale, m_i, l_i, SINK, S_L)
                _barrier()  # both warpgroups' MMAs that read p_s are done
                p_s.store(p.to(gl.float16))
                fence_async_shared()
                _barrier()
                o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            else:
                o = warpgroup_mma_wait(0, deps=[o_run])

        ok = l_i > 0
        l_safe = gl.where(ok, l_i, 1.0)
        lse = gl.where(ok, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        out = o / gl.convert_layout(l_safe, gl.SliceLayout(1, O_L))[:, None]
        ho = gl.arange(0, 64, layout=gl.SliceLayout(1, O_L))
        do = gl.arange(0, DC, layout=gl.SliceLayout(0, O_L))
        row = (b * num_splits + split) * H + h0 + ho
        write = (h0 + ho < H) & (busy | (num_splits == 1))  # the combine skips an empty split's output
        gl.store(o_ptr + row[:, None] * DC + do[None, :], out.to(o_ptr.dtype.element_ty), mask=write[:, None])
        hl = gl.arange(0, 64, layout=gl.SliceLayout(1, S_L))
        gl.store(lse_ptr + (b * num_splits + split) * H + h0 + hl, lse, mask=h0 + hl < H)


# ---------------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------------


def _path_consts(path) -> tuple[int, int, int, int, bool]:
    """(KIND, BITS, GROUP, GB, SCALED) of a path: GB is the bytes of codes per group (bf16: one group of dim
    elements)."""
    f = path.fmt
    kind = KINDS[f.kind]
    if kind == 0:
        return 0, 16, path.dim, path.dim, False
    group = f.group or path.dim
    return kind, f.bits, group, group * f.bits // 8, path.scale is not None


def unsupported_reason(cache: PagedMLACache, num_heads: int, device) -> str | None:
    """None when `mla_decode_many_heads` can run this cache, head count and device; else why not."""
    if gluon is None:
        return f"triton.experimental.gluon is not available ({_GLUON_ERROR})"
    dc, dr = cache.kv_lora_rank, cache.rope_dim
    if dc & (dc - 1) or dr & (dr - 1) or dc < 64 or dr < 16 or dc > 512 or dr > 128:
        return f"needs power-of-two dims, kv_lora_rank 64..512 and rope 16..128, got {dc}/{dr}"
    for name, path in (("content", cache.content), ("rope", cache.rope)):
        f = path.fmt
        if f.kind not in KINDS or path.block > 1 or f.axis == "token" or f.rank:
            return f"does not read a {name} path stored as {f}"
        if f.kind == "bf16" and name == "content":
            return "does not read a bf16 content path (the Triton kernel does)"
        group = f.group or path.dim
        if f.kind != "bf16" and (group & (group - 1) or group * f.bits < 32):
            return f"needs {name} groups of a power of two, at least 4 bytes of codes, got {f}"
        if (why := path.row_layout_problem(row_align=4, base_align=16)) is not None:
            return why
    if num_heads < 1:
        return f"needs at least one head, got {num_heads}"
    from quantmla.kernels.mla_decode_gluon import hopper_reason

    return hopper_reason(cache, device)


def tiles_walked(length: int, sink: int, recent: int) -> int:
    """Tiles of 64 rows the kernel walks for a sequence of `length` tokens: its quantized body's tiles (counted
    from the sink's tile, as the kernel does) and its protected rows' (sink + ring)."""
    q_hi = sink + max(length - recent - sink, 0)
    body = (q_hi + 63) // 64 - sink // 64 if q_hi > sink else 0
    protected = min(length, sink) + max(length - q_hi, 0)
    return body + -(-protected // 64)


def split_length(batch: int, num_heads: int, num_sms: int, min_split: int = 256) -> tuple[int, int]:
    """(want, min_tiles): a sequence of `tiles` tiles (`tiles_walked`) is cut into splits of
    per = max(min_tiles, ceil(tiles / want)) tiles, split s taking tiles [s * per, (s + 1) * per): about one CTA
    per SM (one fits: 225 KB of shared memory), none shorter than min_split tokens, and the fewest splits of
    that length. The kernel applies it to each sequence's own length. Measured:
    benchmarks/results/decode_kernel_heads_split.md and decode_kernel_heads_history.md (min_split)."""
    ctas = batch * -(-num_heads // BLOCK_H)
    return max(1, round(num_sms / max(ctas, 1))), -(-min_split // BLOCK_N)


def default_splits(batch: int, num_heads: int, max_seq_len: int, num_sms: int, min_split: int = 256,
                   sink: int = 0, recent: int = 0) -> int:
    """The splits of a sequence of max_seq_len tokens under `split_length` (the grid's split count; a shorter
    sequence leaves the splits past its tiles empty). sink / recent: the cache's."""
    want, min_tiles = split_length(batch, num_heads, num_sms, min_split)
    tiles = max(1, tiles_walked(max_seq_len, sink, recent))
    return -(-tiles // max(min_tiles, -(-tiles // want)))


def _code_layout(dim: int, group: int, bits: int, vec: int = 16):
    """[64 tokens, groups, bytes per group] codes over 8 warps: `vec` consecutive bytes per thread (at least 4:
    one PTX pack), the lanes of a warp along the bytes of one group, then along tokens. So each 16-byte store of
    the dequantized tile writes one 16-byte chunk of as many rows as possible, which the 128-byte swizzle of
    the tile puts in different banks (lanes along the groups instead write the same chunk of 8 groups of one
    row: an 8-way bank conflict)."""
    gb = group * bits // 8
    vec = min(gb, vec)
    lanes_b = min(gb // vec, 32)
    lanes_t = 32 // lanes_b
    warps_t = max(1, min(NUM_WARPS, 64 // lanes_t))
    return gl.BlockedLayout([1, 1, vec], [lanes_t, 1, lanes_b], [warps_t, NUM_WARPS // warps_t, 1], [2, 1, 0])


def _row_layout(dim: int):
    """bf16 rows [64, dim] over 8 warps, 8 consecutive elements (16 bytes) per thread."""
    vec = min(dim, 8)
    lanes_d = min(dim // vec, 32)
    return gl.BlockedLayout([1, vec], [32 // lanes_d, lanes_d], [NUM_WARPS, 1], [1, 0])


def _path_layout(path, dim: int):
    kind, bits, group, _, _ = _path_consts(path)
    if kind == 0:  # bf16 values: one group of dim elements, 8 (16 bytes) per thread
        return _code_layout(dim, dim, 8, vec=8)
    return _code_layout(dim, group, bits)


def _swizzle(dim: int) -> int:
    return min(128, 2 * dim)


def kernel_constexprs(cache: PagedMLACache) -> dict:
    """The launch's constexprs for `cache` (formats, strides, layouts), by name."""
    c, r = cache.content, cache.rope
    dc, dr = cache.kv_lora_rank, cache.rope_dim
    ck, cb, cg, cgb, cscaled = _path_consts(c)
    rk, rb, rg, rgb, rscaled = _path_consts(r)
    c_sz = c.scale.stride(1) if c.scale is not None else 0
    r_sz = r.scale.stride(1) if r.scale is not None else 0
    return dict(
        DC=dc, DR=dr, C_KIND=ck, C_BITS=cb, C_GROUP=cg, C_GB=cgb, C_SCALED=cscaled, R_KIND=rk, R_BITS=rb,
        R_GROUP=rg, R_GB=rgb, R_SCALED=rscaled, C_ROW=c.codes.stride(1), C_SZ_ROW=c_sz, R_ROW=r.codes.stride(1),
        R_SZ_ROW=r_sz,
        PAGE=cache.block_size, SINK=cache.sink, RECENT=cache.recent, C_RING=cache.rings[0], R_RING=cache.rings[1],
        S_L=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16]),
        O_L=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, dc // 2, 16]),
        LC=_path_layout(c, dc), LR=_path_layout(r, dr), LPC=_row_layout(dc), LPR=_row_layout(dr),
        Q_SL=gl.NVMMASharedLayout(swizzle_byte_width=_swizzle(dc), element_bitwidth=16, rank=2),
        QR_SL=gl.NVMMASharedLayout(swizzle_byte_width=_swizzle(dr), element_bitwidth=16, rank=2),
        P_SL=gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2),
        PF=gl.BlockedLayout([1, 1], [8, 4], [NUM_WARPS, 1], [1, 0]),
    )  # fmt: skip


def many_heads_launch(q_nope_absorbed, q_pe, cache: PagedMLACache, block_tables, seq_lens, slots, sm_scale: float,
                      num_splits: int, want: int, min_tiles: int, out_dtype: torch.dtype, variant: dict | None = None):
    """The launch `mla_decode_many_heads` makes (a `mla_decode.Launch`: arguments in the kernel's parameter
    order, constexprs included): num_splits is the grid's, (want, min_tiles) `split_length`'s; variant overrides
    VARIANT's constexprs. Apart from running it, so that `kernels.offline` compiles the very same launch."""
    from quantmla.kernels.mla_decode import Launch, launch_inputs

    B, H = q_nope_absorbed.shape[:2]
    qn, qp, slots, outputs = launch_inputs(q_nope_absorbed, q_pe, slots, num_splits, out_dtype)
    part_o, part_lse = outputs[2:]
    c, r = cache.content, cache.rope

    def ptrs(path):  # an absent scale / zero pool: the codes' pointer, never read
        return (path.codes, path.scale if path.scale is not None else path.codes,
                path.zero if path.zero is not None else path.codes)

    runtime = [qn, qp, *ptrs(c), *ptrs(r), cache.protected_content, cache.protected_rope, block_tables,
               block_tables.stride(0), seq_lens, slots, part_o, part_lse, H, num_splits, want, min_tiles,
               sm_scale * LOG2E]  # fmt: skip
    consts = {**kernel_constexprs(cache), **VARIANT, **(variant or {})}
    args = tuple(consts[p.name] if p.is_constexpr else runtime.pop(0) for p in _many_heads_kernel.params)
    return Launch((math.ceil(H / BLOCK_H), B, num_splits), args, dict(num_warps=NUM_WARPS), outputs)


def mla_decode_many_heads(
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
    num_sms: int | None = None,
    variant: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring. num_splits: None for `default_splits`. variant: experiments' overrides of
    VARIANT's constexprs, and "min_split" for `default_splits`. Raises ValueError naming what it does not
    support."""
    B, H, dc = q_nope_absorbed.shape
    dev = q_nope_absorbed.device
    why = unsupported_reason(cache, H, dev)
    if why is not None:
        raise ValueError(f"the many-heads decode kernel {why}")
    if q_pe.shape != (B, H, cache.rope_dim) or dc != cache.kv_lora_rank:
        raise ValueError(f"queries {tuple(q_nope_absorbed.shape)}/{tuple(q_pe.shape)} do not match the cache")
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if B else 0
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    variant = dict(variant or {})
    min_split = variant.pop("min_split", 256)
    if num_splits is None:  # sized for max_seq_len; each sequence takes `split_length` at its own length
        want, min_tiles = split_length(B, H, num_sms, min_split)
        num_splits = default_splits(B, H, max_seq_len, num_sms, min_split, cache.sink, cache.recent)
    else:  # a caller's num_splits holds for every sequence
        want, min_tiles = num_splits, 1
    from quantmla.kernels.mla_decode import combine_splits

    launch = many_heads_launch(q_nope_absorbed, q_pe, cache, block_tables, seq_lens, slots, sm_scale, num_splits,
                               want, min_tiles, out_dtype, variant)
    out, lse, part_o, part_lse = launch.outputs
    if B == 0:
        return out, lse
    _many_heads_kernel[launch.grid](*launch.args, **launch.options)
    combine_splits(part_o, part_lse, out, lse)
    return out, lse
