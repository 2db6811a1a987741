"""The decode step's cache writer as one Triton kernel: `PagedMLACache.append_decode`, fused.

    append_decode_fused(cache, slots, block_tables, seq_lens, c, k_pe)

does, in one launch of B programs (one per sequence, both paths in each), exactly what
`cache.append_decode(slots, block_tables, seq_lens, c, k_pe, checked=False)` does, byte for byte:
  - slots [B] int32/int64, block_tables [B, max_blocks] int32, seq_lens [B] int32/int64 (lengths *before*
    the token), c [B, dc] and k_pe [B, dr] in any float dtype (rows may be strided; channels contiguous);
  - with recent > 0, the token at position L - recent, when >= sink, leaves the window: it is read from its
    ring row of `protected_*` (row sink + (L - recent - sink) % recent) and quantized into the pool row of
    its position; a sequence with nothing to evict quantizes its new token into the pool row of position
    max(L - recent, 0) instead (a row no reader looks at yet). With recent == 0 the new token is quantized
    into the pool row of position L;
  - then the new token goes to its protected row (sink row L while L < sink, else its ring row; with
    recent == 0 only sink tokens are protected). Both paths bf16: window 0, every token goes to the pool.
Pool row of position p: block_tables[b, p // P] * P + p % P. Byte layouts are those of
`quantmla.quant.formats` (see `quantmla.cache.paged`): int8/int4/int2 codes uint8 (int4: channel 2i in the
low nibble, 2i+1 in the high nibble; int2: channel 4i+k in bits 2k..2k+1) with fp16 scale and zero per
group; fp8 e4m3 bit patterns with an fp32 scale per group (group 0: scale 1.0, none stored); bf16: the
values in the pool's dtype.

Bit-exactness: the kernel repeats `quantize()`'s arithmetic step for step, in fp32: group min/max (with a
clipping ratio r < 1: lo += (hi - lo) * fp32((1 - r) / 2), span = (hi - lo) * fp32(r)), scale =
max(span / (2^bits - 1) * (1 + 2^-10), 2^-24), rounded to fp16 and stepped up one fp16 ulp if that
went below; zero = fp16(lo); code = clamp(round_half_even((x - zero) / scale), 0, 2^bits - 1); fp8: scale
= max(amax / 448, 1e-12), e4m3(clamp(x / scale, +-448)). Three details matter:
  - torch divides a CUDA tensor by a Python number as a multiply by the fp32 reciprocal (on the CPU it
    divides), so `RECIP` picks that form on CUDA; every other division is `tl.div_rn` (IEEE; Triton's `/`
    is approximate on the GPU);
  - rounding to integers adds and subtracts 1.5 * 2^23 (half to even for |v| < 2^22; beyond that both
    sides clamp alike); fp32 -> e4m3 and fp32 -> bf16 are written out in integer bit operations (the ones
    of c10's converters, round to nearest even), so the interpreter (which truncates) agrees with the GPU;
  - a group whose minimum is a zero of both signs may store the other sign of zero in `zero` (torch's
    amin picks either; the value is the same).
Like checked=False there are no NaN/range checks and no host syncs: fixed shapes, capturable in a CUDA
graph. Byte-identical for finite inputs (NaN or inf gives garbage codes in both writers, not necessarily
the same garbage). Programs run concurrently, so sequences must have distinct slots and blocks (as the
engine's do; padded rows of a CUDA-graph batch all write the scratch slot and block: garbage either way).
`checked=True`, or a CPU tensor outside the interpreter, runs the torch writer instead (its checks read
the data on the host anyway), and so does a cache with a token-axis path: the kernel writes channel-grouped
tokens one at a time, not a token-axis block (the torch writer's block step has fixed shapes and no host
syncs, so it is captured in CUDA graphs as well). The kernel needs power-of-two dims and groups (as
`mla_decode` does). A ranked content format (channels [0, rank) stored) is written here when its rank is a
power of two; other ranks, and ranked RoPE paths, take the torch writer.
"""

from __future__ import annotations

import torch

try:  # the torch writer works without triton; the kernel needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

from quantmla.cache.paged import PagedMLACache
from quantmla.kernels.mla_decode import Launch, _interpreting, _path_args
from quantmla.quant.formats import FP8_MAX

if triton is not None:
    _FP8_MAX = tl.constexpr(FP8_MAX)

    @triton.jit
    def _cast(x, dtype: tl.constexpr):
        """x.to(dtype), with * -> bf16 rounded to nearest even also in the interpreter (which truncates)."""
        if dtype == tl.bfloat16 and x.dtype != tl.bfloat16:
            b = x.to(tl.float32).to(tl.int32, bitcast=True)
            b = (b + (0x7FFF + ((b >> 16) & 1))) >> 16
            return b.to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dtype)

    @triton.jit
    def _div_const(x, D: tl.constexpr, RECIP: tl.constexpr):
        """x / D as torch divides a tensor by a Python number: on CUDA x * fp32(1 / D), on the CPU x / D."""
        d = tl.full(x.shape, D, tl.float32)
        if RECIP:
            return x * tl.div_rn(tl.full(x.shape, 1.0, tl.float32), d)
        else:
            return tl.div_rn(x, d)

    @triton.jit
    def _e4m3_bits(q):
        """fp32 |q| <= 448 -> float8_e4m3fn bit patterns (int32), round to nearest even, as c10 converts."""
        bits = q.to(tl.int32, bitcast=True)
        a = bits & 0x7FFFFFFF
        # Below 2^-6 (subnormal e4m3): adding 2^14 rounds |q| to a multiple of 2^-9 in the low mantissa bits.
        small = (tl.abs(q) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
        normal = (a + ((-120 << 23) + 0x7FFFF) + ((a >> 20) & 1)) >> 20  # rebias, round the mantissa to 3 bits
        return tl.where(a < (121 << 23), small, normal) | tl.where(bits < 0, 0x80, 0)

    @triton.jit
    def _quantize_store(x, codes_ptr, scale_ptr, zero_ptr, row, DIM: tl.constexpr, KIND: tl.constexpr,
                        BITS: tl.constexpr, GROUP: tl.constexpr, SCALED: tl.constexpr, RECIP: tl.constexpr,
                        CLIP: tl.constexpr, MARGIN: tl.constexpr):
        """`quantize()` one token x [DIM] (the input's dtype) and store it at pool row `row` (int64).
        CLIP < 1 (integers): the codes span the middle CLIP of each group's range, MARGIN = (1 - CLIP) / 2."""
        if KIND == 0:  # bf16: the values themselves, in the pool's dtype
            tl.store(codes_ptr + row * DIM + tl.arange(0, DIM), _cast(x, codes_ptr.dtype.element_ty))
        else:
            NG: tl.constexpr = DIM // GROUP
            PER: tl.constexpr = 8 // BITS
            sg = row * NG + tl.arange(0, NG)
            g = tl.reshape(x.to(tl.float32), [NG, GROUP])
            if KIND == 1:  # fp8: e4m3 of x / scale, scale = amax / 448 per group (or 1.0 per tensor)
                if SCALED:
                    s = tl.maximum(_div_const(tl.max(tl.abs(g), 1), _FP8_MAX, RECIP), 1e-12)
                    g = tl.div_rn(g, s[:, None])
                    tl.store(scale_ptr + sg, s)
                codes = _e4m3_bits(tl.minimum(tl.maximum(g, -_FP8_MAX), _FP8_MAX))
            else:  # asymmetric integers, x ~= code * scale + zero
                QMAX: tl.constexpr = (1 << BITS) - 1
                lo = tl.min(g, 1)
                span = tl.max(g, 1) - lo
                if CLIP != 1.0:  # as formats._int_scale_zero: lo + span * margin, then span * clip, in fp32
                    lo = lo + span * tl.full(span.shape, MARGIN, tl.float32)
                    span = span * tl.full(span.shape, CLIP, tl.float32)
                s = tl.maximum(_div_const(span, QMAX, RECIP) * (1 + 2**-10), 2**-24)
                s16 = s.to(tl.float16)
                s16 = (s16.to(tl.int16, bitcast=True) + (s16.to(tl.float32) < s).to(tl.int16)).to(tl.float16,
                                                                                                  bitcast=True)
                z16 = lo.to(tl.float16)
                v = tl.div_rn(g - z16.to(tl.float32)[:, None], s16.to(tl.float32)[:, None])
                v = (v + 12582912.0) - 12582912.0  # round half to even: 1.5 * 2^23 leaves no fraction bits
                codes = tl.minimum(tl.maximum(v, 0.0), QMAX).to(tl.int32)
                tl.store(scale_ptr + sg, s16)
                tl.store(zero_ptr + sg, z16)
            # Pack: code k of each run of PER channels goes to bits k*BITS.. of its byte.
            codes = tl.reshape(codes, [DIM // PER, PER]) << (tl.arange(0, PER) * BITS)[None, :]
            byte = tl.sum(codes, 1).to(tl.uint8)
            tl.store(codes_ptr + row * (DIM // PER) + tl.arange(0, DIM // PER), byte)

    @triton.jit(do_not_specialize=["c_stride", "r_stride", "bt_stride"])
    def _append_decode_kernel(
        c_ptr,  # [B, DC] new content tokens, row stride c_stride
        c_stride,
        r_ptr,  # [B, DR] new rope tokens, row stride r_stride
        r_stride,
        cc_ptr,  # content pool codes / scale / zero
        cs_ptr,
        cz_ptr,
        rc_ptr,  # rope pool codes / scale / zero
        rs_ptr,
        rz_ptr,
        pc_ptr,  # protected content [slots, SINK + RECENT, DC]
        pr_ptr,  # protected rope [slots, SINK + RECENT, DR]
        bt_ptr,  # block tables int32 [B, bt_stride]
        bt_stride,
        lens_ptr,  # [B] lengths before the token
        slots_ptr,  # [B]
        DC: tl.constexpr,
        DR: tl.constexpr,
        C_KIND: tl.constexpr,
        C_BITS: tl.constexpr,
        C_GROUP: tl.constexpr,
        C_SCALED: tl.constexpr,
        R_KIND: tl.constexpr,
        R_BITS: tl.constexpr,
        R_GROUP: tl.constexpr,
        R_SCALED: tl.constexpr,
        C_CLIP: tl.constexpr,
        C_MARGIN: tl.constexpr,
        R_CLIP: tl.constexpr,
        R_MARGIN: tl.constexpr,
        PAGE: tl.constexpr,
        SINK: tl.constexpr,
        RECENT: tl.constexpr,
        RECIP: tl.constexpr,
        CQ: tl.constexpr,  # content channels the pool stores: DC, or a ranked format's rank
    ):
        b = tl.program_id(0).to(tl.int64)
        L = tl.load(lens_ptr + b).to(tl.int64)
        W: tl.constexpr = SINK + RECENT
        dc = tl.arange(0, DC)
        dr = tl.arange(0, DR)
        c = tl.load(c_ptr + b * c_stride + dc)
        r = tl.load(r_ptr + b * r_stride + dr)
        cq = tl.arange(0, CQ)  # the channels the content pool stores
        c_q = c
        if CQ < DC:  # a ranked content path quantizes channels [0, CQ) only
            c_q = tl.load(c_ptr + b * c_stride + cq)
        if W > 0:
            slot_row = tl.load(slots_ptr + b).to(tl.int64) * W
        if RECENT > 0:
            # Position L - recent leaves the window; it shares its ring row with the new token.
            ev = L - RECENT
            evict = ev >= SINK
            ring = slot_row + SINK + (tl.maximum(ev, SINK) - SINK) % RECENT
            xc = tl.where(evict, _cast(tl.load(pc_ptr + ring * DC + cq), c_ptr.dtype.element_ty), c_q)
            xr = tl.where(evict, _cast(tl.load(pr_ptr + ring * DR + dr), r_ptr.dtype.element_ty), r)
            qpos = tl.maximum(ev, 0)
        else:  # no ring: the new token is quantized at once (into an unread row while it is a sink token)
            xc = c_q
            xr = r
            qpos = L
        row = tl.load(bt_ptr + b * bt_stride + qpos // PAGE).to(tl.int64) * PAGE + qpos % PAGE
        _quantize_store(xc, cc_ptr, cs_ptr, cz_ptr, row, CQ, C_KIND, C_BITS, C_GROUP, C_SCALED, RECIP, C_CLIP,
                        C_MARGIN)
        _quantize_store(xr, rc_ptr, rs_ptr, rz_ptr, row, DR, R_KIND, R_BITS, R_GROUP, R_SCALED, RECIP, R_CLIP,
                        R_MARGIN)
        if W > 0:
            cn = _cast(c, pc_ptr.dtype.element_ty)
            rn = _cast(r, pr_ptr.dtype.element_ty)
            if RECENT > 0:
                prow = slot_row + tl.where(L < SINK, L, SINK + (tl.maximum(L, SINK) - SINK) % RECENT)
            else:  # only sink tokens are protected; past the sink, row sink - 1 is rewritten with what it holds
                prow = slot_row + tl.minimum(L, SINK - 1)
                cn = tl.where(L < SINK, cn, tl.load(pc_ptr + prow * DC + dc))
                rn = tl.where(L < SINK, rn, tl.load(pr_ptr + prow * DR + dr))
            tl.debug_barrier()  # every thread has read the evicted ring row before it is overwritten
            tl.store(pc_ptr + prow * DC + dc, cn)
            tl.store(pr_ptr + prow * DR + dr, rn)


def _clip_args(fmt) -> tuple[float, float]:
    """(clip, margin) constexprs: margin = (1 - clip) / 2 in Python floats, as `quantize()` computes it."""
    return float(fmt.clip), (1 - fmt.clip) / 2


def fused_writes(cache: PagedMLACache) -> bool:
    """Whether the kernel writes this cache's layout: no token-axis path (the kernel does not write blocks),
    no ranked RoPE path, and a ranked content path only of a power-of-two rank."""
    token_axis = cache.content.block > 1 or cache.rope.block > 1
    cq = cache.content.fmt.stored(cache.kv_lora_rank)
    return not (token_axis or cache.rope.fmt.rank or cq & (cq - 1))


def append_decode_fused(
    cache: PagedMLACache,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    c: torch.Tensor,
    k_pe: torch.Tensor,
    checked: bool = False,
) -> None:
    """`cache.append_decode(slots, block_tables, seq_lens, c, k_pe, checked=False)` in one kernel launch
    (see the module docstring). checked=True, CPU tensors outside TRITON_INTERPRET=1, or a cache with a
    token-axis path (whose blocks the kernel does not write) or a ranked path other than a content path of a
    power-of-two rank run the torch writer."""
    if checked or not fused_writes(cache) or triton is None or not (c.is_cuda or _interpreting()):
        cache.append_decode(slots, block_tables, seq_lens, c, k_pe, checked=checked)
        return
    B = c.shape[0]
    if (c.shape, k_pe.shape) != ((B, cache.kv_lora_rank), (B, cache.rope_dim)):
        raise ValueError(f"c {tuple(c.shape)} / k_pe {tuple(k_pe.shape)} do not match the cache")
    if B == 0:
        return
    launch = writer_launch(cache, slots, block_tables, seq_lens, c, k_pe, on_gpu=c.is_cuda)
    _append_decode_kernel[launch.grid](*launch.args, **launch.options)


def writer_launch(cache: PagedMLACache, slots, block_tables, seq_lens, c, k_pe, *, on_gpu: bool) -> Launch:
    """The launch `append_decode_fused` makes (arguments as there; on_gpu: the kernel's GPU constexpr), apart
    from running it, so that `kernels.offline` can compile it for a GPU the machine does not have."""
    c = c if c.stride(-1) == 1 else c.contiguous()
    k_pe = k_pe if k_pe.stride(-1) == 1 else k_pe.contiguous()
    # The kernel reads entry i of a row as base + i: unit-stride tables, lengths and slots (no copy if already).
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens, slots = seq_lens.contiguous(), slots.contiguous()
    c_ptrs, c_const = _path_args(cache.content)
    r_ptrs, r_const = _path_args(cache.rope)
    for t in (*c_ptrs, *r_ptrs, cache.protected_content, cache.protected_rope):
        assert t.is_contiguous(), "the pools are allocated contiguous"
    args = (c, c.stride(0), k_pe, k_pe.stride(0), *c_ptrs, *r_ptrs, cache.protected_content, cache.protected_rope,
            block_tables, block_tables.stride(0), seq_lens, slots,
            cache.kv_lora_rank, cache.rope_dim, *c_const, *r_const, *_clip_args(cache.content.fmt),
            *_clip_args(cache.rope.fmt), cache.block_size, cache.sink, cache.recent,
            on_gpu, cache.content.fmt.stored(cache.kv_lora_rank))  # fmt: skip
    # no fma contraction: torch rounds every step
    return Launch((c.shape[0],), args, dict(num_warps=4, enable_fp_fusion=False), ())
