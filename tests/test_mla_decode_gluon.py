"""The Gluon (Hopper wgmma) decode kernel: its fragment index maps and math emulated in torch on the CPU, and
(on an sm_90 GPU with triton.experimental.gluon) the kernel itself against `mla_decode_reference`.

The CPU tests run the kernel's exact chain of reshapes / permutes / PTX semantics (`emulate_*` in
quantmla.kernels.mla_decode_gluon) and check (1) that each fragment element holds the channel the kernel's Q
staging and output store assume (`scores_channel`, `values_channel`), (2) that a whole decode assembled from
emulated tiles (scale after the MMA, the zero term, the online softmax, the split of body and protected
tiles) matches the fp64 reference. The GPU tests are the real thing on awkward shapes.
"""

import math

import pytest
import torch

from quantmla.cache.paged import PagedMLACache, make_block_tables
from quantmla.config import CacheConfig
from quantmla.kernels import mla_decode_gluon as mg
from quantmla.kernels.mla_decode import mla_decode_reference

NAN = float("nan")
GPU = (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and mg.gluon is not None)
DEV = "cuda" if GPU else "cpu"
needs_hopper = pytest.mark.skipif(not GPU, reason="needs an sm_90 GPU and triton.experimental.gluon")


def fill(lens, page=64, sink=4, recent=40, heads_seed=0, fmts=("int4", "int4"), dev=DEV, extra_slots=2):
    """A 512/64 cache holding random tokens for sequences of `lens` (NaN in every unused row, shuffled blocks,
    permuted slots). Returns (cache, block_tables, seq_lens, slots)."""
    g = torch.Generator().manual_seed(heads_seed)
    cfg = CacheConfig(fmts[0], fmts[1], sink=sink, recent=recent)
    _, used = make_block_tables(lens, page, num_blocks=None, generator=g)
    nb = used + 3
    table, _ = make_block_tables(lens, page, num_blocks=nb, generator=g)
    cache = PagedMLACache.allocate(cfg, 512, 64, nb, len(lens) + extra_slots, block_size=page, device=dev, fill=NAN)
    slots = torch.randperm(len(lens) + extra_slots, generator=g)[: len(lens)].to(torch.int32)
    for i, L in enumerate(lens):
        if L:
            c = (torch.randn(L, 512, generator=g) * (1 + torch.rand(512, generator=g))).bfloat16().to(dev)
            r = torch.randn(L, 64, generator=g).bfloat16().to(dev)
            cache.append(int(slots[i]), table[i].to(dev), 0, c, r)
    return cache, table.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev), slots.to(dev)


def queries(B, H, seed=1, dev=DEV):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, 512, generator=g) * 0.3).to(dev), torch.randn(B, H, 64, generator=g).to(dev)


def nibble(codes: torch.Tensor, ch: int) -> torch.Tensor:
    """Code of channel ch of each row (int4: channel 2i low nibble, 2i+1 high nibble of byte i)."""
    byte = codes[..., ch // 2].long()
    return (byte >> 4) if ch % 2 else (byte & 15)


# --- CPU: index maps ----------------------------------------------------------------------------------------


def test_channel_maps_are_permutations():
    assert sorted(mg.SCORES_PERM) == list(range(64))
    assert sorted(mg.values_channel(j, m) for j in range(8) for m in range(64)) == list(range(512))
    # every thread (quad index t = column bits 1, 2) reads one contiguous 8-byte run of the group
    for t in range(4):
        cols = [k for k in range(64) if (k >> 1) & 3 == t]
        assert sorted({mg.scores_channel(k)[0] // 2 for k in cols}) == list(range(8 * t, 8 * t + 8))
    # high-nibble columns are the odd channels
    assert all(hi == (ch % 2 == 1) for ch, hi in map(mg.scores_channel, range(64)))


@pytest.mark.parametrize("denorm", [True, False])
def test_scores_fragment_holds_the_mapped_channels(denorm):
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (64, 32), generator=g, dtype=torch.uint8)
    a = mg.emulate_scores_fragment(codes, denorm)
    f = 2.0**-24 if denorm else 1.0
    for k in range(64):
        ch, hi = mg.scores_channel(k)
        want = nibble(codes, ch).double() * (16 if hi else 1) * f
        assert torch.equal(a[:, k], want), k


def test_values_fragments_hold_the_mapped_channels():
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 256, (64, 256), generator=g, dtype=torch.uint8)
    scale = torch.rand(64, 8, generator=g) + 0.5
    zero = torch.randn(64, 8, generator=g)
    valid = torch.rand(64, generator=g) > 0.3
    f = mg.emulate_values_fragments(codes, scale, zero, valid)
    for j in range(8):
        for m in range(64):
            ch = mg.values_channel(j, m)
            want = nibble(codes, ch).double() * scale[:, ch // 64].double() + zero[:, ch // 64].double()
            want = torch.where(valid, want, torch.zeros((), dtype=torch.float64))
            torch.testing.assert_close(f[j, m], want, rtol=0, atol=1e-12)


def test_protected_fragments_hold_the_mapped_channels():
    x = torch.randn(64, 512)
    f = mg.emulate_prot_scores_fragment(x[:, 64:128])
    for k in range(64):
        ch, hi = mg.scores_channel(k)
        assert torch.equal(f[:, k], x[:, 64 + ch].double() * (16.0 if hi else 1.0)), k
    v = mg.emulate_prot_values_fragments(x)
    for j in range(8):
        for m in range(64):
            assert torch.equal(v[j, m], x[:, mg.values_channel(j, m)].double()), (j, m)


def test_values_fragments_catch_a_wrong_map():
    """The check above can fail: a fragment with two channels swapped is caught."""
    codes = torch.arange(64 * 256).remainder(251).to(torch.uint8).view(64, 256)
    f = mg.emulate_values_fragments(codes, torch.ones(64, 8), torch.zeros(64, 8), torch.ones(64, dtype=torch.bool))
    assert not torch.equal(f[0, 0], nibble(codes, mg.values_channel(0, 1)).double())


# --- CPU: a whole decode from emulated tiles ---------------------------------------------------------------


def emulated_decode(qn, qp, cache, table, seq_lens, slots, sm_scale, num_splits=1, denorm=True):
    """mla_decode the Gluon kernel's way (tile arithmetic, emulated fragments, online softmax, combine)."""
    B, H, _ = qn.shape
    qk = sm_scale * mg.LOG2E
    P, SINK, RECENT = cache.block_size, cache.sink, cache.recent
    ring = cache.rings[0]
    c, r = cache.content, cache.rope
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    out = torch.zeros(B, H, 512, dtype=torch.float64)
    lse = torch.full((B, H), -math.inf, dtype=torch.float64)
    for b in range(B):
        L = int(seq_lens[b])
        q16 = mg.stage_q(qn[b].cpu(), qp[b].cpu())
        q_hi = SINK + max(L - RECENT - SINK, 0)
        t_lo = SINK // 64
        nt_q = (q_hi + 63) // 64 - t_lo if q_hi > SINK else 0
        n_s = min(L, SINK)
        n_p = n_s + max(L - q_hi, 0)
        nt = nt_q + (n_p + 63) // 64
        per = -(-nt // num_splits)
        parts = []
        for sp in range(num_splits):
            m_i = torch.full((H,), -math.inf, dtype=torch.float64)
            l_i = torch.zeros(H, dtype=torch.float64)
            acc = torch.zeros(512, H, dtype=torch.float64)
            for t in range(sp * per, min(sp * per + per, nt)):
                if t < nt_q:
                    pos0 = (t + t_lo) * 64
                    row0 = int(table[b, pos0 // P]) * P + pos0 % P
                    rows = slice(row0, row0 + 64)
                    valid = (torch.arange(64) + pos0 >= SINK) & (torch.arange(64) + pos0 < q_hi)
                    S, frags = mg.emulate_body_tile(
                        q16, flat(c.codes)[rows].cpu(), flat(c.scale)[rows].cpu().float(),
                        flat(c.zero)[rows].cpu().float(), flat(r.codes)[rows].cpu(), flat(r.scale)[rows].cpu().float(),
                        flat(r.zero)[rows].cpu().float(), valid, qk, denorm)  # fmt: skip
                    x = torch.zeros(64, 512, dtype=torch.float64)
                    for j in range(8):
                        for m in range(64):
                            x[:, mg.values_channel(j, m)] = frags[j, m]
                else:
                    i = (t - nt_q) * 64 + torch.arange(64)
                    valid = i < n_p
                    ic = i.clamp(max=n_p - 1)  # `_prot_rows`: invalid tokens read the last valid row
                    p = torch.where(ic < n_s, ic, q_hi + ic - n_s)
                    rr = int(slots[b]) * (SINK + ring) + torch.where(p < SINK, p, SINK + (p - SINK) % max(ring, 1))
                    xc = cache.protected_content.reshape(-1, 512)[rr.to(cache.protected_content.device)].cpu().double()
                    xr = cache.protected_rope.reshape(-1, 64)[rr.to(cache.protected_rope.device)].cpu().double()
                    # the kernel's fragments (rows clamped, not masked: p = 0 drops the invalid tokens)
                    S = sum(mg.emulate_prot_scores_fragment(xc[:, 64 * g: 64 * g + 64]) @ q16[g] for g in range(8))
                    S = (S + mg.emulate_prot_scores_fragment(xr) @ q16[8]) * qk
                    S = torch.where(valid[:, None], S, -math.inf)
                    frags = mg.emulate_prot_values_fragments(xc)
                    x = torch.zeros(64, 512, dtype=torch.float64)
                    for j in range(8):
                        for m in range(64):
                            x[:, mg.values_channel(j, m)] = frags[j, m]
                m_new = torch.maximum(m_i, S.max(0).values)
                alpha = torch.exp2(m_i - m_new)
                pm = torch.exp2(S - m_new[None, :])
                l_i = l_i * alpha + pm.sum(0)
                acc = acc * alpha[None, :] + x.T @ pm
                m_i = m_new
            ok = l_i > 0
            ls = torch.where(ok, l_i, torch.ones_like(l_i))
            parts.append(((acc / ls[None, :]).T, torch.where(ok, (m_i + torch.log2(ls)) * math.log(2), -math.inf)))
        w_max = torch.stack([pl for _, pl in parts]).max(0).values
        w_max = torch.where(torch.isfinite(w_max), w_max, torch.zeros_like(w_max))
        tot = sum(torch.exp(pl - w_max) for _, pl in parts)
        o = sum(torch.exp(pl - w_max)[:, None] * po for po, pl in parts)
        okb = tot > 0
        out[b] = torch.where(okb[:, None], o / torch.where(okb, tot, 1.0)[:, None], 0.0)
        lse[b] = torch.where(okb, w_max + torch.log(torch.where(okb, tot, 1.0)), -math.inf)
    return out, lse


def check(out, lse, ref_out, ref_lse, tol=2e-2):
    scale = ref_out.abs().max().item() + 1e-6
    torch.testing.assert_close(out.double().cpu(), ref_out.cpu(), rtol=0, atol=tol * scale)
    fin = torch.isfinite(ref_lse).cpu()
    assert torch.equal(torch.isfinite(lse).cpu(), fin)
    torch.testing.assert_close(lse.double().cpu()[fin], ref_lse.cpu()[fin], rtol=5e-3, atol=2e-2)


@pytest.mark.parametrize("splits", [1, 3])
def test_emulated_decode_matches_reference(splits):
    lens = [0, 9, 44, 45, 130, 201]  # empty, inside the window, just past it, odd, page crossings
    cache, table, seq_lens, slots = fill(lens, dev="cpu")
    qn, qp = queries(len(lens), 5, dev="cpu")
    ref_out, ref_lse = mla_decode_reference(qn, qp, cache, table, seq_lens, slots, sm_scale=0.07)
    out, lse = emulated_decode(qn, qp, cache, table, seq_lens, slots, 0.07, num_splits=splits)
    check(out, lse, ref_out, ref_lse, tol=1e-3)  # fp64 emulation: only fp16 staging of q differs


def test_refuses_what_it_does_not_support():
    cache, table, seq_lens, slots = fill([70], dev="cpu", fmts=("int8", "int4"))
    qn, qp = queries(1, 4, dev="cpu")
    with pytest.raises(ValueError, match="content int4"):
        mg.mla_decode_gluon(qn, qp, cache, table, seq_lens, slots, 0.1, max_seq_len=70)
    cache, table, seq_lens, slots = fill([70], dev="cpu")
    qn, qp = queries(1, 20, dev="cpu")
    with pytest.raises(ValueError, match="heads"):
        mg.mla_decode_gluon(qn, qp, cache, table, seq_lens, slots, 0.1, max_seq_len=70)


# --- GPU: the kernel ----------------------------------------------------------------------------------------

LENS = [0, 3, 44, 45, 64 + 44, 129, 1000, 2 * 64 + 1 + 44, 4097]


@needs_hopper
@pytest.mark.parametrize("H", [1, 8, 16])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("denorm", [True, False])
def test_kernel_matches_reference(H, splits, out_dtype, denorm):
    cache, table, seq_lens, slots = fill(LENS, page=128 if H == 8 else 64)
    qn, qp = queries(len(LENS), H)
    if H == 8:
        qn, qp = qn.bfloat16(), qp.bfloat16()
    out, lse = mg.mla_decode_gluon(qn, qp, cache, table, seq_lens, slots, 0.07, max_seq_len=max(LENS),
                                   out_dtype=out_dtype, num_splits=splits, denorm=denorm)
    assert out.dtype == out_dtype and lse.dtype == torch.float32
    ref_out, ref_lse = mla_decode_reference(qn, qp, cache, table, seq_lens, slots, sm_scale=0.07)
    check(out, lse, ref_out, ref_lse)


@needs_hopper
@pytest.mark.parametrize("prot_vec,prot_prefetch", [(False, False), (True, False), (False, True)])
def test_kernel_protected_path_variants(prot_vec, prot_prefetch):
    """The old protected-row gathers (PROT_VEC=False) and the L2 prefetch switched off stay correct."""
    cache, table, seq_lens, slots = fill(LENS)
    qn, qp = queries(len(LENS), 16)
    out, lse = mg.mla_decode_gluon(qn, qp, cache, table, seq_lens, slots, 0.07, max_seq_len=max(LENS),
                                   num_splits=3, prot_vec=prot_vec, prot_prefetch=prot_prefetch)
    check(out, lse, *mla_decode_reference(qn, qp, cache, table, seq_lens, slots, sm_scale=0.07))


@needs_hopper
def test_kernel_default_splits_and_no_sink():
    cache, table, seq_lens, slots = fill([70, 3000, 0, 64], sink=0, recent=16)
    qn, qp = queries(4, 16)
    out, lse = mg.mla_decode_gluon(qn, qp, cache, table, seq_lens, slots, 0.05)
    check(out, lse, *mla_decode_reference(qn, qp, cache, table, seq_lens, slots, sm_scale=0.05))


@needs_hopper
def test_kernel_cuda_graph_capture_and_replay():
    cache, table, seq_lens, slots = fill([300, 77, 1500])
    qn, qp = queries(3, 16)
    args = (qn, qp, cache, table, seq_lens, slots, 0.07)
    mg.mla_decode_gluon(*args, max_seq_len=2048, num_splits=3)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = mg.mla_decode_gluon(*args, max_seq_len=2048, num_splits=3)
    qn.copy_(queries(3, 16, seed=7)[0])
    graph.replay()
    torch.cuda.synchronize()
    check(out, lse, *mla_decode_reference(qn, qp, cache, table, seq_lens, slots, sm_scale=0.07))


@needs_hopper
def test_mla_decode_dispatches_to_gluon(monkeypatch):
    from quantmla.kernels.mla_decode import mla_decode

    cache, table, seq_lens, slots = fill([500, 90])
    qn, qp = queries(2, 16)
    monkeypatch.setenv("QUANTMLA_DECODE_KERNEL", "gluon")
    called = []
    real = mg.mla_decode_gluon
    monkeypatch.setattr(mg, "mla_decode_gluon", lambda *a, **k: called.append(1) or real(*a, **k))
    out, lse = mla_decode(qn, qp, cache, table, seq_lens, slots, 0.07, max_seq_len=500)
    assert called
    check(out, lse, *mla_decode_reference(qn, qp, cache, table, seq_lens, slots, sm_scale=0.07))


def test_env_selects_gluon_only_when_asked(monkeypatch):
    from quantmla.kernels.mla_decode_cuda import decode_kernel_name

    cache, *_ = fill([70], dev="cpu")
    monkeypatch.delenv("QUANTMLA_DECODE_KERNEL", raising=False)
    assert decode_kernel_name(cache, 16, torch.device("cpu")) == "triton"
    monkeypatch.setenv("QUANTMLA_DECODE_KERNEL", "gluon")
    assert decode_kernel_name(cache, 16, torch.device("cpu")) == "gluon"
    tok, *_ = fill([70], dev="cpu", fmts=("int4:t64", "int4"))
    assert decode_kernel_name(tok, 16, torch.device("cpu")) == "triton"  # token-axis: always Triton's
