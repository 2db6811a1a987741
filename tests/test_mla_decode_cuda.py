"""The CUDA decode kernel (quantmla.kernels.mla_decode_cuda) against the fp64 reference, and CPU models of
its loader and fragment maps.

The GPU tests need CUDA and nvcc. CI (CPU only) runs the loader through a fake driver, and the model test,
which mirrors the lane -> element maps of mla_decode_int.cu (mma.sync m16n8k16 fragments; the scores' k-slot
-> channel map of q and of the subnormal codes; the values' channel map) and checks that they reproduce
q . codes^T per scale group and P (128 + codes).
"""

import contextlib
import functools
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


def _sub_codes(wd, r, bits):  # = sub_codes in mla_decode_int.cu, as integers (the fp16 subnormal * 2^24)
    cpb = 8 // bits
    u, s, j = r // (2 * cpb), (r // cpb) & 1, r % cpb
    y = wd[u] >> 8 if s else wd[u]
    m = ((1 << bits) - 1) << (bits * j)
    return y & m, (y >> 16) & m


def _q_slot(ks, t, hi, CB, RB, DC, RG):  # = q_slot in mla_decode_int.cu: (channel lo, channel hi, shift)
    rope = ks >= DC // 16
    bits, cpb = (RB, 8 // RB) if rope else (CB, 8 // CB)
    kpg = RG // 16 if rope else 4
    kk = (ks - DC // 16) % kpg if rope else ks % 4
    grp = (ks - DC // 16) // kpg if rope else ks // 4
    wt = (RG * RB // 8) // 16 if rope else (64 * CB // 8) // 16
    r = 2 * kk + hi
    u, s, j = r // (2 * cpb), (r // cpb) & 1, r % cpb
    wi = grp * 4 * wt + t * wt + u
    base = DC if rope else 0
    return base + (4 * wi + s) * cpb + j, base + (4 * wi + 2 + s) * cpb + j, bits * j


def _words(codes, bits):  # one token's packed row as little-endian 32-bit words (quantize()'s layout)
    per = 8 // bits
    by = np.zeros(len(codes) // per, dtype=np.uint8)
    for c, v in enumerate(codes):
        by[c // per] |= int(v) << (bits * (c % per))
    return by, by.view("<u4")


@pytest.mark.parametrize("CB,RB,DC,DR,RG", [(4, 4, 512, 64, 64), (2, 4, 512, 64, 64), (4, 4, 256, 32, 32),
                                          (2, 2, 512, 64, 64), (4, 2, 256, 64, 64)])
def test_fragment_maps_reproduce_the_products(CB, RB, DC, DR, RG):
    """Scores: per scale group, the mma chain of q' (k slots of q_slot, divided by 2^shift) and the
    subnormal codes of each thread's own words gives q_g . codes_g^T. Values: P (128 + codes) with lane g
    holding bytes of channels 8 g + [0, 8) of group w, tile jn = channel 8 g + jn."""
    rng = np.random.default_rng(0)
    q = rng.integers(-4, 5, (16, DC + DR)).astype(float)  # content then rope channels, one row per head
    codes = np.concatenate([rng.integers(0, 1 << CB, (8, DC)), rng.integers(0, 1 << RB, (8, DR))], 1)
    rows = [_words(codes[n, :DC], CB)[1] for n in range(8)]
    rrows = [_words(codes[n, DC:], RB)[1] for n in range(8)]
    groups = [(g, 0, 64 * g, 4, CB) for g in range(DC // 64)] + [(g, 1, DC + RG * g, RG // 16, RB) for g in range(DR // RG)]
    for grp, rope, c0, kpg, bits in groups:
        wt = (RG * RB // 8) // 16 if rope else (64 * CB // 8) // 16
        ks0 = DC // 16 + grp * kpg if rope else 4 * grp
        acc = 0
        for kk in range(kpg):
            A, B = [], []
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                frag = []
                for r in range(4):
                    lo, hi, sh = _q_slot(ks0 + kk, t, r >> 1, CB, RB, DC, RG)
                    frag.append((q[g + 8 * (r & 1), lo] / 2**sh, q[g + 8 * (r & 1), hi] / 2**sh))
                A.append(frag)
                src = rrows[g] if rope else rows[g]
                wd = [int(src[grp * 4 * wt + t * wt + u]) for u in range(wt)]
                B.append([_sub_codes(wd, 2 * kk, bits), _sub_codes(wd, 2 * kk + 1, bits)])
            acc = acc + _mma(A, B)
        ch = slice(c0, c0 + (RG if rope else 64))
        S = q[:, ch] @ codes[:, ch].T
        np.testing.assert_allclose(acc, [[S[g, 2 * t], S[g, 2 * t + 1], S[g + 8, 2 * t], S[g + 8, 2 * t + 1]]
                                         for g, t in (divmod(i, 4) for i in range(32))])  # fmt: skip
    # values: tokens 0..15 as k
    vcodes = rng.integers(0, 1 << CB, (16, DC))
    vrows = [_words(vcodes[n], CB)[0] for n in range(16)]
    P = rng.integers(0, 4, (16, 16)).astype(float)
    Ap = [[(P[(lane >> 2) + 8 * (r & 1), 2 * (lane & 3) + 8 * (r >> 1)], P[(lane >> 2) + 8 * (r & 1), 2 * (lane & 3) + 8 * (r >> 1) + 1])
           for r in range(4)] for lane in range(32)]  # fmt: skip
    nb = 8 * CB // 8  # bytes of a lane's 8 channels
    for w in range(DC // 64):
        out = np.zeros((16, 64))
        for jn in range(8):
            B = []
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                cw = [int.from_bytes(bytes(vrows[2 * t + (e & 1) + 8 * (e >> 1)][w * 8 * CB + g * nb:][:nb]), "little")
                      for e in range(4)]  # fmt: skip
                lo = [(cw[0] & 0xFFFF) | (cw[1] & 0xFFFF) << 16, (cw[2] & 0xFFFF) | (cw[3] & 0xFFFF) << 16]
                hi = [(cw[0] >> 16) | (cw[1] >> 16) << 16, (cw[2] >> 16) | (cw[3] >> 16) << 16]
                z = lo if CB * jn < 16 else hi
                B.append([_codes2(z[0], CB * jn % 16, CB), _codes2(z[1], CB * jn % 16, CB)])
            C = _mma(Ap, B)
            for lane in range(32):  # the epilogue's map: column 2t -> channel 16t + jn, 2t+1 -> 16t + 8 + jn
                g, t = lane >> 2, lane & 3
                out[g, 16 * t + jn], out[g, 16 * t + 8 + jn], out[g + 8, 16 * t + jn], out[g + 8, 16 * t + 8 + jn] = C[lane]
        np.testing.assert_allclose(out, P @ (128 + vcodes[:, 64 * w:64 * w + 64]))


def _q_slot_fp8(ks, t, hi, DC, DR, rope_bf16):  # = q_slot in mla_decode_int.cu for bits 8 (fp8) and 16 (bf16)
    rope = ks >= DC // 16
    kr = ks - DC // 16 if rope else ks
    base = DC if rope else 0
    if rope and rope_bf16:  # plain order
        return base + 16 * kr + 2 * t + 8 * hi, base + 16 * kr + 2 * t + 8 * hi + 1
    kpg = DR // 16 if rope else 4  # k steps of a group: the whole rope, or 64 content channels
    kk, grp = kr % kpg, kr // kpg
    wi = grp * 4 * kpg + t + 4 * kk  # word t + 4 kk of the group (kpg words per thread)
    return base + 4 * wi + 2 * hi, base + 4 * wi + 2 * hi + 1


def _byte_perm(x, y, sel):  # __byte_perm: byte i of the result is byte (sel >> 4 i) & 7 of (y:x)
    both = x | y << 32
    return sum(((both >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


@pytest.mark.parametrize("DC,DR,rope_bf16", [(512, 64, True), (512, 64, False), (256, 32, True), (256, 32, False)])
def test_fp8_fragment_maps_reproduce_the_products(DC, DR, rope_bf16):
    """The fp8 variant's maps, with a code standing for its e4m3 value (cvt.rn.f16x2.e4m3x2 turns the low / high
    byte of 16 bits into the low / high fp16). Scores: the B operand of k step kk is word t + 4 kk of the
    group (bytes 0, 1 and 2, 3), or for a bf16 rope the plain pairs 16 kk + 2t (+ 8); q at q_slot's channels.
    Values: bytes 8 g + [0, 8) of group w for tokens k0, k0+1, k0+8, k0+9, paired by __byte_perm 0x5140 /
    0x7362, give tile jn = channel 8 g + jn."""
    rng = np.random.default_rng(1)
    q = rng.integers(-4, 5, (16, DC + DR)).astype(float)
    v = rng.integers(0, 256, (8, DC + DR))  # 8 tokens: the columns of one n8 tile
    groups = [(DC // 16 + 0, DR // 16, DC, DR)] + [(4 * G, 4, 64 * G, 64) for G in range(DC // 64)]
    for ks0, nk, c0, width in groups:
        rope = ks0 >= DC // 16
        acc = 0
        for kk in range(nk):
            A, B = [], []
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                A.append([(q[g + 8 * (r & 1), lo], q[g + 8 * (r & 1), hi])
                          for r in range(4) for lo, hi in [_q_slot_fp8(ks0 + kk, t, r >> 1, DC, DR, rope_bf16)]])
                if rope and rope_bf16:
                    b = [c0 + 16 * kk + 2 * t, c0 + 16 * kk + 2 * t + 8]
                    B.append([(v[g, b[0]], v[g, b[0] + 1]), (v[g, b[1]], v[g, b[1] + 1])])
                else:
                    wb = c0 + 4 * (t + 4 * kk)  # first channel (byte) of the word
                    B.append([(v[g, wb], v[g, wb + 1]), (v[g, wb + 2], v[g, wb + 3])])
            acc = acc + _mma(A, B)
        S = q[:, c0:c0 + width] @ v[:, c0:c0 + width].T
        np.testing.assert_allclose(acc, [[S[g, 2 * t], S[g, 2 * t + 1], S[g + 8, 2 * t], S[g + 8, 2 * t + 1]]
                                         for g, t in (divmod(i, 4) for i in range(32))])  # fmt: skip
    vb = rng.integers(0, 256, (16, DC))  # values: 16 tokens (k) of content bytes
    P = rng.integers(0, 4, (16, 16)).astype(float)
    Ap = [[(P[(lane >> 2) + 8 * (r & 1), 2 * (lane & 3) + 8 * (r >> 1)], P[(lane >> 2) + 8 * (r & 1), 2 * (lane & 3) + 8 * (r >> 1) + 1])
           for r in range(4)] for lane in range(32)]  # fmt: skip
    for w in range(DC // 64):
        out = np.zeros((16, 64))
        for jn in range(8):
            h, qq, odd = jn // 4, (jn % 4) // 2, jn % 2
            B = []
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                words = [int.from_bytes(bytes(vb[2 * t + (e & 1) + 8 * (e >> 1), 64 * w + 8 * g + 4 * h:][:4].astype(np.uint8)), "little")
                         for e in range(4)]  # fmt: skip
                sel = 0x7362 if qq else 0x5140
                pair = [_byte_perm(words[0], words[1], sel), _byte_perm(words[2], words[3], sel)]
                half = [(p >> (16 * odd)) & 0xFFFF for p in pair]  # e4m3x4_f16: lo (bytes 0, 1), hi (2, 3)
                B.append([(hv & 0xFF, hv >> 8) for hv in half])
            C = _mma(Ap, B)
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                out[g, 16 * t + jn], out[g, 16 * t + 8 + jn], out[g + 8, 16 * t + jn], out[g + 8, 16 * t + 8 + jn] = C[lane]
        np.testing.assert_allclose(out, P @ vb[:, 64 * w:64 * w + 64])


def test_format_support():
    """Which formats have a CUDA variant (the device checks aside), and the reason named for those without."""
    from quantmla.cache.paged import PagedMLACache
    from quantmla.config import CacheConfig

    def reason(c, r, dc=512, dr=64):
        return mdc._fmt_reason(PagedMLACache.allocate(CacheConfig(c, r), dc, dr, 1, 1, block_size=64, device="meta"))

    for fmts in [("int4", "int4"), ("int2", "int4:32"), ("fp8", "bf16"), ("fp8:0", "fp8:0"), ("fp8:64", "bf16"),
                 ("fp8:512", "fp8:0")]:  # fmt: skip
        assert reason(*fmts) is None, fmts
    assert reason("fp8", "bf16", 256, 32) is None
    for c, r, why in [("fp8:32", "bf16", "groups of 64"),
                      ("fp8", "fp8:64", "fp8:0 or bf16"), ("fp8", "int4", "fp8:0 or bf16"), ("int8", "int4", "int4/int2"),
                      ("int4", "bf16", "int4/int2"), ("bf16", "bf16", "int4/int2"), ("int4:32", "int4", "content group 64")]:  # fmt: skip
        assert why in (reason(c, r) or ""), (c, r)
    assert mdc._defines(PagedMLACache.allocate(CacheConfig("fp8", "bf16"), 512, 64, 1, 1, block_size=64, device="meta")) == {
        "CB": 8, "RB": 16, "DC": 512, "DR": 64, "RG": 64, "CG": 128}


# --- the loader, on the CPU through a fake driver ---------------------------------------------------------------


class _FakeDriver:
    """libcuda as `_load` uses it: the module publishes sizeof(Smem) (by stages), the device its opt-in limit per
    block (attribute 97), shared memory per SM (81, an H100's) and reserved per block (111)."""

    def __init__(self, limit, smem, per_sm=233472):
        self.attrs = {97: limit, 81: per_sm, 111: 1024}
        self.smem, self.calls, self.stages = smem, [], None

    def __getattr__(self, name):
        def call(*a):
            self.calls.append(name)
            out = {"cuCtxGetCurrent": 1, "cuModuleLoadData": 11, "cuModuleGetFunction": 22, "cuCtxGetDevice": 0,
                   "cuMemcpyDtoH_v2": self.smem[self.stages]}.get(name)  # fmt: skip
            if name == "cuDeviceGetAttribute":
                out = self.attrs[a[1]]
            if out is not None:
                a[0]._obj.value = out
            return 0

        return call


@pytest.mark.parametrize("limit,smem,want", [
    (232448, {3: 101376, 2: 80896}, (22, 101376)),  # two 3-stage blocks fit an SM
    (100352, {3: 101376, 2: 80896}, (22, 80896)),  # a block cannot hold 3 stages
    (232448, {3: 140288, 2: 95232}, (22, 95232)),  # it can, but two blocks per SM only with 2 (fp8's rows)
    (232448, {3: 140288, 2: 120000}, (22, 140288)),  # two fit with neither: the deeper ring
    (49152, {3: 101376, 2: 80896}, "49152"),
])  # fmt: skip
def test_loader_picks_the_ring_that_fits(monkeypatch, limit, smem, want):
    """The deepest ring (3 or 2 stages) with which two blocks fit an SM, else the deepest that fits a block (a
    3-stage module that does not is unloaded), else a reason; kept once known."""
    from quantmla.cache.paged import PagedMLACache
    from quantmla.config import CacheConfig

    fake = _FakeDriver(limit, smem)

    def build(defines, arch):
        fake.stages = defines["STAGES"]
        return b"cubin"

    monkeypatch.setattr(mdc, "build_cubin", build)
    monkeypatch.setattr(mdc, "_lib", fake)
    monkeypatch.setattr(mdc, "_kernels", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "device", lambda idx: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda idx=None: None)
    cache = PagedMLACache.allocate(CacheConfig("int4", "int4"), 512, 64, 2, 1, block_size=64, device="meta")
    got = mdc._kernel(torch.device("cuda", 0), cache)
    if isinstance(want, str):
        assert isinstance(got, str) and "shared memory" in got and want in got
        with pytest.raises(ValueError, match="shared memory"):
            mdc.prepare(cache, torch.device("cuda", 0))
    else:
        assert got == want
        assert fake.calls.count("cuModuleUnload") == (smem[3] > limit)
    n = len(fake.calls)
    assert mdc._kernel(torch.device("cuda", 0), cache) == got and len(fake.calls) == n  # kept


@pytest.mark.parametrize("batch,length,want", [
    (1, 4096, 16), (1, 16384, 32), (1, 65536, 64),  # the fastest measured (decode_kernel_splits.md, H200)
    (4, 4096, 16), (4, 16384, 32), (4, 65536, 64),
    (16, 4096, 8),  # 16 splits of 256 tokens would not fit one per SM: 512-token splits
    (16, 16384, 15), (16, 65536, 15),  # one wave with a slot for each protected split (not 16: 17 * 16 > 264)
    (64, 65536, 4),
])  # fmt: skip
def test_body_splits(batch, length, want):
    assert mdc.body_splits(batch, 16, length, 132) == want
    assert mdc.body_splits(batch, 16, length, 132, protected=False) >= want


def test_device_split_rule_is_body_splits(tmp_path):
    """`body_splits_of` in mla_decode_int.cu (each block's own split count) compiled as host C++ and run over
    lengths, batches and head counts: it gives `body_splits` (the grid's count) in every case, so a sequence
    under a loose bound is cut as under its exact one. Needs a host C++ compiler."""
    import re
    import shutil
    import subprocess

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    src = mdc.SRC.read_text()
    fn = re.search(r"__device__ __forceinline__ int body_splits_of\(.*?\n}\n", src, re.S).group(0)
    consts = re.search(r"#define NT \d+", src).group(0) + "\n" + re.search(r"constexpr int PROT_TILES = \d+;", src).group(0)
    cases = [(L, b, h, sms, prot) for L in [0, 1, 100, 257, 1000, 4096, 8448, 8449, 9216, 12000, 16384, 33792, 33793,
                                            65536, 100000, 131072]
             for b in [1, 3, 4, 16, 64] for h in [16, 128] for sms in [132, 78] for prot in [0, 1]]  # fmt: skip
    rows = "\n".join(" ".join(map(str, (L, *mdc.split_terms(b, h, sms), sms, prot))) for L, b, h, sms, prot in cases)
    prog = tmp_path / "rule.cpp"
    prog.write_text("#include <algorithm>\n#include <cstdio>\nusing std::max; using std::min;\n"
                    "#define __device__\n#define __forceinline__ inline\n" + consts + "\n" + fn +
                    "int main() { int L, f, c, s, p; while (scanf(\"%d %d %d %d %d\", &L, &f, &c, &s, &p) == 5)"
                    " printf(\"%d\\n\", body_splits_of(L, f, c, s, p)); }\n")  # fmt: skip
    subprocess.run([cxx, "-std=c++17", "-O1", "-o", str(tmp_path / "rule"), str(prog)], check=True)
    got = subprocess.run([str(tmp_path / "rule")], input=rows, capture_output=True, text=True, check=True).stdout.split()
    want = [mdc.body_splits(b, h, L, sms, protected=bool(prot)) for L, b, h, sms, prot in cases]
    assert [int(g) for g in got] == want


# --- the kernel on the GPU ------------------------------------------------------------------------------------

if GPU:
    from test_mla_decode import (  # noqa: E402
        check, fill, graph_replays_match_reference, kernel_matches_reference, loose_bound_matches_exact, packed_rows,
        queries)

    from quantmla.kernels.mla_decode import mla_decode, mla_decode_reference  # noqa: E402

# Empty, shorter than the window (132), exactly the window, one past it, page crossings, odd, long.
LENS = [0, 1, 7, 131, 132, 133, 200, 257, 700, 4097]


def _run(fmts, H, lens=LENS, **kw):
    return kernel_matches_reference(mdc.mla_decode_cuda, mdc.unsupported_reason, fmts, H, lens, **kw)


@needs_gpu
@pytest.mark.parametrize("fmts", [("int4", "int4"), ("int2", "int4")])
@pytest.mark.parametrize("H", [1, 8, 16])
def test_cuda_kernel_matches_reference(fmts, H):
    _run(fmts, H)


@needs_gpu
@pytest.mark.parametrize("fmts", [("fp8", "bf16"), ("fp8:0", "fp8:0"), ("fp8:64", "bf16"), ("fp8:512", "fp8:0")])
@pytest.mark.parametrize("H", [1, 16, 40])
def test_cuda_kernel_fp8_matches_reference(fmts, H):
    """The fp8 variant: FlashMLA's 656-byte row (fp8:128 + bf16 rope), vLLM's 576-byte row (fp8:0 on both),
    other content groups; with and without protected rows."""
    _run(fmts, H, odt=torch.bfloat16 if H == 40 else torch.float32)
    _run(fmts, H, lens=[0, 5, 64, 65, 78, 79, 300, 1000], sink=0, recent=0, splits=3 if H == 16 else None)


@needs_gpu
def test_cuda_kernel_fp8_pages_and_dims():
    """Pages of 2 tiles with a sink past the first tile; MiniCPM3's 256/32."""
    _run(("fp8:0", "fp8:0"), 16, lens=[0, 5, 200, 1000], sink=70, recent=8, page=128, splits=3)
    _run(("fp8", "bf16"), 16, dc=256, dr=32)
    _run(("fp8:0", "fp8:0"), 20, dc=256, dr=32)


@needs_gpu
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_cuda_kernel_splits_and_bf16_out(splits):
    _run(("int4", "int4"), 16, splits=splits, odt=torch.bfloat16, seed=splits)


@needs_gpu
@pytest.mark.parametrize("sink,recent", [(0, 0), (0, 64), (70, 8)])
def test_cuda_kernel_windows(sink, recent):
    """No protected rows at all (no extra split), a window with no sink, a sink longer than a tile."""
    _run(("int4", "int4"), 16, lens=[0, 5, 64, 65, 78, 79, 300, 1000], sink=sink, recent=recent)


@needs_gpu
@pytest.mark.parametrize("prot_splits", [2, 3, 5])
def test_cuda_kernel_protected_rows_over_several_splits(prot_splits):
    """The protected rows' tiles in runs over prot_splits CTAs (more than there are tiles: empty ones), with the
    default window (132 rows: 3 tiles), a sink past the first tile, and the fp8 variant."""
    run = functools.partial(mdc.mla_decode_cuda, prot_splits=prot_splits)
    kernel_matches_reference(run, mdc.unsupported_reason, ("int4", "int4"), 16, LENS)
    kernel_matches_reference(run, mdc.unsupported_reason, ("int2", "int4"), 16, [0, 5, 200, 1000], sink=70,
                             recent=8, page=128, splits=3)
    kernel_matches_reference(run, mdc.unsupported_reason, ("fp8", "bf16"), 16, LENS)


@needs_gpu
@pytest.mark.parametrize("page", [128, 256])
def test_cuda_kernel_pages_of_several_tiles(page):
    """Pages of 2 and 4 tiles: a tile's rows are its page's entry times the page plus its place in the page; a
    sink of 70 starts the body in the page's second tile."""
    _run(("int4", "int4"), 16, page=page, seed=page)
    _run(("int4", "int4"), 16, lens=[0, 5, 200, 1000], sink=70, recent=8, page=page, splits=3)


@needs_gpu
def test_cuda_kernel_minicpm3_dims_and_more_heads():
    _run(("int4", "int4:32"), 16, dc=256, dr=32)
    _run(("int4", "int4"), 40)  # three 16-head blocks, the last padded


@needs_gpu
@pytest.mark.parametrize("fmts,pads", [(("int4", "int4"), (48, 3, 80, 5)), (("fp8", "bf16"), (48, 3, 8, 0)),
                                       (("fp8:0", "fp8:0"), (16, 0, 48, 0))])  # fmt: skip
def test_cuda_kernel_packed_rows(fmts, pads):
    """Pools whose rows are further apart than their width (fields of one packed row, as in vLLM). pads: extra
    elements per row of (content codes, content scale / zero, rope codes, rope scale / zero); a bf16 rope row
    of 72 elements is 144 bytes, 16-byte aligned."""
    cache, table, seq_lens, slots, _, _ = fill(fmts, 512, 64, LENS, page=64, recent=128)
    packed = packed_rows(cache, pads)
    assert mdc.unsupported_reason(packed, 16, torch.device("cuda")) is None
    qn, qp = queries(len(LENS), 16, 512, 64)
    out, lse = mdc.mla_decode_cuda(qn, qp, packed, table, seq_lens, slots, 0.05, max_seq_len=max(LENS))
    check(out, lse, *mla_decode_reference(qn, qp, cache, table, seq_lens, slots, 0.05))


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ablations_apply_to_the_kernel_source():
    """benchmarks/decode_kernel_ablate.py edits the kernel by text: every edit must still find its text (else it
    would time the unchanged kernel), and the edited source must differ."""
    mod = _benchmark("decode_kernel_ablate")
    src = mdc.SRC.read_text()
    for name in mod.ABLATIONS:
        assert mod.ablated(src, name) != src, name
    with pytest.raises(SystemExit, match="no longer holds"):
        mod.ablated(src.replace("store_sz(tt + 1);", "store_sz(tt+1);"), "scale staging")


def test_bisect_patches_apply_to_the_kernel_source(tmp_path):
    """The benchmarks/results/decode_kernel_bisect_*.patch variants, timed by benchmarks/decode_kernel_ab.py, must
    still apply to the kernel as it is and change it (else the bisect would fail on the GPU, or time the kernel
    unchanged); a patch that no longer applies is refused by name."""
    mod = _benchmark("decode_kernel_ab")
    patches = sorted((BENCHMARKS / "results").glob("decode_kernel_bisect_*.patch"))
    assert patches
    for patch in patches:
        assert mod.patched(patch, mdc.SRC).read_text() != mdc.SRC.read_text(), patch.name
    stale = tmp_path / "stale.patch"
    text = patches[0].read_text()
    first = next(line for line in text.splitlines() if line.startswith("-") and not line.startswith("---"))
    stale.write_text(text.replace(first, first + " // a line the kernel no longer has"))
    with pytest.raises(SystemExit, match="stale.patch does not apply: the hunk at line"):
        mod.patched(stale, mdc.SRC)


def test_auto_batch_limit_by_heads():
    """"auto" keeps the CUDA kernel for any batch up to 32 heads, and above that for batches of at most 32
    16-head blocks (the kernel reads the cache once per 16 heads)."""
    assert [mdc.auto_cuda_max_batch(h) for h in (1, 8, 16, 20, 32)] == [None] * 5
    assert [mdc.auto_cuda_max_batch(h) for h in (33, 40, 64, 128, 129, 512, 513)] == [10, 10, 8, 4, 3, 1, 0]
    # against the many-heads kernel: 4 blocks
    assert [mdc.auto_cuda_max_batch(h, many_heads=True) for h in (32, 33, 64, 65, 128)] == [None, 1, 1, 0, 0]


@pytest.mark.parametrize("heads,batch,cuda,many,want", [
    (16, 64, True, True, "cuda"), (32, 64, True, True, "cuda"), (64, 1, True, True, "cuda"),
    (64, 2, True, True, "heads"), (128, 1, True, True, "heads"), (128, 4, True, False, "cuda"),
    (128, 5, True, False, "triton"), (16, 1, False, True, "triton"), (40, 1, False, True, "heads"),
    (128, None, True, True, "heads"), (16, None, True, False, "cuda"),
])  # fmt: skip
def test_auto_kernel_order(heads, batch, cuda, many, want):
    """The CUDA kernel up to 32 heads or for few head blocks, then the many-heads kernel (never at <= 32 heads),
    then Triton's."""
    assert mdc.auto_kernel(heads, batch, cuda, many) == want


def test_auto_rule_scored_on_the_committed_grids():
    """benchmarks/results/decode_kernel_auto.md is what the rule scores on the committed grids now (rerun
    benchmarks/decode_kernel_auto.py after changing either), and the script counts a slower pick as a loss."""
    mod = _benchmark("decode_kernel_auto")
    res = BENCHMARKS / "results"
    grids = sorted(str(p) for p in res.glob("decode_kernel_cuda_v4*.json")) + [
        str(res / "decode_kernel_cuda_fp8.json"), str(res / "decode_kernel_heads.json")]
    rows = mod.picks(mod.cells(grids))
    wrong = [r for r in rows if r["loss"] > 0]
    text = (BENCHMARKS / "results" / "decode_kernel_auto.md").read_text()
    worst = max(r["loss"] for r in wrong)
    assert f"{len(rows)} cells; auto picks the slower kernel in {len(wrong)}, losing at most {worst:.1%}." in text
    (row,) = mod.picks({(128, 64, 4096, "int4/int4"): {"cuda": 1.2, "triton": 0.6}})
    assert (row["auto"], row["faster"], row["loss"]) == ("triton", "cuda", 0.5)
    (row,) = mod.picks({(128, 1, 4096, "int4/int4"): {"cuda": 1.2, "heads": 0.9, "triton": 0.6}})
    assert (row["auto"], row["faster"], row["loss"]) == ("heads", "cuda", 0.25)


@needs_gpu
def test_dispatch_and_refusals(monkeypatch):
    cache, table, seq_lens, slots, _, _ = fill(("int4", "int4"), 512, 64, [100], page=64, recent=128)
    dev = torch.device("cuda")
    monkeypatch.delenv(mdc.ENV, raising=False)
    from quantmla.kernels import mla_decode_many_heads as mh

    assert mdc.decode_kernel_name(cache, 16, dev) == "cuda"  # where it measured faster
    assert mdc.decode_kernel_name(cache, 32, dev, batch=64) == "cuda"
    if mh.unsupported_reason(cache, 128, dev) is None:  # Hopper: the many-heads kernel above 32 heads
        assert mdc.decode_kernel_name(cache, 64, dev, batch=1) == "cuda"
        assert mdc.decode_kernel_name(cache, 64, dev, batch=2) == "heads"
        assert mdc.decode_kernel_name(cache, 128, dev, batch=1) == "heads"
        assert mdc.decode_kernel_name(cache, 128, dev) == "heads"  # any batch
    else:
        assert mdc.decode_kernel_name(cache, 128, dev, batch=4) == "cuda"
        assert mdc.decode_kernel_name(cache, 128, dev, batch=5) == "triton"
        assert mdc.decode_kernel_name(cache, 64, dev, batch=8) == "cuda"
        assert mdc.decode_kernel_name(cache, 128, dev) == "triton"  # any batch
    assert mdc.decode_kernel_name(cache, 16, torch.device("cpu")) == "triton"
    monkeypatch.setenv(mdc.ENV, "triton")
    assert mdc.decode_kernel_name(cache, 16, dev) == "triton"
    monkeypatch.setenv(mdc.ENV, "cuda")
    assert mdc.decode_kernel_name(cache, 128, dev) == "cuda"
    monkeypatch.setenv(mdc.ENV, "auto")
    for fmts, page, why in [(("int8", "int4"), 64, "int4/int2"), (("int4:32", "int4"), 64, "content group"),
                            (("int4", "int4"), 32, "pages"), (("int4", "int4"), 192, "power of two"),
                            (("int4", "int2:32"), 64, "rope")]:  # fmt: skip
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
def test_shared_memory_fallback(monkeypatch):
    """A device whose blocks cannot hold the 3-stage ring gets 2 stages (right against the reference); one that
    cannot hold either is refused with the reason, and "auto" goes to Triton instead of failing."""
    real = mdc._load
    monkeypatch.setattr(mdc, "_load", lambda idx, d: "needs more shared memory" if d["STAGES"] == 3 else real(idx, d))
    _run(("int4", "int4"), 16, lens=[0, 7, 133, 700, 4097])
    cache, *_ = fill(("int4", "int4"), 512, 64, [100], page=64, recent=128)
    dev = torch.device("cuda")
    monkeypatch.setattr(mdc, "_load", lambda idx, d: "needs 101376 bytes of shared memory per block, the device allows 101")
    assert "shared memory" in mdc.unsupported_reason(cache, 16, dev)
    monkeypatch.delenv(mdc.ENV, raising=False)
    assert mdc.decode_kernel_name(cache, 16, dev) == "triton"
    with pytest.raises(ValueError, match="shared memory"):
        mdc.prepare(cache, dev)


@needs_gpu
@pytest.mark.parametrize("H,length", [(16, 1000), (16, 5000), (16, 12000), (128, 12000)])
def test_cuda_kernel_loose_bound_gives_the_exact_bounds_bits(H, length):
    """A 128 K bound sizes the grid (87 body splits at 16 heads); each sequence still takes body_splits at its own
    length (`body_splits_of` in the kernel). Which term decides: the 256-token floor (1000), the square root
    (5000), the 512-token floor (12000, 16 heads), one wave (12000, 128 heads)."""
    assert mdc.body_splits(3, H, length, 132) < mdc.body_splits(3, H, 131072, 132)
    loose_bound_matches_exact(mdc.mla_decode_cuda, ("int4", "int4"), H, length, 131072)


@needs_gpu
@pytest.mark.parametrize("fmts", [("int2", "int4"), ("fp8", "bf16")])
def test_cuda_kernel_graph_capture_and_replay(fmts):
    graph_replays_match_reference(mdc.mla_decode_cuda, fmts, 16)


@pytest.mark.parametrize("fmts", [("int4", "int4:t64"), ("int4:t64", "int4")])
def test_token_axis_caches_never_go_to_the_cuda_kernel(monkeypatch, fmts):
    """The CUDA kernel reads no token-axis scales: such a cache is Triton's even when the CUDA kernel is
    forced, and the kernel itself says why it refuses it."""
    from quantmla.cache.paged import PagedMLACache
    from quantmla.config import CacheConfig

    cache = PagedMLACache.allocate(CacheConfig(*fmts), 512, 64, 2, 1, block_size=64, device="meta")
    for choice in ("auto", "cuda"):
        monkeypatch.setenv(mdc.ENV, choice)
        assert mdc.decode_kernel_name(cache, 16, torch.device("cuda")) == "triton"
    assert "token-axis" in mdc.unsupported_reason(cache, 16, torch.device("cuda"))
    with pytest.raises(ValueError, match="cannot run this: token-axis"):
        mdc.mla_decode_cuda(torch.zeros(1, 16, 512), torch.zeros(1, 16, 64), cache, None, None, None, 0.1,
                            max_seq_len=1)


def test_wgmma_scores_probe_fragments_and_staged_q_give_the_scores():
    """benchmarks/wgmma_scores_probe.cu's register fragments (the AND / shift of each code word, as its comment
    says), multiplied by the shared-memory image of `stage_q`, give the scores of `reference`: the channel map
    of the fragments and of the staged q agree, on the CPU."""
    probe = _benchmark("wgmma_scores_probe")
    g = torch.Generator().manual_seed(0)
    n = 3
    codes = torch.randint(0, 256, (n, probe.ROW), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, probe.NG, generator=g)
    q = torch.randn(probe.H, 576, generator=g) * 64
    img = probe.stage_q(q).double()  # [group, k step, n8 block, k half, 8 rows, 8]
    got = torch.zeros(n, probe.H, dtype=torch.float64)
    for r in range(n):
        for grp in range(probe.NG):
            acc = torch.zeros(probe.H, dtype=torch.float64)
            for t in range(4):  # the lane's bytes [8 t, 8 t + 8) of the group
                b = [int(v) for v in codes[r, 32 * grp + 8 * t:32 * grp + 8 * t + 8]]
                words = (b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24, b[4] | b[5] << 8 | b[6] << 16 | b[7] << 24)
                for s in range(4):
                    y = words[s // 2] >> (8 * (s % 2))
                    for h, mask in ((0, 0x000F000F), (1, 0x00F000F0)):  # k slots 2t + e, 2t + 8 + e
                        for e in range(2):
                            sub = ((y & mask) >> (16 * e)) & 0xFFFF  # the fp16 subnormal's mantissa: value * 2^24
                            acc += sub * img[grp, s, :, h, :, 2 * t + e].reshape(probe.H)
            got[r] += float(scale[r, grp]) * acc
    want = probe.reference(codes, scale, q.to(torch.float16).float())
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-9)


def test_wgmma_values_probe_fragments_and_p_image_give_the_values():
    """benchmarks/wgmma_values_probe.cu's register fragments (prmt + AND of a 4-byte load of the byte-transposed
    tile) and its P' image (each thread's tokens and heads), multiplied as the MMAs do, give `reference`'s
    O: the channel map of the rows, the token map of the k slots and the P' image agree, on the CPU."""
    probe = _benchmark("wgmma_values_probe")
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (64, 256), dtype=torch.uint8, generator=g)
    p = torch.rand(64, 16, generator=g)
    scale = torch.rand(64, 8, generator=g) * 0.1 + 0.01
    vt = probe.transpose_tiles(codes)[0]  # [group, byte, token]

    def slot_of(u):  # as the .cu: tokens 4t + e -> slot 2t + e, 4t + 2 + e -> 2t + 8 + e
        return 2 * (u >> 2) + (u & 1) + (8 if u & 2 else 0)

    image = torch.zeros(8, 4, 256, dtype=torch.float64)  # [group, k step, n8 block / k half / 8 heads / 8 slots]
    for w in range(4):
        for lane in range(32):
            t, g4 = lane & 3, lane >> 2
            for u in (16 * w + g4, 16 * w + g4 + 8):
                for grp in range(8):
                    kk = slot_of(u & 15)
                    for i in range(4):
                        h = 2 * t + (i & 1) + 8 * (i >> 1)
                        value = float((p[u, h] * scale[u, grp]).to(torch.float16))
                        image[grp, w, (h >> 3) * 128 + (kk >> 3) * 64 + (h & 7) * 8 + (kk & 7)] = value
    got = torch.zeros(16, 512, dtype=torch.float64)
    for grp in range(8):
        for s in range(4):
            b_op = torch.zeros(16, 16, dtype=torch.float64)  # [k slot, head]
            for h in range(16):
                for kk in range(16):
                    b_op[kk, h] = image[grp, s, (h >> 3) * 128 + (kk >> 3) * 64 + (h & 7) * 8 + (kk & 7)]
            for w in range(4):
                for lane in range(32):
                    t, g4 = lane & 3, lane >> 2
                    byte = 8 * w + g4
                    by = [int(vt[grp, byte, 16 * s + 4 * t + j]) for j in range(4)]
                    for pair, slots in (((by[0], by[1]), (2 * t, 2 * t + 1)), ((by[2], by[3]), (2 * t + 8, 2 * t + 9))):
                        word = pair[0] | pair[1] << 16
                        for hi, mask in ((0, 0x000F000F), (1, 0x00F000F0)):  # rows m (low nibble), m + 8 (high)
                            for e in range(2):
                                sub = ((word & mask) >> (16 * e)) & 0xFFFF  # value * 2^24 (x 16 on the high nibble)
                                got[:, 64 * grp + 2 * byte + hi] += sub * b_op[slots[e]] / (16 if hi else 1)
    torch.testing.assert_close(got, probe.reference(codes, p, scale), rtol=1e-12, atol=1e-9)
