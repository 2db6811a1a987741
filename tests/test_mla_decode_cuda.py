"""The CUDA decode kernel (quantmla.kernels.mla_decode_cuda) against the fp64 reference, and a CPU model of
its fragment maps.

The GPU tests need CUDA and nvcc; CI (CPU only) runs the model test, which mirrors the lane -> element maps of
mla_decode_int.cu (mma.sync m16n8k16 fragments, the k-slot -> channel permutation of q and the codes, the
values' channel map) and checks that they reproduce q (128 + codes)^T and P (128 + codes).
"""

import os
from dataclasses import replace

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from quantmla.cache.paged import PagedPath  # noqa: E402
from quantmla.kernels import mla_decode_cuda as mdc  # noqa: E402

GPU = torch.cuda.is_available() and mdc._nvcc() is not None
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and nvcc")

# --- the fragment maps, on the CPU ------------------------------------------------------------------------------


def _mma(A, B):
    """mma.m16n8k16 on lane fragments: A[lane] = 4 pairs, B[lane] = 2 pairs -> C[lane] = 4 values."""
    Am, Bm = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for r, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            Am[row, col], Am[row, col + 1] = A[lane][r]
        for r, k in enumerate([2 * t, 2 * t + 8]):
            Bm[k, g], Bm[k + 1, g] = B[lane][r]
    D = Am @ Bm
    return np.array([[D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]
                     for g, t in (divmod(i, 4) for i in range(32))])  # fmt: skip


def _codes2(y, sh, bits):  # lop3 into bf16 128.0: the two codes at bits sh and 16 + sh
    m = (1 << bits) - 1
    return 128 + ((y >> sh) & m), 128 + ((y >> (sh + 16)) & m)


def _words(codes, bits):  # one token's packed row as little-endian 32-bit words (quantize()'s layout)
    per = 8 // bits
    by = np.zeros(len(codes) // per, dtype=np.uint8)
    for c, v in enumerate(codes):
        by[c // per] |= int(v) << (bits * (c % per))
    return by, by.view("<u4")


@pytest.mark.parametrize("CB,RB,DC,DR,RG,NW", [(4, 4, 512, 64, 64, 4), (2, 4, 512, 64, 64, 4), (4, 4, 256, 32, 32, 4),
                                             (2, 2, 512, 64, 64, 4), (4, 4, 512, 64, 64, 8), (2, 4, 512, 64, 64, 8)])
def test_fragment_maps_reproduce_the_products(CB, RB, DC, DR, RG, NW):
    rng = np.random.default_rng(0)
    cpw, cpw_r = 32 // CB, 32 // RB
    SLICE = DC // NW
    GPW, WPG, SPW = SLICE // 64, 64 // cpw, cpw // 4
    NWC, NWR, SPW_R = WPG // 4, DR // cpw_r // 4, cpw_r // 4

    def qc_channel(w, ks, t, kp, hi):  # = qc_channel in mla_decode_int.cu
        gi, mm, sl = ks // (NWC * SPW), (ks // SPW) % NWC, ks % SPW
        return w * SLICE + (WPG * gi + t + 4 * mm) * cpw + 2 * sl + hi + kp * (cpw // 2)

    def qr_channel(ks, t, kp, hi):
        mm, sl = ks // SPW_R, ks % SPW_R
        return (t + 4 * mm) * cpw_r + 2 * sl + hi + kp * (cpw_r // 2)

    def a_frag(q, chan):  # A fragment of q [16, dim] under a k-slot -> channel map chan(t, kp, hi)
        return [[(q[(lane >> 2) + 8 * (r & 1), chan(lane & 3, 0, r >> 1)], q[(lane >> 2) + 8 * (r & 1), chan(lane & 3, 1, r >> 1)])
                 for r in range(4)] for lane in range(32)]  # fmt: skip

    def c_of(M):  # a [16, 8] matrix in C-fragment order
        return np.array([[M[g, 2 * t], M[g, 2 * t + 1], M[g + 8, 2 * t], M[g + 8, 2 * t + 1]] for g, t in (divmod(i, 4) for i in range(32))])

    q, qp = rng.integers(-4, 5, (16, DC)).astype(float), rng.integers(-4, 5, (16, DR)).astype(float)
    codes, rcodes = rng.integers(0, 1 << CB, (16, DC)), rng.integers(0, 1 << RB, (16, DR))
    rows = [_words(codes[n], CB) for n in range(16)]
    rrows = [_words(rcodes[n], RB)[1] for n in range(16)]
    for w in range(NW):  # scores, content: one mma chain per 64-channel group, tokens 0..7 as the n8 tile
        for gi in range(GPW):
            acc = 0
            for mm in range(NWC):
                for sl in range(SPW):
                    ks = (gi * NWC + mm) * SPW + sl
                    B = []
                    for lane in range(32):
                        y = int(rows[lane >> 2][1][w * SLICE * CB // 32 + WPG * gi + (lane & 3) + 4 * mm])
                        B.append([_codes2(y, CB * 2 * sl, CB), _codes2(y, CB * (2 * sl + 1), CB)])
                    acc = acc + _mma(a_frag(q, lambda t, kp, hi: qc_channel(w, ks, t, kp, hi)), B)
            ch = slice(w * SLICE + 64 * gi, w * SLICE + 64 * gi + 64)
            np.testing.assert_allclose(acc, c_of(q[:, ch] @ (128 + codes[:8, ch]).T))
    acc = {}  # scores, rope: whole rows in one warp
    for mm in range(NWR):
        for sl in range(SPW_R):
            ks = mm * SPW_R + sl
            B = [[_codes2(int(rrows[lane >> 2][(lane & 3) + 4 * mm]), RB * 2 * sl, RB),
                  _codes2(int(rrows[lane >> 2][(lane & 3) + 4 * mm]), RB * (2 * sl + 1), RB)] for lane in range(32)]  # fmt: skip
            rg = 4 * mm * cpw_r // RG
            acc[rg] = acc.get(rg, 0) + _mma(a_frag(qp, lambda t, kp, hi: qr_channel(ks, t, kp, hi)), B)
    for rg, a in acc.items():
        ch = slice(rg * RG, rg * RG + RG)
        np.testing.assert_allclose(a, c_of(qp[:, ch] @ (128 + rcodes[:8, ch]).T))
    # values: tokens 0..15 as k; lane g holds channels 64 G + 8 g + [0, 8) of two tokens side by side
    P = rng.integers(0, 4, (16, 16)).astype(float)
    Ap = [[(P[(lane >> 2) + 8 * (r & 1), 2 * (lane & 3) + 8 * (r >> 1)], P[(lane >> 2) + 8 * (r & 1), 2 * (lane & 3) + 8 * (r >> 1) + 1])
           for r in range(4)] for lane in range(32)]  # fmt: skip
    for w in range(NW):
        for gi in range(GPW):
            G = w * GPW + gi
            out = np.zeros((16, 64))
            for j in range(8):
                B = []
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    cw = [int.from_bytes(bytes(rows[2 * t + (e & 1) + 8 * (e >> 1)][0][G * 8 * CB + g * CB:][:CB]), "little")
                          for e in range(4)]  # fmt: skip
                    lo = [(cw[0] & 0xFFFF) | (cw[1] & 0xFFFF) << 16, (cw[2] & 0xFFFF) | (cw[3] & 0xFFFF) << 16]
                    hi = [(cw[0] >> 16) | (cw[1] >> 16) << 16, (cw[2] >> 16) | (cw[3] >> 16) << 16]
                    z = lo if CB * j < 16 else hi
                    B.append([_codes2(z[0], CB * j % 16, CB), _codes2(z[1], CB * j % 16, CB)])
                C = _mma(Ap, B)
                for lane in range(32):  # the epilogue's map: column 2t -> channel 16t + j, 2t+1 -> 16t + 8 + j
                    g, t = lane >> 2, lane & 3
                    out[g, 16 * t + j], out[g, 16 * t + 8 + j], out[g + 8, 16 * t + j], out[g + 8, 16 * t + 8 + j] = C[lane]
            np.testing.assert_allclose(out, P @ (128 + codes[:, 64 * G:64 * G + 64]))


# --- the kernel on the GPU ------------------------------------------------------------------------------------

if GPU:
    from test_mla_decode import check, fill, queries  # noqa: E402

    from quantmla.kernels.mla_decode import mla_decode, mla_decode_reference  # noqa: E402

# Empty, shorter than the window (132), exactly the window, one past it, page crossings, odd, long.
LENS = [0, 1, 7, 131, 132, 133, 200, 257, 700, 4097]


def _run(fmts, H, lens=LENS, dc=512, dr=64, splits=None, odt=torch.float32, sink=4, recent=128, seed=0, warps=None):
    cache, table, seq_lens, slots, _, _ = fill(fmts, dc, dr, lens, page=64, recent=recent, sink=sink, seed=seed)
    qn, qp = queries(len(lens), H, dc, dr)
    assert mdc.unsupported_reason(cache, H, qn.device) is None
    out, lse = mdc.mla_decode_cuda(qn, qp, cache, table, seq_lens, slots, 0.05, max_seq_len=max(lens),
                                   out_dtype=odt, num_splits=splits, warps=warps)  # fmt: skip
    assert out.dtype == odt and out.shape == (len(lens), H, dc) and lse.shape == (len(lens), H)
    check(out, lse, *mla_decode_reference(qn, qp, cache, table, seq_lens, slots, 0.05))
    return cache


@needs_gpu
@pytest.mark.parametrize("fmts", [("int4", "int4"), ("int2", "int4")])
@pytest.mark.parametrize("H", [1, 8, 16])
@pytest.mark.parametrize("warps", [4, 8])
def test_cuda_kernel_matches_reference(fmts, H, warps):
    _run(fmts, H, warps=warps)


@needs_gpu
@pytest.mark.parametrize("splits", [1, 3, 7])
@pytest.mark.parametrize("warps", [4, 8])
def test_cuda_kernel_splits_and_bf16_out(splits, warps):
    _run(("int4", "int4"), 16, splits=splits, odt=torch.bfloat16, seed=splits, warps=warps)


@needs_gpu
@pytest.mark.parametrize("sink,recent", [(0, 0), (0, 64), (70, 8)])
@pytest.mark.parametrize("warps", [4, 8])
def test_cuda_kernel_windows(sink, recent, warps):
    """No protected rows at all (no extra split), a window with no sink, a sink longer than a tile."""
    _run(("int4", "int4"), 16, lens=[0, 5, 64, 65, 78, 79, 300, 1000], sink=sink, recent=recent, warps=warps)


@needs_gpu
def test_cuda_kernel_minicpm3_dims_and_more_heads():
    _run(("int4", "int4:32"), 16, dc=256, dr=32)
    _run(("int4", "int4"), 40)  # three 16-head blocks, the last padded


@needs_gpu
def test_cuda_kernel_packed_rows():
    """Pools whose rows are further apart than their width (fields of one packed row, as in vLLM)."""
    cache, table, seq_lens, slots, _, _ = fill(("int4", "int4"), 512, 64, LENS, page=64, recent=128)

    def widen(t, pad):
        buf = torch.full((*t.shape[:2], t.shape[2] + pad), 0x7F if t.dtype == torch.uint8 else float("nan"),
                         dtype=t.dtype, device=t.device)  # fmt: skip
        buf[..., : t.shape[2]] = t
        return buf[..., : t.shape[2]]

    def path(p, pad):
        return PagedPath(p.fmt, p.dim, widen(p.codes, 16 * pad), widen(p.scale, pad), widen(p.zero, pad))

    packed = replace(cache, content=path(cache.content, 3), rope=path(cache.rope, 5))
    assert packed.content.codes.stride(1) > packed.content.codes.shape[2]
    qn, qp = queries(len(LENS), 16, 512, 64)
    out, lse = mdc.mla_decode_cuda(qn, qp, packed, table, seq_lens, slots, 0.05, max_seq_len=max(LENS))
    check(out, lse, *mla_decode_reference(qn, qp, cache, table, seq_lens, slots, 0.05))


@needs_gpu
def test_dispatch_and_refusals(monkeypatch):
    cache, table, seq_lens, slots, _, _ = fill(("int4", "int4"), 512, 64, [100], page=64, recent=128)
    dev = torch.device("cuda")
    monkeypatch.delenv(mdc.ENV, raising=False)
    assert mdc.decode_kernel_name(cache, 16, dev) == "triton"  # opt-in until it is faster
    monkeypatch.setattr(mdc, "AUTO_CUDA_MAX_HEADS", 16)  # the auto policy once it is on
    assert mdc.decode_kernel_name(cache, 16, dev) == "cuda"
    assert mdc.decode_kernel_name(cache, 128, dev) == "triton"
    assert mdc.decode_kernel_name(cache, 16, torch.device("cpu")) == "triton"
    monkeypatch.setenv(mdc.ENV, "triton")
    assert mdc.decode_kernel_name(cache, 16, dev) == "triton"
    monkeypatch.setenv(mdc.ENV, "cuda")
    assert mdc.decode_kernel_name(cache, 128, dev) == "cuda"
    monkeypatch.setenv(mdc.ENV, "auto")
    for fmts, page, why in [(("fp8", "bf16"), 64, "int4/int2"), (("int4:32", "int4"), 64, "content group"),
                            (("int4", "int4"), 32, "pages"), (("int4", "int2:32"), 64, "rope")]:  # fmt: skip
        c, *_ = fill(fmts, 512, 64 if fmts[1] != "int2:32" else 32, [100], page=page, recent=128)
        assert why in (mdc.unsupported_reason(c, 16, dev) or ""), fmts
        assert mdc.decode_kernel_name(c, 16, dev) == "triton"
        with pytest.raises(ValueError, match="cannot run"):
            q = torch.zeros(1, 16, c.kv_lora_rank, device=dev)
            mdc.mla_decode_cuda(q, torch.zeros(1, 16, c.rope_dim, device=dev), c, table, seq_lens, slots, 0.1,
                                max_seq_len=100)  # fmt: skip
    # mla_decode through the CUDA kernel when asked, and through Triton
    qn, qp = queries(1, 16, 512, 64)
    ref = mla_decode_reference(qn, qp, cache, table, seq_lens, slots, 0.05)
    monkeypatch.setenv(mdc.ENV, "cuda")
    check(*mla_decode(qn, qp, cache, table, seq_lens, slots, 0.05), *ref)
    monkeypatch.setenv(mdc.ENV, "triton")
    check(*mla_decode(qn, qp, cache, table, seq_lens, slots, 0.05), *ref)


@needs_gpu
def test_cuda_kernel_graph_capture_and_replay():
    lens = [200, 300, 1000]  # replayed lengths stay within what was written (unwritten rows are NaN)
    cache, table, seq_lens, slots, _, _ = fill(("int2", "int4"), 512, 64, lens, page=64, recent=128)
    qn, qp = (q.bfloat16() for q in queries(3, 16, 512, 64))
    lens_dev = seq_lens.clone()
    mdc.prepare(cache, qn.device)  # build and load outside the capture
    run = lambda: mdc.mla_decode_cuda(qn, qp, cache, table, lens_dev, slots, 0.05, max_seq_len=1000)  # noqa: E731
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run()
    for new in ([200, 300, 1000], [0, 133, 777], [132, 1, 999]):
        lens_dev.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        check(out, lse, *mla_decode_reference(qn, qp, cache, table, lens_dev, slots, 0.05))


@pytest.mark.parametrize("fmts", [("int4", "int4:t64"), ("int4:t64", "int4")])
def test_token_axis_caches_never_go_to_the_cuda_kernel(monkeypatch, fmts):
    """The CUDA kernel reads no token-axis scales: such a cache is Triton's even when the CUDA kernel is
    forced, and the kernel itself says why it refuses it."""
    from quantmla.cache.paged import PagedMLACache
    from quantmla.config import CacheConfig

    cache = PagedMLACache.allocate(CacheConfig(*fmts), 512, 64, 2, 1, block_size=64, device="meta")
    for choice in ("auto", "cuda"):
        monkeypatch.setenv(mdc.ENV, choice)
        monkeypatch.setattr(mdc, "AUTO_CUDA_MAX_HEADS", 16)
        assert mdc.decode_kernel_name(cache, 16, torch.device("cuda")) == "triton"
    assert "token-axis" in mdc.unsupported_reason(cache, 16, torch.device("cuda"))
    with pytest.raises(ValueError, match="cannot run this: token-axis"):
        mdc.mla_decode_cuda(torch.zeros(1, 16, 512), torch.zeros(1, 16, 64), cache, None, None, None, 0.1,
                            max_seq_len=1)
