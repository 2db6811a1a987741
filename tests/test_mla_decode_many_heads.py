"""The many-heads Hopper decode kernel (`quantmla.kernels.mla_decode_many_heads`): what it refuses, on any
machine; on an sm_90 GPU with triton.experimental.gluon, the kernel against the fp64 reference on awkward
shapes (empty, shorter than the window, page crossings, odd lengths, NaN in every unused row)."""

import pytest
import torch

from quantmla.cache.paged import PagedMLACache
from quantmla.config import CacheConfig
from quantmla.kernels import mla_decode_many_heads as mh
from quantmla.kernels.mla_decode import mla_decode_reference

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and mh.gluon is not None
needs_hopper = pytest.mark.skipif(not GPU, reason="needs an sm_90 GPU and triton.experimental.gluon")


def _cache(fmts, dc=512, dr=64, page=64):
    return PagedMLACache.allocate(CacheConfig(*fmts, sink=4, recent=128), dc, dr, 4, 2, block_size=page)


@pytest.mark.parametrize("fmts,dc,dr,page,want", [
    (("int4:t64", "int4"), 512, 64, 64, "content path stored as int4:t64"),
    (("bf16", "bf16"), 512, 64, 64, "bf16 content"),
    (("int8", "int4"), 512, 64, 64, "content path stored as int8"),
    (("int4", "int4"), 512, 64, 32, "pages of a multiple of 64"),
    (("int4", "int4:16"), 512, 48, 64, "power-of-two dims"),
    (("int4", "int4"), 512, 64, 64, "not a CUDA device"),
])  # fmt: skip
def test_refusals_name_the_problem(fmts, dc, dr, page, want):
    if mh.gluon is None:
        pytest.skip("triton.experimental.gluon is not available")
    assert want in mh.unsupported_reason(_cache(fmts, dc, dr, page), 128, torch.device("cpu"))


@pytest.mark.parametrize("version,ok", [("3.5.1", False), ("3.6.0", True), ("3.9.0", True), ("3.10.0", False),
                                        ("4.0.0+git1234", False)])  # fmt: skip
def test_refuses_triton_releases_it_is_not_built_for(monkeypatch, version, ok):
    """Both Gluon kernels (this one and the few-heads mla_decode_gluon) check the release in hopper_reason."""
    from quantmla.kernels import mla_decode_gluon as mg

    if mh.gluon is None:
        pytest.skip("triton.experimental.gluon is not available")
    monkeypatch.setattr(mg.triton, "__version__", version)
    cache = _cache(("int4", "int4"))
    for why in (mh.unsupported_reason(cache, 128, torch.device("cpu")),
                mg.unsupported_reason(cache, 16, torch.device("cpu"))):
        assert ("Triton" in why) != ok and (ok or version in why)


@pytest.mark.parametrize("bits", [4, 2])
def test_dequant_ptx_gives_code_times_scale_plus_zero(bits):
    """`_dequant_ptx` on every code in every byte position, executed by test_mla_decode's PTX interpreter: output
    tensor k, element e holds code k of byte e (the kernel's join of the outputs relies on it), as
    (code - mid) * scale + (zero + mid * scale) in fp16."""
    import numpy as np
    from test_mla_decode import _run_ptx

    n_out, mid = 8 // bits, 1 << (bits - 1)
    ptx = mh._dequant_ptx(bits)
    g = np.random.default_rng(0)
    for _ in range(64):
        codes = g.integers(0, 1 << bits, size=(4, n_out))  # byte e, code k
        word = int(sum(int(sum(int(codes[e, k]) << (bits * k) for k in range(n_out))) << (8 * e) for e in range(4)))
        scale, zero = np.float16(g.uniform(0.01, 2)), np.float16(g.uniform(-5, 5))
        zc = np.float16(np.float32(zero) + mid * np.float32(scale))
        pair = lambda v: int(np.array([v, v], dtype=np.float16).view(np.uint32)[0])  # noqa: E731
        out = _run_ptx(ptx, {2 * n_out: word, 2 * n_out + 1: pair(scale), 2 * n_out + 2: pair(scale),
                             2 * n_out + 3: pair(zc), 2 * n_out + 4: pair(zc)})
        for k in range(n_out):
            got = np.array([out[f"${2 * k}"], out[f"${2 * k + 1}"]], dtype=np.uint32).view(np.float16)
            want = ((codes[:, k] - mid) * np.float64(scale) + np.float64(zc)).astype(np.float16)
            assert np.array_equal(got, want), (k, codes[:, k], got, want)
            # and that is code * scale + zero up to one fp16 rounding of the centred zero and of the result
            np.testing.assert_allclose(got.astype(np.float64), codes[:, k] * float(scale) + float(zero),
                                       rtol=2e-3, atol=2e-3 * (abs(float(zc)) + float(scale) * mid))


@pytest.mark.parametrize("sink,recent", [(0, 0), (4, 128), (70, 8), (64, 64)])
def test_tiles_walked_counts_the_quantized_positions_tiles_and_the_protected_rows(sink, recent):
    """Positions [sink, L - recent) are quantized and read by the 64-aligned tiles that hold them; the other
    rows are protected and read 64 at a time."""
    for length in [0, 1, 3, 63, 64, 65, 131, 132, 133, 200, 1000, 4096, 16384]:
        quantized = range(sink, max(length - recent, sink))
        tiles = len({p // 64 for p in quantized}) + -(-(length - len(quantized)) // 64)
        assert mh.tiles_walked(length, sink, recent) == tiles, length


@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("batch", [1, 2, 5, 16, 64])
def test_default_splits_leave_no_split_empty(heads, batch):
    """The kernel gives split s tiles [s * per, (s + 1) * per), per = ceil(tiles / splits): every split has
    tiles, there is no more than one split per min_split tokens (4 tiles), and no more CTAs than about one per
    SM unless the batch alone makes more."""
    for length in [1, 100, 300, 4096, 16384, 65536, 100000]:
        tiles = mh.tiles_walked(length, 4, 128)
        splits = mh.default_splits(batch, heads, length, 132, sink=4, recent=128)
        per = -(-tiles // splits)
        assert -(-tiles // per) == splits, (length, splits)
        assert splits <= max(1, -(-tiles // 4)), (length, splits)
        assert splits * batch * -(-heads // 64) <= max(132 + 66, batch * -(-heads // 64)), (length, splits)


# --- the kernel on the GPU ------------------------------------------------------------------------------------

if GPU:
    from test_mla_decode import (  # noqa: E402
        check, fill, graph_replays_match_reference, kernel_matches_reference, loose_bound_matches_exact, packed_rows,
        queries)

LENS = [0, 1, 7, 131, 132, 133, 200, 257, 700, 4097]


def _run(fmts, H, lens=LENS, **kw):
    return kernel_matches_reference(mh.mla_decode_many_heads, mh.unsupported_reason, fmts, H, lens, **kw)


@needs_hopper
@pytest.mark.parametrize("fmts", [("int4", "int4"), ("int2", "int4"), ("fp8", "bf16"), ("fp8:0", "fp8:0")])
@pytest.mark.parametrize("H", [128, 40])
def test_kernel_matches_reference(fmts, H):
    _run(fmts, H)


@needs_hopper
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_kernel_splits_and_bf16_out(splits):
    _run(("int4", "int4"), 64, splits=splits, odt=torch.bfloat16, seed=splits)


@needs_hopper
@pytest.mark.parametrize("sink,recent,page", [(0, 0, 64), (0, 64, 64), (70, 8, 128)])
def test_kernel_windows_and_pages(sink, recent, page):
    """No protected rows, a window with no sink, a sink past the first tile of a page of two tiles."""
    _run(("int4", "int4"), 128, lens=[0, 5, 64, 65, 78, 79, 300, 1000], sink=sink, recent=recent, page=page)


@needs_hopper
def test_kernel_loose_bound_gives_the_exact_bounds_bits():
    """A 128 K bound sizes the grid (22 splits for 3 x 128 heads); a 3000-token sequence still takes
    `split_length`'s 12 splits of 4 tiles."""
    assert mh.default_splits(3, 128, 3000, 132, sink=4, recent=128) == 12
    assert mh.default_splits(3, 128, 131072, 132, sink=4, recent=128) == 22
    loose_bound_matches_exact(mh.mla_decode_many_heads, ("int4", "int4"), 128, 3000, 131072)


@needs_hopper
def test_kernel_minicpm3_dims_and_one_head():
    _run(("int4", "int4:32"), 40, dc=256, dr=32)
    _run(("int2", "int4"), 1)


@needs_hopper
def test_kernel_packed_rows():
    """Pools whose rows lie further apart than their width (fields of one packed row, as in vLLM)."""
    cache, table, seq_lens, slots, _, _ = fill(("int4", "int4"), 512, 64, LENS, page=64, recent=128)
    packed = packed_rows(cache, (48, 3, 80, 5))
    assert mh.unsupported_reason(packed, 128, torch.device("cuda")) is None
    qn, qp = queries(len(LENS), 128, 512, 64)
    out, lse = mh.mla_decode_many_heads(qn, qp, packed, table, seq_lens, slots, 0.05, max_seq_len=max(LENS))
    check(out, lse, *mla_decode_reference(qn, qp, cache, table, seq_lens, slots, 0.05))


@needs_hopper
def test_mla_decode_runs_it_when_asked_and_by_default_at_many_heads(monkeypatch):
    from quantmla.kernels import mla_decode_cuda as mdc
    from quantmla.kernels.mla_decode import mla_decode

    cache, table, seq_lens, slots, _, _ = fill(("int4", "int4"), 512, 64, [500, 90], page=64, recent=128)
    qn, qp = queries(2, 128, 512, 64)
    called = []
    real = mh.mla_decode_many_heads
    monkeypatch.setattr(mh, "mla_decode_many_heads", lambda *a, **k: called.append(1) or real(*a, **k))
    monkeypatch.delenv(mdc.ENV, raising=False)
    assert mdc.decode_kernel_name(cache, 128, qn.device, batch=2) == "heads"
    out, lse = mla_decode(qn, qp, cache, table, seq_lens, slots, 0.05, max_seq_len=500)
    monkeypatch.setenv(mdc.ENV, "heads")
    out16, lse16 = mla_decode(qn[:, :16], qp[:, :16], cache, table, seq_lens, slots, 0.05, max_seq_len=500)
    assert len(called) == 2
    check(out, lse, *mla_decode_reference(qn, qp, cache, table, seq_lens, slots, 0.05))
    check(out16, lse16, *mla_decode_reference(qn[:, :16], qp[:, :16], cache, table, seq_lens, slots, 0.05))


@needs_hopper
def test_kernel_cuda_graph_capture_and_replay():
    graph_replays_match_reference(mh.mla_decode_many_heads, ("int4", "int4"), 128)
