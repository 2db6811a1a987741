"""The fused decode-step writer (`append_decode_fused`, one Triton kernel) against the torch writer
(`PagedMLACache.append_decode(checked=False)`): two identical caches, several consecutive steps, and after
every step the pools, scales, zeros and protected rows must be byte-identical.

Inputs are built to be hard on the quantizer: coarse grids (fp8 rounding ties, clamping beyond 448),
constant groups, ranges so small that the fp16 scale is subnormal (stepped up a ulp) with values on
exact rounding ties, and tiny groups whose fp16 zero is off the group minimum (codes clamp at 0).
Without a GPU the kernel runs under TRITON_INTERPRET=1; with one, against torch's CUDA writer.
"""

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="the fused writer needs triton")

from quantmla.cache.paged import PagedMLACache, make_block_tables  # noqa: E402
from quantmla.config import CacheConfig, QuantFormat  # noqa: E402
from quantmla.kernels import cache_write  # noqa: E402
from quantmla.kernels.cache_write import append_decode_fused  # noqa: E402
from quantmla.quant.formats import quantize  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEV == "cuda"
LENS = [0, 2, 4, 9, 12, 13, 30, 37]  # with sink 4, recent 8, page 16 and 5 steps: L < sink, L = sink, in the
# window, L = sink + recent (first eviction), evictions that cross a page boundary (positions 31 -> 32)


def _group(fmt: QuantFormat, group: int, kind: int, g: torch.Generator) -> torch.Tensor:
    """One group of `group` values (fp32, all exact in bf16) of the given kind."""
    rand = lambda *s: torch.rand(*s, generator=g)  # noqa: E731
    if kind == 0:  # a coarse grid: ties between e4m3 neighbours, and now and then beyond fp8's 448
        x = torch.randint(-64, 65, (group,), generator=g) / 16 * 2.0 ** torch.randint(-2, 4, (1,), generator=g)
        if rand(1) < 0.2:
            x[torch.randint(group, (1,), generator=g)] = 600.0 * (1 if rand(1) < 0.5 else -1)
        return x
    if kind == 1:  # constant (range 0: the smallest scale)
        return torch.full((group,), float(torch.randint(-8, 9, (1,), generator=g)) / 4)
    if kind == 2:  # range J * 2^-25: subnormal fp16 scale s, values on odd multiples of s / 2 (ties)
        J = int(torch.randint(16, 256, (1,), generator=g))
        x = torch.zeros(group)
        x[1] = J * 2.0**-25
        if fmt.is_integer:
            m = int(quantize(x[None], QuantFormat(fmt.kind, group, clip=fmt.clip)).scale[0, 0].float() / 2.0**-24)
            k = torch.randint(0, max((J // m - 1) // 2, 0) + 1, (group - 2,), generator=g)
            x[2:] = (2 * k + 1) * m * 2.0**-25
        return x[torch.randperm(group, generator=g)]
    if kind == 3:  # fp8 group scale 2^e exactly (amax 448 * 2^e), values on e4m3 ties (normal and subnormal)
        e = 2.0 ** int(torch.randint(-8, -1, (1,), generator=g))
        i = torch.randint(0, 8, (group,), generator=g)
        x = torch.where(rand(group) < 0.5, 1 + (2 * i + 1) / 16, (2 * i + 1) * 2.0**-10) * e
        x[0] = 448 * e
        return x * torch.where(rand(group) < 0.5, 1.0, -1.0)
    if kind == 4:  # tiny and arbitrary: fp16(min) is off the minimum, codes clamp at 0
        return (torch.randn(group, generator=g) * 2.0**-20).bfloat16().float()
    return (torch.randn(group, generator=g) * 3).bfloat16().float()


def tricky(n: int, dim: int, fmt: QuantFormat, g: torch.Generator) -> torch.Tensor:
    """[n, dim] bf16 tokens made of groups of every kind (in the format's groups)."""
    group = fmt.group or min(dim, 32)
    kinds = torch.randint(0, 6, (n * (dim // group),), generator=g).tolist()
    x = torch.stack([_group(fmt, group, k, g) for k in kinds] or [torch.zeros(group)])[: len(kinds)]
    x = x.reshape(n, dim)
    return (x + 0.0).bfloat16()  # + 0.0: no negative zeros (torch's amin may pick either sign of zero)


def _assert_same(ref: PagedMLACache, fused: PagedMLACache, step: int) -> None:
    names = ["content." + n for n in ("codes", "scale", "zero")] + ["rope." + n for n in ("codes", "scale", "zero")]
    names += ["protected_content", "protected_rope"]
    for name in names:
        a, b = ref, fused
        for part in name.split("."):
            a, b = getattr(a, part), getattr(b, part)
        if a is None:
            continue
        same = a.view(torch.uint8) == b.view(torch.uint8)
        assert same.all(), f"step {step}: {name} differs in {int((~same).sum())} bytes"


def run_pair(fmts, lens=LENS, *, sink=4, recent=8, page=16, steps=5, dc=128, dr=64, dtype=torch.bfloat16,
             in_dtype=torch.bfloat16, garbage=False, seed=0):
    """Both writers over `steps` decode steps from caches prefilled (by the torch writer) to `lens`."""
    g = torch.Generator().manual_seed(seed)
    cfg = CacheConfig(*fmts, sink=sink, recent=recent)
    B, max_seqs = len(lens), len(lens) + 3
    _, used = make_block_tables([L + steps for L in lens], page)
    tables, _ = make_block_tables([L + steps for L in lens], page, num_blocks=used + 2, generator=g)  # shuffled
    ref = PagedMLACache.allocate(cfg, dc, dr, used + 2, max_seqs, block_size=page, device=DEV, fill=float("nan"),
                                 dtype=dtype)  # fmt: skip
    if garbage:  # random bytes everywhere: NaNs, infs, subnormals, any code
        for t in ref.content.tensors() + ref.rope.tensors() + [ref.protected_content, ref.protected_rope]:
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g))
    slots = torch.randperm(max_seqs, generator=g)[:B].to(torch.int32).to(DEV)
    tables = tables.to(DEV)
    for b, L in enumerate(lens):
        c, r = tricky(L, dc, cfg.content, g).to(DEV), tricky(L, dr, cfg.rope, g).to(DEV)
        ref.append(int(slots[b]), tables[b], 0, c[: L // 2].to(in_dtype), r[: L // 2].to(in_dtype))
        ref.append(int(slots[b]), tables[b], L // 2, c[L // 2 :].to(in_dtype), r[L // 2 :].to(in_dtype))
    fused = copy.deepcopy(ref)
    lens_dev = torch.tensor(lens, dtype=torch.int32, device=DEV)
    for step in range(steps):
        # c and k_pe as the model hands them over: two slices of one [B, dc + dr] projection (strided rows).
        kv = torch.cat([tricky(B, dc, cfg.content, g), tricky(B, dr, cfg.rope, g)], dim=1).to(DEV)
        if in_dtype != torch.bfloat16:  # off the bf16 grid: the writers' casts must round alike
            kv = kv.to(in_dtype) + torch.randn(kv.shape, generator=g).to(DEV, in_dtype) * 2.0**-12
        c, r = kv[:, :dc], kv[:, dc:]
        ref.append_decode(slots, tables, lens_dev, c, r, checked=False)
        append_decode_fused(fused, slots, tables, lens_dev, c, r)
        _assert_same(ref, fused, step)
        lens_dev += 1


@pytest.mark.parametrize(
    "fmts",
    [("bf16", "bf16"), ("int4", "int4"), ("int2", "int4"), ("int8", "int8"), ("int4:32", "int4:32"),
     ("fp8", "fp8:0"), ("fp8:32", "fp8:32"), ("int4", "bf16"), ("bf16", "int2:32"),
     ("int4c0.85", "int2:32c0.7"), ("int8c0.9", "int4:16c0.95"), ("int8r64", "int4"), ("int2:16r32c0.9", "int4")],
)  # fmt: skip
def test_fused_writer_is_byte_identical(fmts):
    run_pair(fmts)


@pytest.mark.parametrize("fmts", [("int4", "int2:32"), ("int8r64", "int4")])
@pytest.mark.parametrize("sink,recent", [(0, 8), (4, 0), (0, 0), (3, 5), (2, 1)])
def test_fused_writer_windows(sink, recent, fmts):
    """recent = 0 (tokens quantized at once; only sinks protected), sink = 0, no window at all, odd sizes."""
    run_pair(fmts, sink=sink, recent=recent, steps=4)


def test_fused_writer_dtypes_and_garbage():
    """fp32 / fp16 tokens into bf16 rows (round to nearest even in both writers), an fp32 cache, random pool
    bytes (NaN, inf, any code) everywhere."""
    run_pair(("bf16", "int4"), in_dtype=torch.float32, steps=3)
    run_pair(("int2", "bf16"), in_dtype=torch.float16, steps=2)
    run_pair(("int8", "fp8:32"), dtype=torch.float32, in_dtype=torch.float32, steps=3)
    run_pair(("int4", "fp8:0"), garbage=True, steps=3, seed=1)


def test_fused_writer_minicpm3_dims_and_pages():
    """MiniCPM3's 256/32 dims, page 8 (every few steps a page boundary), a long sequence."""
    run_pair(("int4", "int4:32"), lens=[0, 5, 130], dc=256, dr=32, page=8, steps=4)


def test_fused_writer_reads_strided_tables_lengths_and_slots():
    """A transposed block table and lengths / slots that are columns of a wider tensor: the same bytes."""
    g = torch.Generator().manual_seed(0)
    lens = [0, 4, 9, 20]
    tables, nb = make_block_tables([L + 1 for L in lens], 8, generator=g)
    ref = PagedMLACache.allocate(CacheConfig("int4:16", "int4:8", sink=2, recent=3), 64, 16, nb, 4, block_size=8,
                                 device=DEV, fill=float("nan"))  # fmt: skip
    tables, lens_t = tables.to(DEV), torch.tensor(lens, device=DEV)
    slots = torch.arange(4, dtype=torch.int32, device=DEV)
    for b, L in enumerate(lens):
        ref.append(b, tables[b], 0, torch.randn(L, 64, generator=g).bfloat16().to(DEV),
                   torch.randn(L, 16, generator=g).bfloat16().to(DEV))
    fused = copy.deepcopy(ref)
    c, r = torch.randn(4, 64, generator=g).bfloat16().to(DEV), torch.randn(4, 16, generator=g).bfloat16().to(DEV)
    ref.append_decode(slots, tables, lens_t, c, r, checked=False)
    column = lambda x: torch.stack([x, x * 0], 1)[:, 0]  # noqa: E731
    append_decode_fused(fused, column(slots), tables.t().contiguous().t(), column(lens_t), c, r)
    _assert_same(ref, fused, 0)


def test_checked_or_no_kernel_runs_the_torch_writer(monkeypatch):
    """checked=True keeps the torch writer's host-side checks; CPU tensors outside the interpreter take it too."""
    cfg = CacheConfig("int4", "int4", sink=2, recent=2)
    cache = PagedMLACache.allocate(cfg, 64, 64, 2, 2, block_size=4, device=DEV)
    tables, slots = torch.tensor([[0, 1]], device=DEV), torch.tensor([1], device=DEV)
    c = torch.full((1, 64), float("nan"), device=DEV)
    with pytest.raises(ValueError, match="non-finite"):
        append_decode_fused(cache, slots, tables, torch.tensor([3], device=DEV), c, c, checked=True)
    if not GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # as if on a CPU machine outside the interpreter
        monkeypatch.setattr(cache_write, "_append_decode_kernel", None)  # and no launch may happen
        ref = copy.deepcopy(cache)
        x = torch.randn(1, 64).bfloat16()
        append_decode_fused(cache, slots, tables, torch.tensor([3]), x, x)
        ref.append_decode(slots, tables, torch.tensor([3]), x, x)
        _assert_same(ref, cache, 0)


@pytest.mark.skipif(not GPU, reason="needs a GPU: CUDA graphs")
def test_fused_writer_in_a_cuda_graph():
    """Captured once (no host syncs), replayed step after step: the same bytes as the eager torch writer."""
    g = torch.Generator().manual_seed(3)
    cfg = CacheConfig("int4", "int4", sink=4, recent=128)
    dc, dr, page, lens, steps = 512, 64, 64, [3, 130, 140, 0], 6
    tables, nb = make_block_tables([L + steps for L in lens], page, generator=g)
    ref = PagedMLACache.allocate(cfg, dc, dr, nb, 4, block_size=page, device=DEV, fill=float("nan"))
    tables, slots = tables.to(DEV), torch.tensor([2, 0, 3, 1], dtype=torch.int32, device=DEV)
    for b, L in enumerate(lens):
        c, r = tricky(L, dc, cfg.content, g).to(DEV), tricky(L, dr, cfg.rope, g).to(DEV)
        ref.append(int(slots[b]), tables[b], 0, c, r)
    fused = copy.deepcopy(ref)
    c_in = torch.zeros(4, dc, dtype=torch.bfloat16, device=DEV)
    r_in = torch.zeros(4, dr, dtype=torch.bfloat16, device=DEV)
    lens_dev = torch.tensor(lens, dtype=torch.int32, device=DEV)
    scratch = copy.deepcopy(ref)
    torch.cuda.set_sync_debug_mode("error")
    try:
        append_decode_fused(scratch, slots, tables, lens_dev, c_in, r_in)  # compiles, and must not sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        append_decode_fused(fused, slots, tables, lens_dev, c_in, r_in)
    for step in range(steps):
        c_in.copy_(tricky(4, dc, cfg.content, g))
        r_in.copy_(tricky(4, dr, cfg.rope, g))
        graph.replay()
        ref.append_decode(slots, tables, lens_dev, c_in, r_in, checked=False)
        _assert_same(ref, fused, step)
        lens_dev += 1


@pytest.mark.parametrize("fmts", [("int4", "int4:t8"), ("int2:t16", "int4"), ("int4:32r96", "int4")])
def test_token_axis_or_odd_rank_caches_take_the_torch_writer(monkeypatch, fmts):
    """The kernel writes channel-grouped tokens one at a time, not token-axis blocks, and only power-of-two
    ranks: append_decode_fused hands a cache with a token-axis path or a rank of 96 to the torch writer (byte
    for byte the same, as always), without a launch."""
    monkeypatch.setattr(cache_write, "_append_decode_kernel", None)  # a launch would fail
    run_pair(fmts, steps=9)  # with sink 4, recent 8: blocks of 8 complete at lengths 20 and 28
