"""The paged cache writer and the Triton MLA decode kernel against plain-torch oracles.

Without a GPU the kernel runs under TRITON_INTERPRET=1 (set here, before triton is imported); with one it
runs for real, and the GPU-only tests (inline-PTX dequantization, CUDA-graph capture) run too.
"""

import math
import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="the decode kernel needs triton")
import triton.language as tl  # noqa: E402

from quantmla.cache.paged import PagedMLACache, PagedPath, make_block_tables  # noqa: E402
from quantmla.config import CacheConfig  # noqa: E402
from quantmla.kernels.mla_decode import (KernelConfig, _split_codes, default_config, mla_decode,  # noqa: E402
                                         mla_decode_reference)
from quantmla.policy import block_of, quantized_end  # noqa: E402
from quantmla.quant.formats import dequantize, quantize  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEV == "cuda"
NAN = float("nan")


def fill(cfg, dc, dr, lens, page=16, recent=24, sink=4, seed=0, chunks=None):
    """A cache holding random tokens for sequences of `lens`, NaN in every unused slot, shuffled blocks and
    permuted slots. Returns (cache, block_tables, seq_lens, slots, c list, k_pe list)."""
    g = torch.Generator().manual_seed(seed)
    cfg = CacheConfig(cfg[0], cfg[1], sink=sink, recent=recent)
    table, used = make_block_tables(lens, page, num_blocks=None, generator=g)
    nb = used + 3  # spare blocks stay NaN
    table, _ = make_block_tables(lens, page, num_blocks=nb, generator=g)
    cache = PagedMLACache.allocate(cfg, dc, dr, nb, len(lens) + 2, block_size=page, device=DEV, fill=NAN)
    slots = torch.randperm(len(lens) + 2, generator=g)[: len(lens)].to(torch.int32)
    cs, rs = [], []
    for i, L in enumerate(lens):
        c = torch.randn(L, dc, generator=g).bfloat16().to(DEV)
        r = torch.randn(L, dr, generator=g).bfloat16().to(DEV)
        pos = 0
        for n in chunks or [L]:  # several appends exercise the window hand-over
            n = min(n, L - pos)
            cache.append(int(slots[i]), table[i].to(DEV), pos, c[pos : pos + n], r[pos : pos + n])
            pos += n
        if pos < L:
            cache.append(int(slots[i]), table[i].to(DEV), pos, c[pos:], r[pos:])
        cs.append(c)
        rs.append(r)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    return cache, table.to(DEV), seq_lens, slots.to(DEV), cs, rs


def queries(B, H, dc, dr, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, dc, generator=g).to(DEV), torch.randn(B, H, dr, generator=g).to(DEV)


def fake(x, fmt):
    return dequantize(quantize(x, fmt), fmt, torch.float64)


# --- the oracle ----------------------------------------------------------------------------------------------


def test_reference_matches_naive_softmax_attention():
    dc, dr, lens = 64, 32, [0, 3, 30, 61]
    cache, table, seq_lens, slots, cs, rs = fill(("int4", "int4:32"), dc, dr, lens, recent=8)
    qn, qp = queries(len(lens), 4, dc, dr)
    out, lse = mla_decode_reference(qn, qp, cache, table, seq_lens, slots, sm_scale=0.1)
    for b, L in enumerate(lens):
        if L == 0:
            assert torch.all(out[b] == 0) and torch.all(lse[b] == -math.inf)
            continue
        # Dequantized tokens built from the inputs, not from the pool.
        q_pos = (torch.arange(L, device=DEV) >= 4) & (torch.arange(L, device=DEV) < L - 8)
        c, r = cs[b].double(), rs[b].double()
        c[q_pos] = fake(cs[b][q_pos], cache.config.content)
        r[q_pos] = fake(rs[b][q_pos], cache.config.rope)
        for h in range(4):
            s = 0.1 * (c @ qn[b, h].double() + r @ qp[b, h].double())
            p = torch.softmax(s, dim=0)
            torch.testing.assert_close(out[b, h], p @ c, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(lse[b, h], torch.logsumexp(s, 0), rtol=1e-10, atol=1e-10)


# --- the paged writer ----------------------------------------------------------------------------------------


def quantized_positions(cache, path, L):
    """[L] bool: the positions `path` holds in the pool (the rule of quantmla.policy)."""
    pos = torch.arange(L, device=DEV)
    return (pos >= cache.sink) & (pos < quantized_end(L, cache.sink, cache.recent, block_of(path.fmt)))


def check_pools_and_window(cache, slot, table, c, r, L, only_quantized=True):
    """The pools hold quantize()'s codes (and scales, at their scale rows) of the positions the rule has
    quantized (and, only_quantized, no others: the decode writer also writes rows no reader looks at); the
    protected rows hold the others exactly, in the documented rows."""
    pos = torch.arange(L, device=DEV)
    rows = cache.pool_rows(table, pos)
    for (path, prot, ring), x in zip(cache.paths(), (c, r)):
        quant = quantized_positions(cache, path, L)
        if path.scale is not None and only_quantized:  # exactly the quantized positions' scale rows were written
            written = torch.zeros(path.scale[..., 0].numel(), dtype=torch.bool, device=DEV)
            if quant.any():
                written[cache.scale_rows(path, table, pos[quant])] = True
            assert torch.equal(~torch.isnan(path.scale.view(-1, path.scale.shape[-1])[:, 0].float()), written), L
        if quant.any():
            want = quantize(x[:L][quant], path.fmt)
            srows = cache.scale_rows(path, table, pos[quant])[:: block_of(path.fmt)]
            for i, (pool, val) in enumerate(zip(path.tensors(), want.tensors())):
                at = rows[quant] if i == 0 else srows
                assert torch.equal(pool.view(-1, pool.shape[-1])[at], val.to(pool.dtype)), (L, i)
        prot_pos = pos[~quant]
        assert torch.equal(prot[slot, cache.protected_row(prot_pos, ring)], x[prot_pos]), L


@pytest.mark.parametrize("fmts", [("int4", "int4:32"), ("int2", "int4:32"), ("fp8:32", "bf16"),
                                  ("int4:t8", "int4:32"), ("int4", "int2:t4"), ("int2:t16", "int4:t4"),
                                  ("bf16", "int8:t8"), ("int4:16r32", "int4:32"), ("int8:16r16", "bf16")])
@pytest.mark.parametrize("sink", [4, 0])
def test_pool_holds_quantize_codes_and_window_moves_on_time(fmts, sink):
    dc, dr, recent, page = 64, 32, 8, 16
    cfg = CacheConfig(*fmts, sink=sink, recent=recent)
    table, nb = make_block_tables([90], page, generator=torch.Generator().manual_seed(0))
    cache = PagedMLACache.allocate(cfg, dc, dr, nb, 2, block_size=page, device=DEV, fill=NAN)
    table = table[0].to(DEV)
    c = torch.randn(90, dc, device=DEV).bfloat16()
    r = torch.randn(90, dr, device=DEV).bfloat16()
    L = 0
    for n in [1, 2, 5, 1, 1, 9, 1, 30, 1, 9, 3, 1, 26]:
        cache.append(1, table, L, c[L : L + n], r[L : L + n])
        L += n
        check_pools_and_window(cache, 1, table, c, r, L)


def band_of(cache, path, start, end):
    """The band of a chunk [start, end) in one path: [quantized_end(start + 1), quantized_end(end))."""
    q = lambda n: quantized_end(n, cache.sink, cache.recent, block_of(path.fmt))  # noqa: E731
    return q(start + 1), q(end)


@pytest.mark.parametrize("cfg", [("int4", "int4:32", 4, 8), ("int2", "fp8:0", 0, 8), ("int4", "fp8:32", 3, 0),
                                 ("bf16", "bf16", 4, 8), ("int4:t8", "int4:t8", 4, 8), ("int4", "int4:t16", 3, 5),
                                 ("int2:t4", "bf16", 0, 0), ("int4:t16", "int2:t8", 5, 0), ("int8:16r48", "int4:32", 4, 8)])
def test_chunk_view_is_the_served_cache_and_its_band(cfg):
    """write_chunk's view (built from the values it writes) = gather() after the chunk, and its band = the
    positions each path has quantized after the chunk but not in the cache the chunk's first query sees."""
    dc, dr, page = 64, 32, 16
    cc = CacheConfig(cfg[0], cfg[1], sink=cfg[2], recent=cfg[3])
    table, nb = make_block_tables([90], page, generator=torch.Generator().manual_seed(3))
    table = table[0].to(DEV)
    cache = PagedMLACache.allocate(cc, dc, dr, nb, 3, block_size=page, device=DEV, fill=NAN)
    c, r = torch.randn(90, dc, device=DEV).bfloat16(), torch.randn(90, dr, device=DEV).bfloat16()
    start, bands = 0, 0
    for n in [3, 1, 2, 7, 1, 20, 5, 40, 11]:
        end = start + n
        view = cache.write_chunk(2, cache.chunk_rows(table, start, n), c[start:end], r[start:end], view_dtype=torch.float32)
        served = cache.gather(2, table, end, torch.float32)
        assert torch.equal(view.c, served[0]) and torch.equal(view.k_pe, served[1]), (start, n)
        for path, x, band in ((cache.content, c, view.band_c), (cache.rope, r, view.band_r)):
            lo, hi = band_of(cache, path, start, end)
            assert torch.equal(band, x[lo:hi].float())
            bands += hi - lo
        check_pools_and_window(cache, 2, table, c, r, end)
        start = end
    assert bands > 0 or cache.window == 0


@pytest.mark.parametrize("cfg", [("int4", "int4:32", 4, 8), ("int2", "bf16", 0, 8), ("int4", "int4:32", 3, 0),
                                 ("int4:t8", "int4:32", 4, 8), ("int4", "int2:t16", 3, 5), ("int4:t4", "int4:t8", 0, 0),
                                 ("int8:t16", "int4:t16", 5, 3), ("int2:16r32", "int4:32", 4, 8)])
def test_decode_writer_matches_bulk_writer(cfg):
    dc, dr, page, n = 64, 32, 16, 60
    cc = CacheConfig(cfg[0], cfg[1], sink=cfg[2], recent=cfg[3])
    tables, nb = make_block_tables([n, n], page)
    tables = tables.to(DEV)
    c = torch.randn(2, n, dc, device=DEV).bfloat16()
    r = torch.randn(2, n, dr, device=DEV).bfloat16()
    bulk = PagedMLACache.allocate(cc, dc, dr, nb, 2, block_size=page, device=DEV, fill=NAN)
    step = PagedMLACache.allocate(cc, dc, dr, nb, 2, block_size=page, device=DEV, fill=NAN)
    for b in range(2):
        bulk.append(b, tables[b], 0, c[b], r[b])
    slots = torch.tensor([0, 1], device=DEV)
    for t in range(n + 1):  # the second sequence a step behind: their blocks complete in different steps
        batch = torch.tensor([b for b in (0, 1) if 0 <= t - b < n], device=DEV)
        lens = t - batch
        step.append_decode(slots[batch], tables[batch], lens, c[batch, lens], r[batch, lens])
    for b in range(2):
        for x, y in zip(bulk.gather(b, tables[b], n), step.gather(b, tables[b], n)):
            assert torch.equal(x, y)
        check_pools_and_window(step, b, tables[b], c[b], r[b], n, only_quantized=False)


def test_token_axis_blocks_must_divide_the_page_and_bytes_are_counted_exactly():
    with pytest.raises(ValueError, match="int4:t32.*divide the page size 16"):
        PagedMLACache.allocate(CacheConfig("int4", "int4:t32"), 64, 32, 4, 1, block_size=16)
    # A block of one token laid out token-axis but read as a channel format (block 1) everywhere: refused.
    with pytest.raises(ValueError, match="token-axis block of at least 2 tokens, got int8:t1"):
        PagedMLACache.allocate(CacheConfig("int8:t1", "int4:32"), 64, 32, 4, 1, block_size=16)
    cache = PagedMLACache.allocate(CacheConfig("int4:t16", "int2:t8", sink=3, recent=5), 64, 32, 4, 2, block_size=16)
    # codes per row, fp16 scale + zero per channel per block of a page
    assert cache.page_bytes == 16 * 32 + 2 * 2 * 64 * 1 + 16 * 8 + 2 * 2 * 32 * 2
    assert cache.body_bytes_per_token == cache.page_bytes / 16
    assert cache.rings == (5 + 16 - 1, 5 + 8 - 1) and cache.window == 3 + 20  # a ring per path
    assert cache.memory_bytes() == 4 * cache.page_bytes + 2 * ((3 + 20) * 64 + (3 + 12) * 32) * 2


# --- the kernel ----------------------------------------------------------------------------------------------


def _run_ptx(text: str, operands: dict[int, int]) -> dict[int, int]:
    """Execute the few PTX instructions `_int_dequant_ptx` (and the many-heads kernel's fp16 `_dequant_ptx`)
    emit on 32-bit registers; operands maps $i to its register value; returns every register afterwards (by $i
    for operands). Each fma rounds the exact a * b + c once, as fma.rn does."""
    def f16(bits):
        return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.float16).double().item()

    def to_f16(x):  # the exact value x (a double) rounded to fp16, nearest even
        return torch.tensor([x], dtype=torch.float64).to(torch.float16).view(torch.int16).item() & 0xFFFF

    def bf16(bits):
        return torch.tensor([bits << 16], dtype=torch.int64).to(torch.int32).view(torch.float32).item()

    def to_bf16(x):  # round the exact value x (a double) to bf16, nearest even: one rounding, as fma.rn does
        if x == 0:
            return 0
        m, e = math.frexp(x)
        x = round(m * 256) * 2.0 ** (e - 8)
        return (torch.tensor([x], dtype=torch.float32).view(torch.int32).item() >> 16) & 0xFFFF

    regs = {f"${i}": v for i, v in operands.items()}
    val = lambda a: regs[a] if a in regs else int(a, 0)  # noqa: E731
    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        if op == "mov.b32":
            out = val(src[0])
        elif op == "prmt.b32":
            pool = [(val(src[0]) | val(src[1]) << 32) >> (8 * i) & 0xFF for i in range(8)]
            out = sum(pool[(val(src[2]) >> (4 * i)) & 7] << (8 * i) for i in range(4))
        elif op == "shr.u32":
            out = val(src[0]) >> val(src[1])
        elif op == "lop3.b32":
            a, b, c, lut = map(val, src)
            out = sum(((lut >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1))) & 1) << i for i in range(32))
        elif op == "fma.rn.bf16x2":
            a, b, c = map(val, src)
            out = sum(to_bf16(bf16(a >> h & 0xFFFF) * bf16(b >> h & 0xFFFF) + bf16(c >> h & 0xFFFF)) << h
                      for h in (0, 16))
        elif op == "sub.f16x2":
            a, b = map(val, src)
            out = sum(to_f16(f16(a >> h & 0xFFFF) - f16(b >> h & 0xFFFF)) << h for h in (0, 16))
        elif op == "fma.rn.f16x2":
            a, b, c = map(val, src)
            out = sum(to_f16(f16(a >> h & 0xFFFF) * f16(b >> h & 0xFFFF) + f16(c >> h & 0xFFFF)) << h
                      for h in (0, 16))
        else:
            raise AssertionError(f"unexpected PTX instruction {op}")
        regs[d] = out & 0xFFFFFFFF
    return regs


@pytest.mark.parametrize("bits", [4, 2])
def test_ptx_dequant_per_group_and_per_code(bits):
    """The inline-PTX dequantization, executed instruction by instruction on the CPU: 4 code bytes (Triton's
    pack=4: one b32 register; bf16 operands as two registers of element pairs, element 0 in the low half) ->
    per code k of each byte e, (code - mid) * scale_hi + centred zero, then + (code - mid) * scale_lo, each
    rounded to bf16. Per group: one scale per byte for all its codes; per code (token-axis): each call
    takes the scales of one code's channels and returns that code only."""
    from quantmla.kernels.mla_decode import _int_dequant_ptx

    g = torch.Generator().manual_seed(0)
    n, mid = 8 // bits, 1 << (bits - 1)
    as_bf16 = lambda x: x.bfloat16().view(torch.int16).int() & 0xFFFF  # noqa: E731
    pairs = lambda b: [b[0].item() | b[1].item() << 16, b[2].item() | b[3].item() << 16]  # noqa: E731
    for _ in range(20):
        w = torch.randint(0, 256, (4,), generator=g)
        codes = (w[:, None] >> (bits * torch.arange(n))) & ((1 << bits) - 1)  # [byte, code]
        sc = torch.rand(4, n, generator=g) + 0.01
        zr = torch.randn(4, n, generator=g)
        hi = sc.bfloat16().float()
        lo = (sc - hi).bfloat16().float()
        zc = (zr + mid * sc).bfloat16().float()
        t = (codes - mid).double()
        want = (t * hi.double() + zc.double()).bfloat16().double()  # exact before rounding: |t * hi| has 9 bits
        want = (t * lo.double() + want).bfloat16().float()
        word = sum(int(w[e]) << (8 * e) for e in range(4))
        # per group: the scale of code 0 for every code of the byte
        ops = dict(enumerate([0] * (2 * n) + [word] + pairs(as_bf16(hi[:, 0])) + pairs(as_bf16(lo[:, 0]))
                             + pairs(as_bf16(zc[:, 0]))))
        regs = _run_ptx(_int_dequant_ptx(bits), ops)
        one = ((t * hi[:, :1].double() + zc[:, :1].double()).bfloat16().double() + t * lo[:, :1].double()).bfloat16()
        for k in range(n):
            got = [regs[f"${2 * k + e // 2}"] >> (16 * (e % 2)) & 0xFFFF for e in range(4)]
            assert got == as_bf16(one[:, k].float()).tolist(), (bits, k)
        for k in range(n):  # per code: its own scale operands
            ops = dict(enumerate([0, 0, word] + pairs(as_bf16(hi[:, k])) + pairs(as_bf16(lo[:, k]))
                                 + pairs(as_bf16(zc[:, k]))))
            regs = _run_ptx(_int_dequant_ptx(bits, k), ops)
            got = [regs[f"${e // 2}"] >> (16 * (e % 2)) & 0xFFFF for e in range(4)]
            assert got == as_bf16(want[:, k]).tolist(), (bits, k)
            torch.testing.assert_close(want[:, k], (codes[:, k] * sc[:, k] + zr[:, k]).float(), rtol=0, atol=0.05)

# Mixed lengths: empty, shorter than the window, just past it, crossing page boundaries, odd.
LENS = [0, 7, 29, 33, 50, 97]


def check(out, lse, ref_out, ref_lse):
    scale = ref_out.abs().max().item() + 1e-6
    # bf16 operands (and, in the interpreter, truncating bf16 conversions) leave ~0.5 % of the output scale.
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=2e-2 * scale)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    torch.testing.assert_close(lse.double()[fin], ref_lse[fin], rtol=5e-3, atol=2e-2)


CASES = [
    # formats, dc, dr, heads, splits, out dtype
    (("bf16", "bf16"), 512, 64, 16, 1, torch.float32),
    (("int4", "int4"), 512, 64, 16, 3, torch.float32),
    (("int2", "int4"), 512, 64, 16, None, torch.bfloat16),
    (("fp8", "bf16"), 512, 64, 16, 2, torch.float32),
    (("bf16", "bf16"), 256, 32, 16, 4, torch.float32),
    (("int4", "int4:32"), 256, 32, 20, 1, torch.float32),
    (("int2", "int4:32"), 256, 32, 16, 2, torch.float32),
    (("fp8", "bf16"), 256, 32, 16, 1, torch.bfloat16),
    (("fp8:0", "fp8:0"), 512, 64, 16, 2, torch.float32),  # per-tensor (scale 1.0): no scale rows read
    # ranked content: only the stored groups are read (a power of two of them, or not)
    (("int8r128", "int4"), 512, 64, 16, 2, torch.float32),
    (("int4:32r96", "int4:32"), 256, 32, 16, 1, torch.float32),
]


@pytest.mark.parametrize("fmts,dc,dr,H,splits,odt", CASES, ids=[f"{c[0][0]}-{c[0][1]}-{c[1]}" for c in CASES])
def test_kernel_matches_reference(fmts, dc, dr, H, splits, odt):
    cache, table, seq_lens, slots, _, _ = fill(fmts, dc, dr, LENS, chunks=[5, 20, 1])
    qn, qp = queries(len(LENS), H, dc, dr)
    cfg = KernelConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
    out, lse = mla_decode(qn, qp, cache, table, seq_lens, slots, 0.07, num_splits=splits, out_dtype=odt, config=cfg)
    assert out.dtype == odt and out.shape == (len(LENS), H, dc) and lse.shape == (len(LENS), H)
    check(out, lse, *mla_decode_reference(qn, qp, cache, table, seq_lens, slots, 0.07))


@triton.jit
def _split_kernel(x_ptr, o_ptr, BITS: tl.constexpr, BN: tl.constexpr, DIM: tl.constexpr, GB: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, BN)[:, None] * DIM + tl.arange(0, DIM)[None, :])
    offs = tl.arange(0, BN)[:, None, None] * GB + tl.arange(0, GB)[None, None, :]
    if BITS == 4:
        c0, c1 = _split_codes(x, BITS, BN, GB)
        tl.store(o_ptr + offs, c0)
        tl.store(o_ptr + BN * GB + offs, c1)
    else:
        c0, c1, c2, c3 = _split_codes(x, BITS, BN, GB)
        tl.store(o_ptr + offs, c0)
        tl.store(o_ptr + BN * GB + offs, c1)
        tl.store(o_ptr + 2 * BN * GB + offs, c2)
        tl.store(o_ptr + 3 * BN * GB + offs, c3)


@pytest.mark.parametrize("bits", [4, 2])
def test_token_axis_scales_split_per_code(bits):
    """_split_codes (the token-axis ASM path's operands, GPU only) gives code k of byte i channel
    (8 / bits) * i + k's value: the channel the PTX call for code k dequantizes."""
    BN, DIM = 4, 32
    per, gb = 8 // bits, 32 * bits // 8
    x = torch.arange(BN * DIM, dtype=torch.float32, device=DEV).view(BN, DIM)
    out = torch.empty(per, BN, gb, device=DEV)
    _split_kernel[(1,)](x, out, bits, BN, DIM, gb)
    for k in range(per):
        assert torch.equal(out[k], x[:, k::per]), k


# Token-axis paths (sink 4, recent 24, page 16): blocks of g tokens from position 4 straddle pages; lengths
# end before the window fills (<= 28), at its edge (28, 29), mid-block, exactly at block ends (28 + k g) and
# across pages.
TOKEN_LENS = [0, 3, 4, 27, 28, 29, 31, 33, 35, 36, 37, 43, 44, 47, 52, 59, 61, 64, 97]
TOKEN_CASES = [
    # formats, block_n (page 16), splits
    (("int4:t8", "int4:32"), 16, 1),  # content only; a tile covers two blocks
    (("int4", "int4:t16"), 16, 3),  # rope only; a tile is one block
    (("int2:t8", "int4:t8"), 4, 2),  # both, one block size; tiles of half a block
    (("int4:t4", "int2:t16"), 8, None),  # both, different blocks: the paths quantize at different lengths
    (("int8:t8", "bf16"), 16, 1),  # beside a bf16 path (which goes to the pool token by token)
    (("fp8", "int4:t8"), 16, 2),  # beside a channel path
]


@pytest.mark.parametrize("fmts,block_n,splits", TOKEN_CASES, ids=[f"{c[0][0]}-{c[0][1]}-n{c[1]}" for c in TOKEN_CASES])
@pytest.mark.parametrize("sink", [4, 0])
def test_kernel_token_axis_matches_reference(fmts, block_n, splits, sink):
    dc, dr = 128, 32
    cache, table, seq_lens, slots, _, _ = fill(fmts, dc, dr, TOKEN_LENS, sink=sink, chunks=[5, 20, 1, 9])
    qn, qp = queries(len(TOKEN_LENS), 16, dc, dr)
    block_n = max(block_n, 16) if GPU else block_n  # tensor-core tiles are >= 16 tokens: several blocks each
    cfg = KernelConfig(block_h=16, block_n=block_n, num_warps=4, num_stages=1)
    out, lse = mla_decode(qn, qp, cache, table, seq_lens, slots, 0.07, num_splits=splits, config=cfg)
    check(out, lse, *mla_decode_reference(qn, qp, cache, table, seq_lens, slots, 0.07))


@pytest.mark.parametrize("scores_t,values_t", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("fmts,sink,recent", [(("int8r64", "int4:32"), 4, 24), (("int4:16r32", "int4:t16"), 0, 24),
                                              (("int2r128", "int4:32"), 0, 0)])
def test_kernel_ranked_body_matches_reference(fmts, sink, recent, scores_t, values_t):
    """A ranked content path whose rank is a power of two: body tiles only `rank` channels wide, beside
    protected rows of all channels (or none), and a token-axis RoPE path that quantizes later (MIXED)."""
    dc, dr = 256, 32
    cache, table, seq_lens, slots, _, _ = fill(fmts, dc, dr, [0, 7, 40, 97], sink=sink, recent=recent)
    qn, qp = queries(4, 16, dc, dr)
    cfg = KernelConfig(block_h=16, block_n=16, num_stages=1, scores_t=scores_t, values_t=values_t)
    out, lse = mla_decode(qn, qp, cache, table, seq_lens, slots, 0.07, num_splits=2, config=cfg)
    check(out, lse, *mla_decode_reference(qn, qp, cache, table, seq_lens, slots, 0.07))


@pytest.mark.parametrize("scores_t,values_t", [(False, True), (True, False), (True, True)])
def test_kernel_orientations(scores_t, values_t):
    dc, dr = 256, 32
    cache, table, seq_lens, slots, _, _ = fill(("int4", "int4:32"), dc, dr, [0, 40, 97])
    qn, qp = queries(3, 16, dc, dr)
    cfg = KernelConfig(block_h=16, block_n=16, num_stages=1, scores_t=scores_t, values_t=values_t)
    out, lse = mla_decode(qn, qp, cache, table, seq_lens, slots, 0.07, num_splits=2, config=cfg)
    check(out, lse, *mla_decode_reference(qn, qp, cache, table, seq_lens, slots, 0.07))


# Token-axis paths: a token-axis content path, or a token-axis RoPE path at 128 heads, ran out of shared memory
# on the H200 with two pipeline stages (the launcher refused them); default_config gives them one stage, which
# fits (tests/test_kernel_compile.py, offline). These GPU cases check that they launch and are right.
GPU_CASES = [
    ("bf16", "bf16", True),
    ("int4", "int4", True),
    ("int2", "int4", True),
    ("fp8", "bf16", True),
    ("fp8:0", "fp8:0", True),
    ("int4", "int4", False),  # the plain-Triton dequantization, on the GPU
    ("int4", "int4:t64", True),  # token-axis (KIVI) rope: per-channel scales per block of 64 tokens
    ("int8r128", "int4", True),  # ranked content: the PTX path with the unstored groups masked to 0
    ("int4r256", "int4", True),
    ("int4:t64", "int4:t64", True),
    ("int2:t64", "int4:t64", True),
    ("int2:t64", "int4", False),
]


@pytest.mark.skipif(not GPU, reason="needs a GPU: real tile shapes, inline-PTX dequantization, CUDA graphs")
@pytest.mark.parametrize("content,rope,asm", GPU_CASES)
def test_kernel_gpu_default_configs(content, rope, asm):
    """The launch defaults at serving shapes (page 64, window 4 + 128), both head classes."""
    dc, dr, lens = 512, 64, [0, 1, 131, 133, 195, 196, 197, 700, 4097]  # (token-axis blocks end at 132 + 64 k)
    cache, table, seq_lens, slots, _, _ = fill((content, rope), dc, dr, lens, page=64, recent=128)
    for H in (16, 128):
        qn, qp = (q.bfloat16() for q in queries(len(lens), H, dc, dr))
        cfg = replace(default_config(cache, H), asm=asm)
        out, lse = mla_decode(qn, qp, cache, table, seq_lens, slots, 0.05, config=cfg)
        check(out, lse, *mla_decode_reference(qn, qp, cache, table, seq_lens, slots, 0.05))


@pytest.mark.skipif(not GPU, reason="needs a GPU")
def test_kernel_gpu_token_axis_rope_at_128_heads():
    dc, dr, lens = 512, 64, [0, 131, 196, 700, 4097]
    cache, table, seq_lens, slots, _, _ = fill(("int4", "int4:t64"), dc, dr, lens, page=64, recent=128)
    qn, qp = (q.bfloat16() for q in queries(len(lens), 128, dc, dr))
    out, lse = mla_decode(qn, qp, cache, table, seq_lens, slots, 0.05)
    check(out, lse, *mla_decode_reference(qn, qp, cache, table, seq_lens, slots, 0.05))


@pytest.mark.skipif(not GPU, reason="the interpreter has no tensor-core tile limits to refuse")
def test_kernel_refuses_tiles_below_16_on_the_gpu():
    cache, table, seq_lens, slots, _, _ = fill(("int4", "int4:32"), 64, 32, [40], page=8)
    qn, qp = queries(1, 16, 64, 32)
    with pytest.raises(ValueError, match="at least 16"):
        mla_decode(qn, qp, cache, table, seq_lens, slots, 0.05)


@pytest.mark.skipif(not GPU, reason="needs a GPU")
def test_kernel_cuda_graph_replay():
    dc, dr, lens = 512, 64, [5, 300, 1000]
    cache, table, seq_lens, slots, _, _ = fill(("int4", "int4"), dc, dr, lens, page=64, recent=128)
    qn, qp = (q.bfloat16() for q in queries(3, 16, dc, dr))
    lens_dev = seq_lens.clone()
    mla_decode(qn, qp, cache, table, lens_dev, slots, 0.05, max_seq_len=1000)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = mla_decode(qn, qp, cache, table, lens_dev, slots, 0.05, max_seq_len=1000)
    for new in ([5, 300, 1000], [0, 299, 777]):
        lens_dev.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        check(out, lse, *mla_decode_reference(qn, qp, cache, table, lens_dev, slots, 0.05))


@pytest.mark.skipif(not GPU, reason="needs a GPU: CUDA graphs and the CUDA sync checker")
@pytest.mark.parametrize("fmts", [("int4", "int4"), ("int4", "int4:t64"), ("int8r128", "int4")])
def test_decode_step_writer_and_kernel_in_one_cuda_graph(fmts):
    """An engine's decode step — append the new token (unchecked: no host sync), attend over the grown
    cache — captured once as a CUDA graph and replayed step after step, equals the eager checked writer
    plus the reference; the checked writer is the one that syncs. Token-axis: a block completes at 195."""
    dc, dr, lens, steps = 512, 64, [3, 130, 192], 6  # a sink token joins, the window starts to move
    mk = lambda: fill(fmts, dc, dr, lens, page=64, recent=128)  # noqa: E731 (same seed: same cache)
    cache, table, seq_lens, slots, _, _ = mk()
    eager, *_ = mk()
    g = torch.Generator().manual_seed(5)
    qn, qp = (q.bfloat16() for q in queries(3, 16, dc, dr))
    c_in = torch.zeros(3, dc, dtype=torch.bfloat16, device=DEV)
    r_in = torch.zeros(3, dr, dtype=torch.bfloat16, device=DEV)
    lens_dev, lens_after = seq_lens.clone(), seq_lens.clone()

    def step(cache):
        cache.append_decode(slots, table, lens_dev, c_in, r_in, checked=False)
        lens_after.copy_(lens_dev + 1)
        return mla_decode(qn, qp, cache, table, lens_after, slots, 0.05, max_seq_len=512)

    scratch, *_ = mk()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            scratch.append_decode(slots, table, lens_dev, c_in, r_in)  # checked: reads the data on the host
        step(scratch)  # compiles the kernel, and must not sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step(cache)
    for _ in range(steps):
        new_c = torch.randn(3, dc, generator=g).bfloat16().to(DEV)
        new_r = torch.randn(3, dr, generator=g).bfloat16().to(DEV)
        c_in.copy_(new_c)
        r_in.copy_(new_r)
        graph.replay()
        eager.append_decode(slots, table, lens_dev, new_c, new_r)
        lens_dev += 1
        check(out, lse, *mla_decode_reference(qn, qp, eager, table, lens_dev, slots, 0.05))
    for a, b in zip(cache.content.tensors() + cache.rope.tensors(), eager.content.tensors() + eager.rope.tensors()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# --- shared by the other kernels' tests (the CUDA and the many-heads kernel) -----------------------------------


def kernel_matches_reference(decode, unsupported, fmts, H, lens, dc=512, dr=64, splits=None, odt=torch.float32,
                             sink=4, recent=128, seed=0, page=64):
    """A cache of `lens` (`fill`), decoded by `decode` (a launcher with `mla_decode`'s contract, which
    `unsupported(cache, H, device)` must accept) and checked against `mla_decode_reference`; returns the cache."""
    cache, table, seq_lens, slots, _, _ = fill(fmts, dc, dr, lens, page=page, recent=recent, sink=sink, seed=seed)
    qn, qp = queries(len(lens), H, dc, dr)
    assert unsupported(cache, H, qn.device) is None
    out, lse = decode(qn, qp, cache, table, seq_lens, slots, 0.05, max_seq_len=max(lens), out_dtype=odt,
                      num_splits=splits)
    assert out.dtype == odt and out.shape == (len(lens), H, dc) and lse.shape == (len(lens), H)
    check(out, lse, *mla_decode_reference(qn, qp, cache, table, seq_lens, slots, 0.05))
    return cache


def graph_replays_match_reference(decode, fmts, H, dc=512, dr=64):
    """`decode` (a launcher with `mla_decode`'s contract, compiled and loaded beforehand by a first call)
    captured once in a CUDA graph at lengths [200, 300, 1000], then replayed at other lengths within what was
    written (unwritten rows are NaN): each replay matches `mla_decode_reference`."""
    cache, table, seq_lens, slots, _, _ = fill(fmts, dc, dr, [200, 300, 1000], page=64, recent=128)
    qn, qp = (q.bfloat16() for q in queries(3, H, dc, dr))
    lens_dev = seq_lens.clone()
    run = lambda: decode(qn, qp, cache, table, lens_dev, slots, 0.05, max_seq_len=1000)  # noqa: E731
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run()
    for new in ([200, 300, 1000], [0, 133, 777], [132, 1, 999]):
        lens_dev.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        check(out, lse, *mla_decode_reference(qn, qp, cache, table, lens_dev, slots, 0.05))


def loose_bound_matches_exact(decode, fmts, H, length, bound, dc=512, dr=64, page=64):
    """`decode` (a launcher with `mla_decode`'s contract) on three sequences of `length` tokens, with
    max_seq_len = length and = bound (an engine's bound: its grid holds more splits): each sequence takes the
    split count of its own length, so both give the same bits. Then a batch of mixed lengths under the bound
    against the reference."""
    cache, table, seq_lens, slots, _, _ = fill(fmts, dc, dr, [length] * 3, page=page, recent=128)
    qn, qp = (q.bfloat16() for q in queries(3, H, dc, dr))
    exact = decode(qn, qp, cache, table, seq_lens, slots, 0.05, max_seq_len=length)
    loose = decode(qn, qp, cache, table, seq_lens, slots, 0.05, max_seq_len=bound)
    assert torch.equal(exact[0], loose[0]) and torch.equal(exact[1], loose[1])
    mixed = torch.tensor([length, length // 3, 1], dtype=torch.int32, device=seq_lens.device)
    check(*decode(qn, qp, cache, table, mixed, slots, 0.05, max_seq_len=bound),
          *mla_decode_reference(qn, qp, cache, table, mixed, slots, 0.05))  # fmt: skip


def test_kernel_loose_bound_gives_the_exact_bounds_bits():
    """The engine passes max_model_len: the Triton kernel sizes its grid for it (ceil(sqrt(8192) / 2) = 46 splits
    here) but a 1100-token sequence still takes ceil(sqrt(1100) / 2) = 17."""
    from quantmla.kernels.mla_decode import num_splits_for

    cfg = default_config(fill(("int4", "int4:32"), 256, 32, [1], page=64)[0], 16)
    assert num_splits_for(3, 16, 8192, cfg, 132) == 46 and num_splits_for(3, 16, 1100, cfg, 132) == 17
    loose_bound_matches_exact(mla_decode, ("int4", "int4:32"), 16, 1100, 8192, dc=256, dr=32)


def test_kernel_empty_batch():
    """B = 0 (an engine step with no decodes): empty outputs, whether the split count is given or sized here."""
    cache, table, seq_lens, slots, _, _ = fill(("int4:32", "int4:16"), 64, 16, [5], page=16)
    qn, qp = queries(0, 3, 64, 16)
    for splits in (None, 2):
        out, lse = mla_decode(qn, qp, cache, table[:0], seq_lens[:0], slots[:0], 0.1, num_splits=splits)
        assert out.shape == (0, 3, 64) and lse.shape == (0, 3)


def test_kernel_refuses_no_splits():
    """num_splits = 0 launched no program and returned zeros with lse -inf; it is refused instead."""
    cache, table, seq_lens, slots, _, _ = fill(("int4:32", "int4:16"), 64, 16, [5], page=16)
    qn, qp = queries(1, 3, 64, 16)
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        mla_decode(qn, qp, cache, table, seq_lens, slots, 0.1, num_splits=0)


def test_kernel_reads_strided_tables_lengths_and_slots():
    """A transposed block table (rows not unit-stride) and lengths / slots that are columns of a wider tensor
    read the same entries as their contiguous copies."""
    # page 16: the smallest the GPU takes (a tensor-core tile), so that this runs there too
    cache, table, seq_lens, slots, _, _ = fill(("int4:32", "int4:16"), 64, 16, [0, 9, 40], page=16, recent=5)
    qn, qp = queries(3, 3, 64, 16)
    strided = (table.t().contiguous().t(), torch.stack([seq_lens, seq_lens * 0], 1)[:, 0],
               torch.stack([slots, slots * 0], 1)[:, 0])
    assert strided[0].stride(-1) != 1 and strided[1].stride(-1) != 1
    check(*mla_decode(qn, qp, cache, *strided, 0.1, num_splits=2),
          *mla_decode_reference(qn, qp, cache, table, seq_lens, slots, 0.1))


def test_combine_reads_no_output_of_an_empty_split():
    """A split with lse = -inf wrote no output (its bytes may be anything, NaN here): the combine skips them.
    11 splits: two chunks of COMBINE_CHUNK = 8, empty ones in both; a sequence whose splits are all empty."""
    from quantmla.kernels.mla_decode import combine_splits

    po = torch.randn(3, 11, 4, 256, device=DEV)
    plse = torch.randn(3, 11, 4, device=DEV) * 3
    empty = [1, 8, 9]
    po[:, empty], plse[:, empty] = float("nan"), float("-inf")
    po[2], plse[2] = float("nan"), float("-inf")
    out, lse = torch.empty(3, 4, 256, device=DEV), torch.empty(3, 4, device=DEV)
    combine_splits(po, plse, out, lse)
    live = [i for i in range(11) if i not in empty]
    w = torch.softmax(plse[:2, live], 1)
    torch.testing.assert_close(out[:2], (w[..., None] * po[:2, live]).sum(1))
    torch.testing.assert_close(lse[:2], torch.logsumexp(plse[:2, live], 1))
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isneginf(lse[2]).all()


def packed_rows(cache, pads):
    """`cache` with pools whose rows lie further apart than their width (fields of one packed row, as in vLLM),
    the padding NaN (0x7F codes): pads = extra elements per row of (content codes, content scale / zero, rope
    codes, rope scale / zero)."""
    def widen(t, pad):
        if t is None:
            return None
        buf = torch.full((*t.shape[:2], t.shape[2] + pad), 0x7F if t.dtype == torch.uint8 else float("nan"),
                         dtype=t.dtype, device=t.device)  # fmt: skip
        buf[..., : t.shape[2]] = t
        return buf[..., : t.shape[2]]

    def path(p, code_pad, sz_pad):
        return PagedPath(p.fmt, p.dim, widen(p.codes, code_pad), widen(p.scale, sz_pad), widen(p.zero, sz_pad))

    packed = replace(cache, content=path(cache.content, *pads[:2]), rope=path(cache.rope, *pads[2:]))
    assert packed.content.codes.stride(1) > packed.content.codes.shape[2]
    return packed


@pytest.mark.parametrize("kernel,module,name", [
    ("cuda", "quantmla.kernels.mla_decode_cuda", "mla_decode_cuda"),
    ("heads", "quantmla.kernels.mla_decode_many_heads", "mla_decode_many_heads"),
    ("gluon", "quantmla.kernels.mla_decode_gluon", "mla_decode_gluon"),
])  # fmt: skip
def test_a_forced_kernel_reaches_its_launcher(monkeypatch, kernel, module, name):
    """$QUANTMLA_DECODE_KERNEL=kernel: mla_decode hands the call, as it got it, to that kernel's launcher."""
    import importlib

    from quantmla.kernels.mla_decode_cuda import ENV

    calls = []
    monkeypatch.setattr(importlib.import_module(module), name, lambda *a, **k: calls.append((a, k)) or "out")
    monkeypatch.setenv(ENV, kernel)
    cache, table, seq_lens, slots, _, _ = fill(("int4", "int4"), 512, 64, [70], page=64)
    qn, qp = queries(1, 16, 512, 64)
    assert mla_decode(qn, qp, cache, table, seq_lens, slots, 0.1, max_seq_len=70, num_splits=3) == "out"
    (args, kw), = calls
    assert args[2] is cache and args[6] == 0.1 and kw["max_seq_len"] == 70 and kw["num_splits"] == 3
