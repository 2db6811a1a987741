"""Hopper (sm_90) decode kernel for few heads over an INT4/INT4 paged cache, in Triton's Gluon, and its launcher.

Contract: the same as `quantmla.kernels.mla_decode.mla_decode` (which calls `mla_decode_gluon` when
$QUANTMLA_DECODE_KERNEL=gluon):
    mla_decode_gluon(q_nope_absorbed [B, H, dc], q_pe [B, H, dr] (bf16 or fp32), cache: PagedMLACache,
                     block_tables int32 [B, max_blocks], seq_lens int32 [B] (0 allowed), slots int32 [B] or None,
                     sm_scale, *, max_seq_len, out_dtype (fp32 or bf16), num_splits=None)
        -> out [B, H, dc] (out_dtype), lse [B, H] fp32 (natural log; -inf for an empty sequence).
No host syncs when max_seq_len is given: CUDA-graph capturable (compile outside the capture).

What it takes (`unsupported_reason` names the first thing that is not; the launcher raises ValueError with it):
  - a CUDA device of compute capability 9.x (wgmma), Triton 3.6-3.9 with `triton.experimental.gluon`
    (TRITON_VERSIONS);
  - H <= 16 (heads are padded to 16: one CTA reads the cache once for all of them);
  - content int4, channel axis, group 64, kv_lora_rank 512; rope int4, channel axis, group 64, 64 rope dims;
  - pages of a multiple of 64 tokens; bf16 protected rows (sink + ring) contiguous; pools of whole contiguous
    rows (row strides may exceed the widths, as in vLLM's packed rows) with 8-byte aligned code rows.
Everything else goes to the Triton kernel (`mla_decode`'s default).

Design (one CTA = one warpgroup of 4 warps = (split, sequence); body tiles are 64 consecutive pool rows of
one page; the tile arithmetic, split rule, protected-row addressing and the combine are the Triton kernel's):
  - scores: S^T [64 tokens x 16 heads] with the tokens as the M dimension of `warpgroup_mma` (m64n16k16), one
    K chunk per 64-channel scale group (8 content + 1 rope). The A operand is the register fragment
    (DotOperandLayout of the v3 MMA layout), made straight from the codes: each thread loads whole 8-byte
    words (LDG.64: two tokens x 8 bytes of each group) and 4 `and`s + 1 `shr` per 4-byte word turn them into
    fp16 pairs (`_SCORES_PTX`): the low nibble as the subnormal code * 2^-24, the high nibble as
    16 * code * 2^-24 (no offset, no int->float conversion). Which channel each fragment element holds is a
    fixed permutation inside the group (`scores_channel`); Q^T is staged once per CTA in shared memory in
    that order (fp16, the high-nibble channels times 1/16) as the B operand. Scale and zero are applied after
    the MMA in fp32: S = sum_g (qk_scale * 2^24 * scale[t, g]) * acc_g + sum_g zero[t, g] * qk_scale * qsum_g,
    the second sum one more small MMA (A = the zeros, fp16 exact, B = qk_scale * sum of q over each group,
    split in fp16 high + low parts);
  - values: O^T [512 channels x 16 heads] += C^T [512 x 64 tokens] . P^T [64 tokens x 16 heads] as 8
    m64n16k16 x 4 MMAs (M = channels, 8 tiles of 64), P^T (fp16) in shared memory as B. The A fragments pair
    two tokens per 32-bit register; each thread loads 8 contiguous code bytes (16 channels) of each of its 16
    tokens (LDG.64, L1/L2 hits: the scores side read the same bytes), `prmt` pairs the two tokens' bytes and
    one `lop3` per register puts a nibble into fp16 1024 + code (`_VALUES_PTX`); `sub` + `fma` (f16x2) apply
    the tokens' scale and zero (`values_channel` is the row -> channel permutation, undone on the store);
  - no dequantized tile ever goes through shared memory; the permutations and layout changes are all free
    register relabelings (`gl.convert_layout(..., assert_trivial=True)` checks that at compile time);
  - online softmax in base 2 (running max / sum per head), protected BF16 rows (sink + ring) through the same
    MMAs with the fragments loaded from bf16 rows, split-K over `num_splits` merged by the Triton
    `_combine_kernel`, lse out.
  - protected rows (PROT_VEC, env QUANTMLA_GLUON_PROT_VEC=0 for the old 2-byte gathers): each thread's fragment
    elements are contiguous in memory (scores: channels 16t..16t+15 of a group for its 2 tokens; values:
    channels 16R..16R+15 for its 16 tokens), so they load as LDG.128 (68 per thread and tile instead of 544
    LDG.U16) in layouts `_LPS` / `_LPV` and become the fragments by reshape / permute / split / join
    relabellings (assert_trivial) and one PTX per two words (`_BF16_PAIR_PTX`: widen, cvt, re-pair into the
    fragment's register pairs; x 16 on the high-nibble columns for the scores); invalid tokens read the last
    valid row (no masks; p = 0 drops them). PROT_PREFETCH (env QUANTMLA_GLUON_PROT_PREFETCH=0 off) issues
    prefetch.global.L2 of the CTA's protected tiles at kernel start, so they arrive while the body loop runs.
    `emulate_prot_scores_fragment` / `emulate_prot_values_fragments` mirror the relabelling chains on the CPU.
  - the codes of each body tile (content [8 groups, 64 tokens, 32 B], rope [64, 32 B]) are copied by cp.async
    (16 B per thread and copy) into a shared-memory ring of STAGES slots, STAGES - 1 tiles ahead (one commit
    group per tile; tiles past the split's end copy nothing); the scores and values fragments read the same
    bytes from there (LDS.64) instead of global memory. STAGES=0 (env QUANTMLA_GLUON_STAGES=0) keeps the old
    direct loads; default 3. The content scales ([64, 8] fp16) ride in the ring too (the scores read them
    by LDS.U16); the zeros, the rope scale and the values' scale/zero gathers still load from global memory;
  - the scores MMAs are issued async, one group ahead (`warpgroup_mma_wait(1)`), so group g's MMA runs while
    group g-1 is scaled into S; the O^T accumulators are rescaled only on tiles where some head's max grew.
The fragment index maps are mirrored in plain torch (`emulate_scores_fragment`, `emulate_values_fragments`,
`emulate_body_tile`, `stage_q`): tests/test_mla_decode_gluon.py checks them element by element against
`scores_channel` / `values_channel` and assembles a whole decode from emulated tiles against
`mla_decode_reference` on the CPU, so the maps are tested without a GPU.
`DENORM=False` (env QUANTMLA_GLUON_DENORM=0, or denorm=False) replaces the subnormal scores fragments by
(1024 + code) - 1024 (exact, 4 more f16x2 subtractions per word), should a device flush fp16 subnormals in wgmma.

Status: opt-in. Scores come from exact codes and fp32 scales; where it is faster than the Triton INT4 kernel
(many tiles per CTA) and slower, and its error against it: benchmarks/results/decode_kernel_gluon_prot.md.
Queries and protected rows go to the tensor cores in fp16 (Triton's kernel: bf16), so values beyond fp16's
range (65504) would overflow here. Offline SASS counts per loop:
`python benchmarks/kernel_sass.py --kernel gluon` (no GPU needed).
"""

from __future__ import annotations

import math
import os

import torch

from quantmla.cache.paged import PagedMLACache

LOG2E = 1.4426950408889634
DC, DR, GROUP, BLOCK_N, BLOCK_H = 512, 64, 64, 64, 16
NUM_WARPS = 4
# Triton releases [first, past the last) both Gluon kernels (this one and mla_decode_many_heads) are built for:
# 3.6 runs them on the H200 (tests, benchmarks); 3.7.1, 3.8.0 and 3.9.0 compile them for sm_90 offline
# (tests/test_kernel_compile.py compiles them with the installed release; on 3.9.0 the many-heads kernel spills
# 184 bytes, and this one uses 40-72 bytes of stack on all four). Gluon is experimental and its API changes
# between releases, so other releases are refused and "auto" leaves them to the other kernels.
TRITON_VERSIONS = ((3, 6), (3, 10))

try:  # Gluon is experimental (TRITON_VERSIONS); elsewhere the module imports and refuses to launch
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    # one barrier of the CTA's threads: `thread_barrier` in Triton 3.6, `barrier` from 3.7 on
    _barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
    # cp.async of a tensor of pointers into shared memory: renamed `async_load` (same arguments) from 3.7 on
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _GLUON_ERROR = None
except Exception as e:  # pragma: no cover - exercised where gluon is missing or different
    gluon = None
    _GLUON_ERROR = f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------------------------------------------------
# Index maps (plain Python, shared by the kernel's Q staging, its output store and the torch emulation)
# ---------------------------------------------------------------------------------------------------------


def scores_channel(k: int) -> tuple[int, bool]:
    """Scores fragment column k (0..63 of a group's K chunk) -> (channel within the group, high nibble).

    k's bits (LSB first) are (e, t0, t1, h, s0, s1): e the fp16 within a register, t the lane's quad index,
    h/s register bits. The thread with quad index t holds bytes 8t..8t+7 of the group's 32 bytes; the PTX
    puts byte (b with bits 0 and 1 swapped) at logical byte b, and the join adds the nibble as h."""
    e, t0, t1, h, s0, s1 = ((k >> i) & 1 for i in range(6))
    return h + 2 * s0 + 4 * e + 8 * s1 + 16 * t0 + 32 * t1, bool(h)


def values_channel(j: int, m: int) -> int:
    """Values tile j (0..7), row m (0..63) -> content channel (0..511): row m = r + 8n + 16w (r = lane // 4,
    n = register half, w = warp) is nibble n of byte j of the thread's 8-byte block R = r + 8w."""
    r, n, w = m & 7, (m >> 3) & 1, m >> 4
    return 16 * (r + 8 * w) + 2 * j + n


SCORES_PERM = [scores_channel(k)[0] for k in range(GROUP)]
SCORES_HI = [scores_channel(k)[1] for k in range(GROUP)]


# ---------------------------------------------------------------------------------------------------------
# Torch emulation of one tile (CPU, exact same operations on the same fragments)
# ---------------------------------------------------------------------------------------------------------


def _scores_ptx_emu(words: torch.Tensor, denorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`_SCORES_PTX` on the 4 bytes of each pack [..., 4] (int64) -> (lo, hi) [..., 4] float64: pack element i
    holds byte (0, 2, 1, 3)[i]; lo = code, hi = 16 * code, both times 2^-24 with denorm (subnormal fp16)."""
    sig = [0, 2, 1, 3]
    lo = torch.stack([words[..., i] & 15 for i in sig], -1).double()
    hi = torch.stack([(words[..., i] >> 4) * 16 for i in sig], -1).double()
    f = 2.0**-24 if denorm else 1.0
    return lo * f, hi * f


def emulate_scores_fragment(codes: torch.Tensor, denorm: bool = True) -> torch.Tensor:
    """codes [64 tokens, 32 bytes] (one group; any integer dtype) -> the kernel's scores A fragment
    [64 tokens, 64 k] float64, by the kernel's own chain (`_scores_frag`: PTX, join, reshape, permute)."""
    u = codes.long().view(64, 8, 4)  # a pack = 4 consecutive bytes (the layout's first two register bits)
    lo, hi = _scores_ptx_emu(u, denorm)
    v = torch.stack([lo.reshape(64, 32), hi.reshape(64, 32)], -1)  # gl.join: [64, 32, 2]
    return v.reshape(64, 2, 2, 2, 2, 2, 2).permute(0, 3, 4, 6, 1, 2, 5).reshape(64, 64)


def _values_split_emu(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_values_split` in torch: [64, 256] -> (a0, a1, b0, b1), each [32 p, 32 R, 4]."""
    v = v.reshape(32, 2, 256).permute(0, 2, 1)
    va, vb = v[..., 0], v[..., 1]
    va = va.reshape(32, 32, 2, 4).permute(0, 1, 3, 2)
    vb = vb.reshape(32, 32, 2, 4).permute(0, 1, 3, 2)
    return va[..., 0], va[..., 1], vb[..., 0], vb[..., 1]


def emulate_values_fragments(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                             valid: torch.Tensor) -> torch.Tensor:
    """One body tile's values A fragments the kernel's way: codes [64 tokens, 256 bytes], scale / zero
    [64, 8] (float), valid [64] bool -> [8 tiles j, 64 rows m, 64 tokens] float64 (code * scale + zero, 0 for
    invalid tokens), through the same split / PTX / join / permute chain and the same scale-pair indexing as
    `_values_frag` (fp16 rounding is not modelled)."""
    tok = torch.arange(64)[:, None]
    byt = torch.arange(256)[None, :]
    tk = tok + (byt & 1)
    ok = _values_split_emu(valid[tk.clamp(max=63)] & (tk < 64))[0]
    grp = _values_split_emu((byt // 32).expand(64, 256))[0]
    tka = _values_split_emu(tk.clamp(max=63))[0]
    sv = torch.where(ok, scale.double()[tka, grp], torch.zeros((), dtype=torch.float64))
    zv = torch.where(ok, zero.double()[tka, grp], torch.zeros((), dtype=torch.float64))
    s_pair = sv[..., :2]  # PTX operand $6 = pack elements 0, 1
    z_pair = zv[..., :2]
    a0, a1, b0, b1 = _values_split_emu(codes.long())
    out = torch.zeros(8, 64, 64, dtype=torch.float64)
    for j2, (wa, wb) in enumerate(((a0, b0), (a1, b1))):
        for u in range(2):
            # prmt: [a_{2u}, a_{2u+1}, b_{2u}, b_{2u+1}]; register j1 = (nibble of a_{2u+j1}, of b_{2u+j1})
            x = torch.stack([wa[..., 2 * u], wb[..., 2 * u], wa[..., 2 * u + 1], wb[..., 2 * u + 1]], -1)
            half = torch.tensor([0, 1, 0, 1])  # pack element -> f16x2 half (token a / b)
            lo = (x & 15).double() * s_pair[..., half] + z_pair[..., half]
            hi = (x >> 4).double() * s_pair[..., half] + z_pair[..., half]
            y = torch.stack([lo, hi], -1)  # gl.join: [32, 32, 4, 2]
            y = y.reshape([2] * 13).permute(5, 6, 12, 7, 8, 9, 0, 1, 2, 3, 4, 11, 10).reshape(64, 64, 2)
            for j1 in range(2):
                out[j1 + 2 * u + 4 * j2] = y[..., j1]
    return out


def _bf16_pair_emu(x: torch.Tensor, y: torch.Tensor, mul1: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`_BF16_PAIR_PTX` on packs of 2 along the last dim: x = (x0, x1), y = (y0, y1) -> (x0, y0), (x1, y1) * mul1."""
    x, y = x.double(), y.double()
    o0 = torch.stack([x[..., 0::2], y[..., 0::2]], -1).flatten(-2)
    o1 = torch.stack([x[..., 1::2], y[..., 1::2]], -1).flatten(-2) * mul1
    return o0, o1


def emulate_prot_scores_fragment(x: torch.Tensor) -> torch.Tensor:
    """Protected rows x [64 tokens, 64 channels of a group] -> the scores A fragment [64, 64] float64 by the
    kernel's chain (`_prot_scores_vec`: permute, split, re-pairing PTX with x 16 on odd channels, join, permute)."""
    x = x.double().reshape(64, 2, 2, 2, 2, 2, 2).permute(0, 1, 2, 3, 5, 6, 4)
    y0, y1 = _bf16_pair_emu(x[..., 0], x[..., 1], 16.0)
    y = torch.stack([y0, y1], -1).permute(0, 3, 4, 6, 1, 2, 5)
    return y.reshape(64, 64)


def emulate_prot_values_fragments(x: torch.Tensor) -> torch.Tensor:
    """Protected rows x [64 tokens, 512] -> the values A fragments [8 tiles J, 64 rows m, 64 tokens] float64 by
    the kernel's chain (`_prot_values_vec`, both halves: channel 16R + 8 half + c, split the token pairs,
    re-pairing PTX, join, relabel, split twice)."""
    out = []
    for half in range(2):
        xh = x.double().reshape(64, 32, 16)[:, :, 8 * half: 8 * half + 8]
        xh = xh.reshape(32, 2, 32, 8).permute(0, 2, 3, 1)
        y0, y1 = _bf16_pair_emu(xh[..., 0], xh[..., 1])
        y = torch.stack([y0, y1], -1).reshape(32, 4, 8, 2, 2, 2, 2).permute(1, 6, 2, 0, 5, 3, 4).reshape(64, 64, 2, 2)
        ya, yb = y[..., 0], y[..., 1]  # gl.split: j0
        out += [ya[..., 0], yb[..., 0], ya[..., 1], yb[..., 1]]  # f0, f1, f2, f3
    return torch.stack(out)


def stage_q(qn: torch.Tensor, qp: torch.Tensor) -> torch.Tensor:
    """Q^T as the kernel stages it: [9 chunks, 64 k, H] float64 of fp16 q[channel(k)] (times 1/16 on the
    high-nibble columns); qn [H, 512], qp [H, 64]."""
    perm = torch.tensor(SCORES_PERM)
    f = torch.tensor([1 / 16 if hi else 1.0 for hi in SCORES_HI], dtype=torch.float64)
    chunks = [qn[:, 64 * g: 64 * g + 64] for g in range(8)] + [qp]
    return torch.stack([(c.float()[:, perm].double() * f).half().double().T for c in chunks])


def emulate_body_tile(q16: torch.Tensor, c_codes, c_scale, c_zero, r_codes, r_scale, r_zero, valid,
                      qk_scale: float, denorm: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Scores S [64 tokens, H] (base 2, -inf where not valid) and the values fragments of one body tile the
    kernel's way, in float64: q16 = `stage_q(...)`, content codes [64, 256] / scale, zero [64, 8], rope codes
    [64, 32] / scale, zero [64, 1], valid [64] bool."""
    f = torch.tensor([1 / 16 if hi else 1.0 for hi in SCORES_HI], dtype=torch.float64)
    H = q16.shape[-1]
    S = torch.zeros(64, H, dtype=torch.float64)
    for g in range(9):
        if g < 8:
            codes, sc, zr = c_codes[:, 32 * g: 32 * g + 32], c_scale[:, g], c_zero[:, g]
        else:
            codes, sc, zr = r_codes, r_scale[:, 0], r_zero[:, 0]
        acc = emulate_scores_fragment(codes, denorm) @ q16[g]
        S += acc * (sc.double() * qk_scale * (2.0**24 if denorm else 1.0))[:, None]
        qsum = (q16[g] / f[:, None]).sum(0) * qk_scale
        S += zr.double()[:, None] * qsum[None, :]  # the zero-term MMA (fp16 high + low split: ~exact)
    S = torch.where(valid[:, None], S, torch.tensor(-math.inf, dtype=torch.float64))
    return S, emulate_values_fragments(c_codes, c_scale, c_zero, valid)


# ---------------------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------------------

if gluon is not None:
    _MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16]))
    _DOA = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA.value, k_width=2))
    # Scores codes [64 tokens, 32 bytes of a group]: thread (warp w, lane l) holds tokens 16w + l//4 (+8) and
    # bytes 8(l%4) .. +7: the v3 A fragment's rows and, after the nibble split, its 16 K values.
    _LU = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]], lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 32]))
    # Values codes [64 tokens, 256 bytes]: thread holds bytes 8R..8R+7 (R = l//4 + 8w) of its 16 tokens
    # (token bits 1, 2 from the lane's quad index, 0 and 3..5 from registers): the A fragment's K (tokens).
    _LV = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [8, 0], [16, 0], [32, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 8], [0, 16], [0, 32]],
        warp_bases=[[0, 64], [0, 128]], block_bases=[], shape=[64, 256]))
    # The same values codes as [8 groups, 64 tokens, 32 bytes] (the shared-memory ring's order): _LV relabelled.
    _LV3 = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 8, 0], [0, 16, 0], [0, 32, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 8], [0, 0, 16], [1, 0, 0]],
        warp_bases=[[2, 0, 0], [4, 0, 0]], block_bases=[], shape=[8, 64, 32]))
    # cp.async of one tile: 16 bytes per thread and copy; content [8, 64, 32] (8 copies), rope [64, 32] (1)
    _CPC = gl.constexpr(gl.BlockedLayout([1, 1, 16], [1, 16, 2], [1, 4, 1], [2, 1, 0]))
    _CPR = gl.constexpr(gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0]))
    _CPS = gl.constexpr(gl.BlockedLayout([1, 8], [32, 1], [2, 2], [1, 0]))  # scale / zero rows [64, 8] fp16
    # one group's scales [64, 1] as the MMA rows hold them (reshaped: SliceLayout(1, _MMA))
    _LS1 = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]],
        block_bases=[], shape=[64, 1]))
    # the ring: [STAGES, 8 groups, 64 tokens, 32 bytes] and [STAGES, 64, 32], unswizzled (a group's 64 x 32 B
    # rows are contiguous: the scores' LDS.64 of 8 tokens x 32 B are conflict-free)
    _RING_C = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    _RING_R = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    _QSL = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2))
    _BLQ = gl.constexpr(gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0]))  # [64, 16] staging of Q chunks

    # Scores: word of 4 code bytes -> lo (2 regs), hi (2 regs); element i of a pack holds byte (0,2,1,3)[i].
    _SCORES_PTX = gl.constexpr("""{
.reg .b32 t;
shr.b32 t, $4, 8;
and.b32 $0, $4, 0x000F000F;
and.b32 $1, t, 0x000F000F;
and.b32 $2, $4, 0x00F000F0;
and.b32 $3, t, 0x00F000F0;
}""")
    _SCORES_PTX_MAGIC = gl.constexpr("""{
.reg .b32 t, m;
mov.b32 m, 0x64006400;
shr.b32 t, $4, 8;
lop3.b32 $0, $4, 0x000F000F, m, 0xEA;
lop3.b32 $1, t, 0x000F000F, m, 0xEA;
lop3.b32 $2, $4, 0x00F000F0, m, 0xEA;
lop3.b32 $3, t, 0x00F000F0, m, 0xEA;
sub.f16x2 $0, $0, m;
sub.f16x2 $1, $1, m;
sub.f16x2 $2, $2, m;
sub.f16x2 $3, $3, m;
}""")
    # Values: words of tokens a ($4) and b ($5), scale pair (s_a, s_b) ($6) and zero pair ($8) -> dequantized
    # (nibble of a, nibble of b) fp16 pairs of bytes 0,1 (U = 0) or 2,3 (U = 1) of the words: the low nibble
    # as fp16 1024 + code (0x6400 | code), the high one as 64 + code (0x5400 | code << 4), minus the magic
    # (exact), then code * scale + zero (one rounding).
    _VALUES_PTX_0 = gl.constexpr("""{
.reg .b32 x, y, m, n, t;
mov.b32 m, 0x64006400;
mov.b32 n, 0x54005400;
prmt.b32 x, $4, $5, 0x5410;
shr.b32 y, x, 8;
lop3.b32 t, x, 0x000F000F, m, 0xEA;
sub.f16x2 t, t, m;
fma.rn.f16x2 $0, t, $6, $8;
lop3.b32 t, y, 0x000F000F, m, 0xEA;
sub.f16x2 t, t, m;
fma.rn.f16x2 $1, t, $6, $8;
lop3.b32 t, x, 0x00F000F0, n, 0xEA;
sub.f16x2 t, t, n;
fma.rn.f16x2 $2, t, $6, $8;
lop3.b32 t, y, 0x00F000F0, n, 0xEA;
sub.f16x2 t, t, n;
fma.rn.f16x2 $3, t, $6, $8;
}""")
    _VALUES_PTX_1 = gl.constexpr(_VALUES_PTX_0.value.replace("0x5410", "0x7632"))
    @gluon.jit
    def _scores_frag(u, DENORM: gl.constexpr):
        """codes [64, 32] (layout _LU) -> fp16 A fragment [64, 64] (_DOA), columns in `scores_channel` order."""
        ptx: gl.constexpr = _SCORES_PTX if DENORM else _SCORES_PTX_MAGIC
        lo, hi = gl.inline_asm_elementwise(ptx, "=r,=r,=r,=r,r", [u], dtype=(gl.float16, gl.float16), is_pure=True,
                                           pack=4)
        v = gl.join(lo, hi)
        v = gl.reshape(v, [64, 2, 2, 2, 2, 2, 2])
        v = gl.permute(v, [0, 3, 4, 6, 1, 2, 5])
        v = gl.reshape(v, [64, 64])
        return gl.convert_layout(v, _DOA, assert_trivial=True)

    @gluon.jit
    def _values_split(v):
        """[64 tokens, 256 bytes] (_LV) -> tokens 2p (a) / 2p+1 (b), bytes 0-3 (0) / 4-7 (1) of each thread's
        8-byte block, as [32 p, 32 R, 4] tensors (the 4 bytes of a word last: one PTX pack): (a0, a1, b0, b1)."""
        v = gl.permute(gl.reshape(v, [32, 2, 256]), [0, 2, 1])
        va, vb = gl.split(v)
        va0, va1 = gl.split(gl.permute(gl.reshape(va, [32, 32, 2, 4]), [0, 1, 3, 2]))
        vb0, vb1 = gl.split(gl.permute(gl.reshape(vb, [32, 32, 2, 4]), [0, 1, 3, 2]))
        return va0, va1, vb0, vb1

    @gluon.jit
    def _values_frag(wa, wb, sv, zv, U: gl.constexpr):
        """Words of tokens 2p / 2p+1 [32, 32, 4] and their scale / zero (sv, zv: element j0 of a pack is token
        2p + j0) -> the dequantized fragments of tiles j = 2U + 4 j2 (+1): [64 rows, 64 tokens] fp16 (_DOA)."""
        ptx: gl.constexpr = _VALUES_PTX_0 if U == 0 else _VALUES_PTX_1
        lo, hi = gl.inline_asm_elementwise(ptx, "=r,=r,=r,=r,r,r,r,r,r,r", [wa, wb, sv, zv],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
        x = gl.join(lo, hi)  # [32 p, 32 R, 4 (j1 j0), 2 n]
        x = gl.reshape(x, [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])
        x = gl.permute(x, [5, 6, 12, 7, 8, 9, 0, 1, 2, 3, 4, 11, 10])
        x = gl.reshape(x, [64, 64, 2])
        a0, a1 = gl.split(x)
        return gl.convert_layout(a0, _DOA, assert_trivial=True), gl.convert_layout(a1, _DOA, assert_trivial=True)

    @gluon.jit
    def _softmax(S, valid, m_i, l_i):
        """One tile of the online softmax (base 2): p, alpha = exp2(m_old - m_new), whether any head's max
        grew (the accumulators need rescaling only then), the new max and sum."""
        S = gl.where(valid[:, None], S, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(S, 0))  # finite: every tile holds a valid token
        grew = gl.max(m_new - m_i, 0) > 0
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(S - m_new[None, :])
        l_i = l_i * alpha + gl.sum(p, 0)
        return p, alpha, grew, m_new, l_i

    @gluon.jit
    def _stage_p(p, p_s):
        """P^T (fp16) into shared memory as the values' B operand, visible to the async proxy of every warp."""
        _barrier()  # every warp is past the previous tile's MMAs (they read p_s)
        p_s.store(p.to(gl.float16))
        fence_async_shared()
        _barrier()

    @gluon.jit
    def _mma2(p_s, acc_a, acc_b, f):
        """acc + fragment . P^T for a pair of channel tiles (f: their two A fragments)."""
        fa, fb = f
        return warpgroup_mma(fa, p_s, acc_a), warpgroup_mma(fb, p_s, acc_b)

    @gluon.jit
    def _rescale(alpha, grew, a0, a1, a2, a3, a4, a5, a6, a7):
        """acc_j * alpha, only where some head's running max grew this tile (else alpha is exactly 1)."""
        if grew:
            al = alpha[None, :]
            a0 = a0 * al
            a1 = a1 * al
            a2 = a2 * al
            a3 = a3 * al
            a4 = a4 * al
            a5 = a5 * al
            a6 = a6 * al
            a7 = a7 * al
        return a0, a1, a2, a3, a4, a5, a6, a7

    @gluon.jit
    def _store_tile(o_ptr, row, hmask, acc, l_safe, J: gl.constexpr):
        m = gl.arange(0, 64, layout=gl.SliceLayout(1, _MMA))
        ch = 16 * ((m & 7) + 8 * (m >> 4)) + 2 * J + ((m >> 3) & 1)
        out = acc / l_safe[None, :]
        gl.store(o_ptr + row[None, :] * 512 + ch[:, None], out.to(o_ptr.dtype.element_ty), mask=hmask[None, :])

    @gluon.jit
    def _prot_scores_frag(ptr, rows, valid, CH0: gl.constexpr, DIM: gl.constexpr):
        """Protected bf16 rows -> scores A fragment of the group at channel CH0 (times 16 on high-nibble
        columns, so the same Q^T applies), fp16 [64, 64] (_DOA)."""
        k = gl.arange(0, 64, layout=gl.SliceLayout(0, _DOA))
        e = k & 1
        t = (k >> 1) & 3
        h = (k >> 3) & 1
        s = k >> 4
        ch = h + 2 * (s & 1) + 4 * e + 8 * (s >> 1) + 16 * t
        x = gl.load(ptr + rows[:, None] * DIM + CH0 + ch[None, :], mask=valid[:, None], other=0.0).to(gl.float32)
        x = gl.where(h[None, :] == 1, x * 16.0, x)
        return x.to(gl.float16)

    @gluon.jit
    def _prot_values_frag(ptr, rows, valid, J: gl.constexpr):
        m = gl.arange(0, 64, layout=gl.SliceLayout(1, _DOA))
        ch = 16 * ((m & 7) + 8 * (m >> 4)) + 2 * J + ((m >> 3) & 1)
        x = gl.load(ptr + rows[None, :] * 512 + ch[:, None], mask=valid[None, :], other=0.0)
        return x.to(gl.float16)

    # Protected bf16 rows, loaded so that each thread's fragment registers are contiguous in memory (LDG.128):
    # the scores chunk [64 tokens, 64 channels of a group]: the thread holds channels 16t..16t+15 (t = lane % 4)
    # of tokens 16w + l//4 (+8), the channels its `scores_channel` fragment columns need, in channel order.
    _LPS = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]], lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 64]))
    # the values half [64 tokens, 32 R, 8 c] (channel 16R + 8 half + c): the thread holds R = l//4 + 8w, 8
    # consecutive channels, of its 16 tokens (the A fragment's K: token bits 1, 2 from the lane, the rest regs)
    _LPV = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [1, 0, 0], [8, 0, 0], [16, 0, 0], [32, 0, 0]],
        lane_bases=[[2, 0, 0], [4, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[0, 8, 0], [0, 16, 0]], block_bases=[], shape=[64, 32, 8]))

    # Two bf16x2 words -> two f16x2 words, re-paired so that each output holds the fragment's register pair:
    # inputs x ($2) = (x0, x1), y ($3) = (y0, y1) -> $0 = (x0, y0), $1 = (x1, y1) (element 0 in the low half);
    # each bf16 widened to fp32 exactly (shl / and), one cvt per pair (round to nearest). The scores' variant
    # multiplies $1's pair by 16 in fp32 (exact): element 1 of an input is an odd channel (a high-nibble column).
    _BF16_PAIR_PTX = gl.constexpr("""{
.reg .b32 a, b;
shl.b32 a, $2, 16;
shl.b32 b, $3, 16;
cvt.rn.f16x2.f32 $0, b, a;
and.b32 a, $2, 0xFFFF0000;
and.b32 b, $3, 0xFFFF0000;
cvt.rn.f16x2.f32 $1, b, a;
}""")
    _BF16_PAIR_X16_PTX = gl.constexpr(_BF16_PAIR_PTX.value.replace(
        "cvt.rn.f16x2.f32 $1, b, a;",
        "mul.f32 a, a, 0f41800000;\nmul.f32 b, b, 0f41800000;\ncvt.rn.f16x2.f32 $1, b, a;"))

    @gluon.jit
    def _prot_scores_vec(ptr, rows, CH0: gl.constexpr, DIM: gl.constexpr):
        """`_prot_scores_frag` by contiguous loads: rows [64] in SliceLayout(1, _LPS); the [64, 64]
        channel-order chunk relabelled to the fragment (odd channels = high-nibble columns times 16)."""
        c = gl.arange(0, 64, layout=gl.SliceLayout(0, _LPS))
        x = gl.load(ptr + rows[:, None] * DIM + CH0 + c[None, :])  # unmasked: `_prot_rows` clamps the rows
        x = gl.reshape(x, [64, 2, 2, 2, 2, 2, 2])  # channel bits (MSB first) t1 t0 s1 e s0 h
        x0, x1 = gl.split(gl.permute(x, [0, 1, 2, 3, 5, 6, 4]))  # e = 0 / 1: [64, t1, t0, s1, s0, h]
        # words (h = 0, 1) of e = 0 and of e = 1 -> y0 = the pair (e = 0, 1) of h = 0, y1 = that of h = 1 (x 16)
        y0, y1 = gl.inline_asm_elementwise(_BF16_PAIR_X16_PTX, "=r,=r,r,r", [x0, x1],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=2)
        y = gl.join(y0, y1)  # [64, t1, t0, s1, s0, e, h]: the last-but-one index is now e, the joined one h
        y = gl.permute(y, [0, 3, 4, 6, 1, 2, 5])  # k bits (MSB first) s1 s0 h t1 t0 e
        return gl.convert_layout(gl.reshape(y, [64, 64]), _DOA, assert_trivial=True)

    @gluon.jit
    def _prot_values_vec(ptr, rows, HALF: gl.constexpr):
        """The values A fragments of tiles J = 4 HALF + 0..3 by contiguous loads (16 B per token and thread):
        rows [64] in SliceLayout(1, SliceLayout(2, _LPV)) -> 4 fp16 [64 rows m, 64 tokens] (_DOA)."""
        R = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, _LPV)))
        c = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, _LPV)))
        off = rows[:, None, None] * 512 + (16 * R[None, :, None] + 8 * HALF + c[None, None, :])
        x = gl.load(ptr + off)  # unmasked: `_prot_rows` clamps the rows
        x = gl.reshape(x, [32, 2, 32, 8])  # token = 2 p + tb
        xa, xb = gl.split(gl.permute(x, [0, 2, 3, 1]))  # tb = 0 / 1: [32 p, 32 R, 8 c]
        # words (n = 0, 1) of tokens 2p, 2p+1 -> y0 = the token pair of n = 0, y1 = that of n = 1
        y0, y1 = gl.inline_asm_elementwise(_BF16_PAIR_PTX, "=r,=r,r,r", [xa, xb], dtype=(gl.float16, gl.float16),
                                           is_pure=True, pack=2)
        y = gl.join(y0, y1)  # [32 p, 32 R, 8 (j1 j0 tb), 2 n]
        y = gl.reshape(y, [32, 4, 8, 2, 2, 2, 2])  # p, w, r, j1, j0, tb, n  (R = 8w + r)
        y = gl.permute(y, [1, 6, 2, 0, 5, 3, 4])  # m = (w, n, r), token = (p, tb), j1, j0
        y = gl.reshape(y, [64, 64, 2, 2])
        ya, yb = gl.split(y)  # j0 = 0 / 1
        f0, f2 = gl.split(ya)  # j1 = 0 / 1
        f1, f3 = gl.split(yb)
        return (gl.convert_layout(f0, _DOA, assert_trivial=True), gl.convert_layout(f1, _DOA, assert_trivial=True),
                gl.convert_layout(f2, _DOA, assert_trivial=True), gl.convert_layout(f3, _DOA, assert_trivial=True))

    @gluon.jit
    def _prot_rows(t, slot, n_s, n_p, q_hi, layout: gl.constexpr, SINK: gl.constexpr, RING: gl.constexpr):
        """Protected tile t's 64 row indices (in `layout`), the invalid tokens' clamped to the last valid one's
        (its finite values: the loads need no mask; the softmax gives those tokens p = 0)."""
        i = gl.minimum(t * 64 + gl.arange(0, 64, layout=layout), n_p - 1)
        p = gl.where(i < n_s, i, q_hi + i - n_s)
        return slot * (SINK + RING) + gl.where(p < SINK, p, SINK + (p - SINK) % (RING + (RING == 0)))

    _PF = gl.constexpr(gl.BlockedLayout([1, 1], [4, 8], [4, 1], [1, 0]))  # [64 tokens, 8 lines]: 4 per thread
    _PF1 = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))  # [64 tokens] (each on 2 threads)
    _PREFETCH_PTX = gl.constexpr("prefetch.global.L2 [$1];\nmov.b32 $0, 0;")

    @gluon.jit
    def _prefetch_prot(pc_ptr, pr_ptr, t0, t1, slot, n_s, n_p, q_hi, SINK: gl.constexpr, C_RING: gl.constexpr,
                       R_RING: gl.constexpr):
        """prefetch.global.L2 of protected tiles t0..t1-1 (content: 8 lines of 128 B per row, rope: 1), issued
        before the body loop so that the protected loop's loads hit L2."""
        ln = gl.arange(0, 8, layout=gl.SliceLayout(0, _PF))
        for t in range(t0, t1):
            rc = _prot_rows(t, slot, n_s, n_p, q_hi, gl.SliceLayout(1, _PF), SINK, C_RING)
            gl.inline_asm_elementwise(_PREFETCH_PTX, "=r,l", [pc_ptr + rc[:, None] * 512 + 64 * ln[None, :]],
                                      dtype=gl.int32, is_pure=False, pack=1)
            rr = _prot_rows(t, slot, n_s, n_p, q_hi, _PF1, SINK, R_RING)
            gl.inline_asm_elementwise(_PREFETCH_PTX, "=r,l", [pr_ptr + rr * 64], dtype=gl.int32, is_pure=False,
                                      pack=1)

    @gluon.jit
    def _issue_tile(cc_ptr, rc_ptr, cs_ptr, cs_s, bt_row, cc_s, rc_s, tn, t_stop, t_lo, C_ROW: gl.constexpr,
                    R_ROW: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, slot, C_SZ_ROW: gl.constexpr):
        """cp.async of body tile tn's content and rope codes and content scales into ring slot `slot`, one
        commit group; a tile at or past t_stop copies nothing (zero-fill, no global read), so every iteration
        commits one group."""
        ok = tn < t_stop
        pos0 = (gl.where(ok, tn, 0) + t_lo) * 64
        row0 = gl.load(bt_row + pos0 // PAGE, mask=ok, other=0).to(gl.int64) * PAGE + pos0 % PAGE
        lim = gl.where(ok, 64, 0)
        g3 = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, _CPC)))
        t3 = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, _CPC)))
        b3 = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, _CPC)))
        off3 = (t3[None, :, None] * C_ROW + 32 * g3[:, None, None]) + b3[None, None, :]
        _cp_async(cc_s.index(slot), cc_ptr + row0 * C_ROW + off3,
                                               mask=t3[None, :, None] < lim)
        t2 = gl.arange(0, 64, layout=gl.SliceLayout(1, _CPR))
        b2 = gl.arange(0, 32, layout=gl.SliceLayout(0, _CPR))
        offr = t2[:, None] * R_ROW + b2[None, :]
        _cp_async(rc_s.index(slot), rc_ptr + row0 * R_ROW + offr,
                                               mask=t2[:, None] < lim)
        ts = gl.arange(0, 64, layout=gl.SliceLayout(1, _CPS))
        gs = gl.arange(0, 8, layout=gl.SliceLayout(0, _CPS))
        offs = ts[:, None] * C_SZ_ROW + gs[None, :]
        _cp_async(cs_s.index(slot), cs_ptr + row0 * C_SZ_ROW + offs,
                                               mask=ts[:, None] < lim)
        async_copy.commit_group()

    @gluon.jit(do_not_specialize=["bt_stride", "H", "num_splits"])
    def _gluon_decode_kernel(
        qn_ptr, qp_ptr,  # [B, H, 512], [B, H, 64] bf16/fp32, contiguous
        cc_ptr, cs_ptr, cz_ptr,  # content codes uint8 / scale fp16 / zero fp16 pools
        rc_ptr, rs_ptr, rz_ptr,  # rope codes / scale / zero
        pc_ptr, pr_ptr,  # protected bf16 [slots, SINK + RING, 512] / [.., 64]
        bt_ptr, bt_stride, lens_ptr, slots_ptr,
        o_ptr, lse_ptr,  # [B, num_splits, H, 512], fp32 [B, num_splits, H]
        H, num_splits, qk_scale,
        C_ROW: gl.constexpr, C_SZ_ROW: gl.constexpr, R_ROW: gl.constexpr, R_SZ_ROW: gl.constexpr,
        PAGE: gl.constexpr, SINK: gl.constexpr, RECENT: gl.constexpr, C_RING: gl.constexpr, R_RING: gl.constexpr,
        DENORM: gl.constexpr, STAGES: gl.constexpr, PROT_VEC: gl.constexpr,
        PROT_PREFETCH: gl.constexpr,
    ):
        split = gl.program_id(0)
        b = gl.program_id(1)
        L = gl.load(lens_ptr + b)
        q_hi = SINK + gl.maximum(L - RECENT - SINK, 0)  # channel formats: positions [SINK, q_hi) quantized
        n_q = q_hi - SINK
        t_lo: gl.constexpr = SINK // 64
        nt_q = gl.where(n_q > 0, (q_hi + 63) // 64 - t_lo, 0)
        n_s = gl.minimum(L, SINK)
        n_p = n_s + gl.maximum(L - q_hi, 0)
        nt = nt_q + (n_p + 63) // 64
        per_split = (nt + num_splits - 1) // num_splits
        t_start = split * per_split
        t_end = gl.minimum(t_start + per_split, nt)
        if PROT_PREFETCH:  # first, so that the protected loop's loads (after the body loop) hit L2
            if SINK + C_RING + R_RING > 0:
                _prefetch_prot(pc_ptr, pr_ptr, gl.maximum(t_start, nt_q) - nt_q, t_end - nt_q,
                               gl.load(slots_ptr + b).to(gl.int64), n_s, n_p, q_hi, SINK, C_RING, R_RING)

        # --- Q^T in shared memory: 9 chunks [64 k, 16 heads] (scores_channel order), and the zero-term B ----
        q_s = gl.allocate_shared_memory(gl.float16, [8, 64, 16], _QSL)  # content chunks (power-of-two shapes)
        q_r = gl.allocate_shared_memory(gl.float16, [64, 16], _QSL)  # the rope chunk
        qk = gl.arange(0, 64, layout=gl.SliceLayout(1, _BLQ))
        qh = gl.arange(0, 16, layout=gl.SliceLayout(0, _BLQ))
        e = qk & 1
        t4 = (qk >> 1) & 3
        hb = (qk >> 3) & 1
        s4 = qk >> 4
        qch = hb + 2 * (s4 & 1) + 4 * e + 8 * (s4 >> 1) + 16 * t4
        fk = gl.where(hb == 1, 0.0625, 1.0)
        hm = qh < H
        bh = b * H + qh
        zk = gl.arange(0, 32, layout=gl.SliceLayout(1, _BLQ))
        bz = gl.zeros([32, 16], gl.float32, layout=_BLQ)
        for g in gl.static_range(9):
            if g < 8:
                q = gl.load(qn_ptr + bh[None, :] * 512 + 64 * g + qch[:, None], mask=hm[None, :], other=0.0)
            else:
                q = gl.load(qp_ptr + bh[None, :] * 64 + qch[:, None], mask=hm[None, :], other=0.0)
            q16 = (q.to(gl.float32) * fk[:, None]).to(gl.float16)
            if g < 8:
                q_s.index(g).store(q16)
            else:
                q_r.store(q16)
            qsum = gl.convert_layout(gl.sum(q16.to(gl.float32) / fk[:, None], 0) * qk_scale, gl.SliceLayout(0, _BLQ))
            q_hi16 = qsum.to(gl.float16).to(gl.float32)
            bz = gl.where(zk[:, None] == 2 * g, q_hi16[None, :], bz)
            bz = gl.where(zk[:, None] == 2 * g + 1, (qsum - q_hi16)[None, :], bz)
        z_s = gl.allocate_shared_memory(gl.float16, [32, 16], _QSL, bz.to(gl.float16))
        p_s = gl.allocate_shared_memory(gl.float16, [64, 16], _QSL)
        fence_async_shared()
        _barrier()

        # --- loop-invariant offsets in each layout ---------------------------------------------------------
        tokU = gl.arange(0, 64, layout=gl.SliceLayout(1, _LU))
        bytU = gl.arange(0, 32, layout=gl.SliceLayout(0, _LU))
        tokV = gl.arange(0, 64, layout=gl.SliceLayout(1, _LV))
        bytV = gl.arange(0, 256, layout=gl.SliceLayout(0, _LV))
        tokM = gl.arange(0, 64, layout=gl.SliceLayout(1, _MMA))
        # zero-term A [64 tokens, 32]: column k = 2 g + part (part: B's high / low fp16 half), g < 9
        zc = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.DotOperandLayout(0, _MMA, 2)))
        zg = zc >> 1
        tokZ = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.DotOperandLayout(0, _MMA, 2)))
        tokA = gl.arange(0, 64, layout=gl.SliceLayout(0, _DOA))
        sc_mul = qk_scale * 16777216.0 if DENORM else qk_scale

        zero_acc = gl.zeros([64, 16], gl.float32, layout=_MMA)
        a0 = zero_acc
        a1 = zero_acc
        a2 = zero_acc
        a3 = zero_acc
        a4 = zero_acc
        a5 = zero_acc
        a6 = zero_acc
        a7 = zero_acc
        m_i = gl.full([16], float("-inf"), gl.float32, layout=gl.SliceLayout(0, _MMA))
        l_i = gl.zeros([16], gl.float32, layout=gl.SliceLayout(0, _MMA))

        bt_row = bt_ptr + b.to(gl.int64) * bt_stride
        t_qend = gl.minimum(t_end, nt_q)
        if STAGES > 0:
            # the codes ring: tile t in slot (t - t_start) % STAGES, copied STAGES - 1 tiles ahead
            cc_s = gl.allocate_shared_memory(gl.uint8, [STAGES, 8, 64, 32], _RING_C)
            rc_s = gl.allocate_shared_memory(gl.uint8, [STAGES, 64, 32], _RING_R)
            cs_s = gl.allocate_shared_memory(gl.float16, [STAGES, 64, 8], _RING_R)
            for i in gl.static_range(STAGES - 1):
                _issue_tile(cc_ptr, rc_ptr, cs_ptr, cs_s, bt_row, cc_s, rc_s, t_start + i, t_qend, t_lo, C_ROW, R_ROW,
                            PAGE, STAGES, i, C_SZ_ROW)
        for t in range(t_start, t_qend):
            pos0 = (t + t_lo) * 64
            row0 = gl.load(bt_row + pos0 // PAGE).to(gl.int64) * PAGE + pos0 % PAGE
            if STAGES > 0:
                slot = (t - t_start) % STAGES
                async_copy.wait_group(STAGES - 2)  # this thread's copies of tile t have landed
                _barrier()  # everyone's have; and every warp is done with the slot refilled next
                _issue_tile(cc_ptr, rc_ptr, cs_ptr, cs_s, bt_row, cc_s, rc_s, t + STAGES - 1, t_qend, t_lo, C_ROW,
                            R_ROW, PAGE, STAGES, (t - t_start + STAGES - 1) % STAGES, C_SZ_ROW)
                cc_t_s = cc_s.index(slot)
            # Per-tile scalar bases; every per-element offset below is a loop-invariant int32 pattern.
            cc_t = cc_ptr + row0 * C_ROW
            cs_t = cs_ptr + row0 * C_SZ_ROW
            cz_t = cz_ptr + row0 * C_SZ_ROW
            rc_t = rc_ptr + row0 * R_ROW
            rs_t = rs_ptr + row0 * R_SZ_ROW
            rz_t = rz_ptr + row0 * R_SZ_ROW
            lo_ok = SINK - pos0  # tokens i of the tile are valid where lo_ok <= i < hi_ok
            hi_ok = q_hi - pos0
            # scores: S = zero term + sum_g scale_g * acc_g. Invalid tokens' scores are masked to -inf, so
            # their scale/zero need no mask (NaN there is dropped by the where).
            zptr = gl.where(zg[None, :] < 8, cz_t + tokZ[:, None] * C_SZ_ROW + zg[None, :],
                            rz_t + tokZ[:, None] * R_SZ_ROW)
            az = gl.load(zptr, mask=(zg < 9)[None, :], other=0.0)
            # Async MMAs, one group ahead: group g's MMA runs while group g-1's result is scaled into S.
            S = warpgroup_mma(az, z_s, zero_acc, use_acc=False, is_async=True)
            pending = S
            if STAGES > 0:
                sc_prev = gl.convert_layout(gl.reshape(cs_s.index(slot).slice(0, 1, dim=1).load(_LS1), [64]),
                                            gl.SliceLayout(1, _MMA), assert_trivial=True)
            else:
                sc_prev = gl.load(cs_t + tokM * C_SZ_ROW)
            for g in gl.static_range(9):
                if g < 8:
                    if STAGES > 0:
                        u = cc_t_s.reshape([512, 32]).slice(64 * g, 64).load(_LU)
                    else:
                        u = gl.load(cc_t + tokU[:, None] * C_ROW + 32 * g + bytU[None, :])
                    if STAGES > 0:
                        sc = gl.convert_layout(gl.reshape(cs_s.index(slot).slice(g, 1, dim=1).load(_LS1), [64]),
                                               gl.SliceLayout(1, _MMA), assert_trivial=True)
                    else:
                        sc = gl.load(cs_t + tokM * C_SZ_ROW + g)
                    nxt = warpgroup_mma(_scores_frag(u, DENORM), q_s.index(g), zero_acc, use_acc=False,
                                        is_async=True)
                else:
                    if STAGES > 0:
                        u = rc_s.index(slot).load(_LU)
                    else:
                        u = gl.load(rc_t + tokU[:, None] * R_ROW + bytU[None, :])
                    sc = gl.load(rs_t + tokM * R_SZ_ROW)
                    nxt = warpgroup_mma(_scores_frag(u, DENORM), q_r, zero_acc, use_acc=False, is_async=True)
                done = warpgroup_mma_wait(1, deps=[pending])
                if g == 0:
                    S = done  # the zero term
                else:
                    S = S + done * (sc_prev.to(gl.float32) * sc_mul)[:, None]
                pending = nxt
                sc_prev = sc
            done = warpgroup_mma_wait(0, deps=[pending])
            S = S + done * (sc_prev.to(gl.float32) * sc_mul)[:, None]
            p, alpha, grew, m_i, l_i = _softmax(S, (tokM >= lo_ok) & (tokM < hi_ok), m_i, l_i)
            # values: fragments from the codes (8 contiguous bytes of each of 16 tokens per thread); scale
            # and zero in the codes' layout (masked: an invalid token must contribute 0, not NaN * 0)
            if STAGES > 0:
                v3 = cc_t_s.load(_LV3)  # [8 g, 64 t, 32 b] -> [64 t, 256 bytes]: a register relabelling
                v = gl.convert_layout(gl.reshape(gl.permute(v3, [1, 0, 2]), [64, 256]), _LV, assert_trivial=True)
            else:
                v = gl.load(cc_t + tokV[:, None] * C_ROW + bytV[None, :])
            va0, va1, vb0, vb1 = _values_split(v)
            # In a PTX pack, element j0 (byte bit 0 of the input word) is relabelled token 2p + j0 on output, so
            # the scale/zero pair of a pack is that of tokens (2p, 2p + 1): index tok + (byte & 1) of the a half.
            tkV = tokV[:, None] + (bytV[None, :] & 1)
            oka, _x, _y, _z = _values_split((tkV >= lo_ok) & (tkV < hi_ok))
            oza, _x, _y, _z = _values_split(tkV * C_SZ_ROW + bytV[None, :] // 32)
            sv = gl.load(cs_t + oza, mask=oka, other=0.0)
            zv = gl.load(cz_t + oza, mask=oka, other=0.0)
            _stage_p(p, p_s)
            a0, a1, a2, a3, a4, a5, a6, a7 = _rescale(alpha, grew, a0, a1, a2, a3, a4, a5, a6, a7)
            a0, a1 = _mma2(p_s, a0, a1, _values_frag(va0, vb0, sv, zv, 0))
            a2, a3 = _mma2(p_s, a2, a3, _values_frag(va0, vb0, sv, zv, 1))
            a4, a5 = _mma2(p_s, a4, a5, _values_frag(va1, vb1, sv, zv, 0))
            a6, a7 = _mma2(p_s, a6, a7, _values_frag(va1, vb1, sv, zv, 1))

        # protected BF16 rows: the sink positions, then [q_hi, L) from the ring (row SINK + (p - SINK) % ring)
        if STAGES > 0:
            async_copy.wait_group(0)  # the (empty) groups issued past the last tile
        if SINK + C_RING + R_RING > 0:
            slot = gl.load(slots_ptr + b).to(gl.int64)
            for t in range(gl.maximum(t_start, nt_q) - nt_q, t_end - nt_q):
                if PROT_VEC:
                    rcS = _prot_rows(t, slot, n_s, n_p, q_hi, gl.SliceLayout(1, _LPS), SINK, C_RING)
                    rrS = _prot_rows(t, slot, n_s, n_p, q_hi, gl.SliceLayout(1, _LPS), SINK, R_RING)
                    S = zero_acc
                    for g in gl.static_range(9):
                        if g < 8:
                            S = warpgroup_mma(_prot_scores_vec(pc_ptr, rcS, 64 * g, 512), q_s.index(g), S)
                        else:
                            S = warpgroup_mma(_prot_scores_vec(pr_ptr, rrS, 0, 64), q_r, S)
                else:
                    iZ = t * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, _DOA))
                    vZ = iZ < n_p
                    pZ = gl.where(iZ < n_s, iZ, q_hi + iZ - n_s)
                    rcZ = slot * (SINK + C_RING) + gl.where(pZ < SINK, pZ,
                                                            SINK + (pZ - SINK) % (C_RING + (C_RING == 0)))
                    rrZ = slot * (SINK + R_RING) + gl.where(pZ < SINK, pZ,
                                                            SINK + (pZ - SINK) % (R_RING + (R_RING == 0)))
                    S = zero_acc
                    for g in gl.static_range(9):
                        if g < 8:
                            S = warpgroup_mma(_prot_scores_frag(pc_ptr, rcZ, vZ, 64 * g, 512), q_s.index(g), S)
                        else:
                            S = warpgroup_mma(_prot_scores_frag(pr_ptr, rrZ, vZ, 0, 64), q_r, S)
                S = S * qk_scale
                iM = t * 64 + tokM
                p, alpha, grew, m_i, l_i = _softmax(S, iM < n_p, m_i, l_i)
                if PROT_VEC:
                    rcV = _prot_rows(t, slot, n_s, n_p, q_hi, gl.SliceLayout(1, gl.SliceLayout(2, _LPV)), SINK,
                                     C_RING)
                    _stage_p(p, p_s)
                    a0, a1, a2, a3, a4, a5, a6, a7 = _rescale(alpha, grew, a0, a1, a2, a3, a4, a5, a6, a7)
                    f0, f1, f2, f3 = _prot_values_vec(pc_ptr, rcV, 0)
                    a0, a1 = _mma2(p_s, a0, a1, (f0, f1))
                    a2, a3 = _mma2(p_s, a2, a3, (f2, f3))
                    f4, f5, f6, f7 = _prot_values_vec(pc_ptr, rcV, 1)
                    a4, a5 = _mma2(p_s, a4, a5, (f4, f5))
                    a6, a7 = _mma2(p_s, a6, a7, (f6, f7))
                else:
                    iA = t * 64 + tokA
                    vA = iA < n_p
                    pA = gl.where(iA < n_s, iA, q_hi + iA - n_s)
                    rcA = slot * (SINK + C_RING) + gl.where(pA < SINK, pA,
                                                            SINK + (pA - SINK) % (C_RING + (C_RING == 0)))
                    _stage_p(p, p_s)
                    a0, a1, a2, a3, a4, a5, a6, a7 = _rescale(alpha, grew, a0, a1, a2, a3, a4, a5, a6, a7)
                    a0, a1 = _mma2(p_s, a0, a1, (_prot_values_frag(pc_ptr, rcA, vA, 0),
                                                 _prot_values_frag(pc_ptr, rcA, vA, 1)))
                    a2, a3 = _mma2(p_s, a2, a3, (_prot_values_frag(pc_ptr, rcA, vA, 2),
                                                 _prot_values_frag(pc_ptr, rcA, vA, 3)))
                    a4, a5 = _mma2(p_s, a4, a5, (_prot_values_frag(pc_ptr, rcA, vA, 4),
                                                 _prot_values_frag(pc_ptr, rcA, vA, 5)))
                    a6, a7 = _mma2(p_s, a6, a7, (_prot_values_frag(pc_ptr, rcA, vA, 6),
                                                 _prot_values_frag(pc_ptr, rcA, vA, 7)))

        ok = l_i > 0
        l_safe = gl.where(ok, l_i, 1.0)
        lse = gl.where(ok, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        heads = gl.arange(0, 16, layout=gl.SliceLayout(0, _MMA))
        hmask = heads < H
        row = (b * num_splits + split) * H + heads
        _store_tile(o_ptr, row, hmask, a0, l_safe, 0)
        _store_tile(o_ptr, row, hmask, a1, l_safe, 1)
        _store_tile(o_ptr, row, hmask, a2, l_safe, 2)
        _store_tile(o_ptr, row, hmask, a3, l_safe, 3)
        _store_tile(o_ptr, row, hmask, a4, l_safe, 4)
        _store_tile(o_ptr, row, hmask, a5, l_safe, 5)
        _store_tile(o_ptr, row, hmask, a6, l_safe, 6)
        _store_tile(o_ptr, row, hmask, a7, l_safe, 7)
        gl.store(lse_ptr + row, lse, mask=hmask)


# ---------------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------------


def unsupported_reason(cache: PagedMLACache, num_heads: int, device) -> str | None:
    """None when `mla_decode_gluon` can run this cache, head count and device; else why not (one sentence)."""
    if gluon is None:
        return f"triton.experimental.gluon is not available ({_GLUON_ERROR})"
    for name, path, dim in (("content", cache.content, DC), ("rope", cache.rope, DR)):
        f = path.fmt
        if f.kind != "int4" or f.axis == "token" or path.block > 1 or f.rank:
            return f"needs {name} int4 with channel groups, got {f}"
        if f.group != GROUP:
            return f"needs {name} group {GROUP}, got {f.group}"
        if path.dim != dim:
            return f"needs kv_lora_rank {DC} and rope dims {DR}, got {cache.kv_lora_rank}/{cache.rope_dim}"
        if (why := path.row_layout_problem(row_align=8, base_align=16)) is not None:
            return why
    if num_heads > BLOCK_H or num_heads < 1:
        return f"needs 1..{BLOCK_H} heads, got {num_heads}"
    return hopper_reason(cache, device)


def _triton_version() -> tuple[int, int]:
    major, minor = (int("".join(c for c in x if c.isdigit()) or 0) for x in triton.__version__.split(".")[:2])
    return major, minor


def hopper_reason(cache: PagedMLACache, device) -> str | None:
    """What the Hopper Gluon kernels need besides their formats, or None: a Triton of TRITON_VERSIONS, pages of
    whole 64-token tiles, contiguous bf16 protected rows, an sm_90 CUDA device."""
    if not TRITON_VERSIONS[0] <= _triton_version() < TRITON_VERSIONS[1]:
        (a, b), (c, d) = TRITON_VERSIONS
        return (f"is built for Triton {a}.{b} to {c}.{d - 1} (Gluon's API changes between releases), "
                f"got {triton.__version__}")
    if cache.block_size % BLOCK_N:
        return f"needs pages of a multiple of {BLOCK_N} tokens, got {cache.block_size}"
    if cache.protected_content.dtype != torch.bfloat16 or cache.protected_rope.dtype != torch.bfloat16:
        return "needs bf16 protected rows"
    if not (cache.protected_content.is_contiguous() and cache.protected_rope.is_contiguous()):
        return "needs contiguous protected rows"
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not a CUDA device"
    if torch.cuda.get_device_capability(device)[0] != 9:
        return f"needs a Hopper GPU (sm_90, wgmma), got compute capability {torch.cuda.get_device_capability(device)}"
    return None


def default_splits(batch: int, max_seq_len: int, num_sms: int) -> int:
    """Splits per sequence: about two CTAs per SM, no split under 512 tokens (the Triton kernel's rule)."""
    want = max(1, round(num_sms * 2 / max(batch, 1)))
    return max(1, min(want, -(-max(max_seq_len, 1) // 512)))


def _denorm() -> bool:
    return os.environ.get("QUANTMLA_GLUON_DENORM", "1") != "0"


def _stages() -> int:
    """Codes ring depth: $QUANTMLA_GLUON_STAGES (default 3); 0 loads the codes straight from global memory."""
    n = int(os.environ.get("QUANTMLA_GLUON_STAGES", "3"))
    if n not in (0, 2, 3, 4):
        raise ValueError(f"QUANTMLA_GLUON_STAGES must be 0, 2, 3 or 4, got {n}")
    return n


def _prot_vec() -> bool:
    """Protected rows by contiguous 16-byte loads ($QUANTMLA_GLUON_PROT_VEC, default 1; 0: the old 2-byte
    gathers in fragment order)."""
    return os.environ.get("QUANTMLA_GLUON_PROT_VEC", "1") != "0"


def _prot_prefetch() -> bool:
    """L2 prefetch of the protected tiles before the body loop ($QUANTMLA_GLUON_PROT_PREFETCH, default 1)."""
    return os.environ.get("QUANTMLA_GLUON_PROT_PREFETCH", "1") != "0"


def gluon_launch(q_nope_absorbed, q_pe, cache: PagedMLACache, block_tables, seq_lens, slots, sm_scale: float,
                 num_splits: int, out_dtype: torch.dtype, consts: dict):
    """The launch `mla_decode_gluon` makes (a `mla_decode.Launch`: arguments in the kernel's parameter order,
    constexprs included); consts: DENORM, STAGES, PROT_VEC, PROT_PREFETCH. Apart from running it, so that
    `kernels.offline` compiles the very same launch."""
    from quantmla.kernels.mla_decode import Launch, launch_inputs

    B, H = q_nope_absorbed.shape[:2]
    qn, qp, slots, outputs = launch_inputs(q_nope_absorbed, q_pe, slots, num_splits, out_dtype)
    part_o, part_lse = outputs[2:]
    c, r = cache.content, cache.rope
    runtime = [qn, qp, c.codes, c.scale, c.zero, r.codes, r.scale, r.zero, cache.protected_content,
               cache.protected_rope, block_tables, block_tables.stride(0), seq_lens, slots, part_o, part_lse, H,
               num_splits, sm_scale * LOG2E]  # fmt: skip
    consts = dict(C_ROW=c.codes.stride(1), C_SZ_ROW=c.scale.stride(1), R_ROW=r.codes.stride(1),
                  R_SZ_ROW=r.scale.stride(1), PAGE=cache.block_size, SINK=cache.sink, RECENT=cache.recent,
                  C_RING=cache.rings[0], R_RING=cache.rings[1], **consts)
    args = tuple(consts[p.name] if p.is_constexpr else runtime.pop(0) for p in _gluon_decode_kernel.params)
    return Launch((num_splits, B), args, dict(num_warps=NUM_WARPS), outputs)


def mla_decode_gluon(
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
    denorm: bool | None = None,
    stages: int | None = None,
    prot_vec: bool | None = None,
    prot_prefetch: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring. num_splits: None picks enough programs for two CTAs per SM, no split under
    512 tokens (the Triton kernel's rule). Raises ValueError naming what it does not support."""
    B, H, dc = q_nope_absorbed.shape
    dev = q_nope_absorbed.device
    why = unsupported_reason(cache, H, dev)
    if why is not None:
        raise ValueError(f"the Gluon decode kernel {why}")
    if q_pe.shape != (B, H, DR) or dc != DC:
        raise ValueError(f"queries {tuple(q_nope_absorbed.shape)}/{tuple(q_pe.shape)} do not match the cache")
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if B else 0
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    if num_splits is None:
        num_splits = default_splits(B, max_seq_len, num_sms)
    from quantmla.kernels.mla_decode import combine_splits

    consts = dict(DENORM=_denorm() if denorm is None else denorm, STAGES=_stages() if stages is None else stages,
                  PROT_VEC=_prot_vec() if prot_vec is None else prot_vec,
                  PROT_PREFETCH=_prot_prefetch() if prot_prefetch is None else prot_prefetch)
    launch = gluon_launch(q_nope_absorbed, q_pe, cache, block_tables, seq_lens, slots, sm_scale, num_splits,
                          out_dtype, consts)
    out, lse, part_o, part_lse = launch.outputs
    if B == 0:
        return out, lse
    _gluon_decode_kernel[launch.grid](*launch.args, **launch.options)
    combine_splits(part_o, part_lse, out, lse)
    return out, lse
