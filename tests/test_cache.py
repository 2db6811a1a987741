"""QuantMLACache on the tiny models of every family: exactness in BF16, INT8 greedy agreement, the window
policy, exact byte accounting, and clear errors."""

from __future__ import annotations

import inspect
from functools import lru_cache

import pytest
import torch
from transformers import DynamicCache

from quantmla.cache import QuantMLACache, QuantMLALayer, left_pads
from quantmla.config import CacheConfig, QuantFormat
from quantmla.quant.formats import bytes_per_token, fake_quantize
from quantmla.models.tiny import TINY_FAMILIES, tiny_model

FAMILIES = list(TINY_FAMILIES)
# The models' own attention reads QuantMLACache, and axk1's and mistral4's modules write it as deepseek_v3's do:
# the BF16 check runs them, the quality checks do not.
QUALITY_FAMILIES = [f for f in FAMILIES if f not in ("axk1", "mistral4")]
DC, DR = 32, 16  # tiny kv_lora_rank and rope dim (minicpm3: 8); groups of 8 divide both


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add overhead


@lru_cache(maxsize=None)
def _model(family):
    return tiny_model(family)


def _kw(model, cache) -> dict:
    # transformers 5.2x renamed `past_key_values` to `cache`; older releases only know the former.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def _ids(batch, length, seed=0):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _greedy_logits(model, cache, ids, steps):
    """Prefill then `steps` single-token decode steps feeding back the argmax; logits of every call."""
    out = [model(ids, **_kw(model, cache)).logits]
    for _ in range(steps):
        out.append(model(out[-1][:, -1:].argmax(-1), **_kw(model, cache)).logits)
    return out


def _parts(layer: QuantMLALayer, path="content"):
    p = getattr(layer, path)
    return p.sink.shape[-2], p.n_body, p.recent.shape[-2]


def _expected_parts(total, sink, recent):
    s = min(total, sink)
    r = min(total - s, recent)
    return s, total - s - r, r


# --- exactness and quality on real model code --------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sink,recent", [(0, 0), (2, 3)])
def test_bf16_reproduces_dynamic_cache(family, sink, recent):
    model = _model(family)
    cfg = CacheConfig("bf16", "bf16", sink=sink, recent=recent)
    ids = _ids(2, 7)
    with torch.no_grad():
        ref = _greedy_logits(model, DynamicCache(), ids, 5)
        got = _greedy_logits(model, QuantMLACache(cfg), ids, 5)
        for r, g in zip(ref, got):
            assert torch.equal(r, g)
        a = model.generate(ids, max_new_tokens=8, do_sample=False, **_kw(model, DynamicCache()))
        b = model.generate(ids, max_new_tokens=8, do_sample=False, **_kw(model, QuantMLACache(cfg)))
    assert torch.equal(a, b)


@pytest.mark.parametrize("family", QUALITY_FAMILIES)
def test_int8_keeps_greedy_tokens(family):
    """INT8 on both paths leaves the greedy continuation of (nearly) every prompt unchanged for 16 steps.

    Random tiny models have near-tied top-2 logits and near-tied MoE routing scores at some steps; any
    perturbation flips those, so a few prompts of 16 may diverge (measured: 0-2 of 16). A broken cache (wrong
    order, scale or window) diverges on most prompts, as INT4 without a window already does.
    """
    model = _model(family)
    ids = _ids(16, 10)
    steps = 16
    gen = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    with torch.no_grad():
        ref = model.generate(ids, **gen, **_kw(model, DynamicCache()))
        for sink, recent in [(0, 0), (2, 4)]:
            cache = QuantMLACache(CacheConfig("int8:8", "int8:8", sink=sink, recent=recent))
            out = model.generate(ids, **gen, **_kw(model, cache))
            same = (out == ref).all(1)
            assert same.sum() >= 13, f"sink={sink} recent={recent}: only {same.sum()} of 16 prompts identical"
            held = ids.shape[1] + steps - 1  # the last token is sampled, never fed back
            assert all(_parts(layer, p) == _expected_parts(held, sink, recent)
                       for layer in cache.layers for p in ("content", "rope"))
        # The agreement above can fail: INT4 without a window diverges on many more prompts (measured 3-8 of 16).
        int4 = QuantMLACache(CacheConfig("int4:8", "int4:8", sink=0, recent=0))
        assert (model.generate(ids, **gen, **_kw(model, int4)) == ref).all(1).sum() < 13


@pytest.mark.parametrize("family", QUALITY_FAMILIES)
def test_int4_changes_what_the_prefill_sees(family):
    """No silent passthrough: with recent=0 the prefill's own queries already attend to the INT4 history."""
    model = _model(family)
    ids = _ids(2, 9)
    with torch.no_grad():
        ref = model(ids, **_kw(model, DynamicCache())).logits
        q8 = model(ids, **_kw(model, QuantMLACache(CacheConfig("int8:8", "int8:8", sink=0, recent=0)))).logits
        q4 = model(ids, **_kw(model, QuantMLACache(CacheConfig("int4:8", "int4:8", sink=0, recent=0)))).logits
        # With every prompt token protected, the prefill is exact again.
        kept = model(ids, **_kw(model, QuantMLACache(CacheConfig("int4:8", "int4:8", sink=4, recent=5)))).logits
    err8, err4 = (q8 - ref).pow(2).mean(), (q4 - ref).pow(2).mean()
    # The first token attends only to itself; it is quantized too, so every position changes.
    assert err4 > 0 and (q4 - ref).abs().amax(-1).min() > 0
    assert err4 > 20 * err8 > 0  # ~16x the step -> ~256x the error power, far above 20x
    assert torch.equal(kept, ref)


# --- the window policy, layer by layer ----------------------------------------------------------------------


@pytest.mark.parametrize("prompt", [3, 5, 9])  # shorter than, equal to, longer than sink + recent = 5
@pytest.mark.parametrize("fmt", ["int4:8", "fp8:16", "bf16"])
def test_tokens_are_quantized_when_they_leave_the_window(prompt, fmt):
    sink, recent = 2, 3
    cfg = CacheConfig(fmt, "int2:8", sink=sink, recent=recent)
    cache = QuantMLACache(cfg)
    c = torch.randn(2, 1, prompt + 12, DC)
    k = torch.randn(2, 1, prompt + 12, DR)
    # Prefill, six single-token steps, then chunks of 2 and 4 tokens (as chunked prefill would send).
    bounds = [0, prompt, *range(prompt + 1, prompt + 7), prompt + 8, prompt + 12]
    for lo, hi in zip(bounds, bounds[1:]):
        got_c, got_k = cache.update(c[..., lo:hi, :], k[..., lo:hi, :], 0)
        s, n, r = _expected_parts(hi, sink, recent)
        layer = cache.layers[0]
        assert _parts(layer, "content") == _parts(layer, "rope") == (s, n, r)
        assert cache.get_seq_length() == hi and cache.get_mask_sizes(1, 0) == (hi + 1, 0)
        # What is returned is what is held: protected tokens as given, the body through its format. Groups
        # are per token, so the result does not depend on which call quantized a token.
        for got, x, f in ((got_c, c, cfg.content), (got_k, k, cfg.rope)):
            want = torch.cat([x[..., :s, :], fake_quantize(x[..., s:s + n, :], f), x[..., s + n:hi, :]], -2)
            assert got.dtype == x.dtype and torch.equal(got, want)
        assert not torch.equal(got_k[..., s:s + n, :], k[..., s:s + n, :]) or n == 0


def test_protected_tokens_keep_the_input_dtype():
    cache = QuantMLACache(CacheConfig("int4:8", "fp8:16", sink=1, recent=2))
    c, k = torch.randn(1, 1, 6, DC, dtype=torch.bfloat16), torch.randn(1, 1, 6, DR, dtype=torch.bfloat16)
    got_c, got_k = cache.update(c, k, 0)
    layer = cache.layers[0]
    assert got_c.dtype == got_k.dtype == torch.bfloat16
    assert layer.content.sink.dtype == layer.content.recent.dtype == torch.bfloat16
    assert layer.content.body.codes.dtype == torch.uint8 and layer.content.body.scale.dtype == torch.float16
    assert torch.equal(got_c[..., :1, :], c[..., :1, :]) and torch.equal(got_c[..., -2:, :], c[..., -2:, :])


# --- memory accounting --------------------------------------------------------------------------------------


def _stored_tensors(cache):
    for layer in cache.layers:
        for path in (layer.content, layer.rope):
            yield from (t for t in (path.sink, path.recent, path.body.codes, path.body.scale, path.body.zero,
                                    path.row_sink) if t is not None)


@pytest.mark.parametrize("content,rope", [("int4:8", "fp8:16"), ("int2:16", "int8:8"), ("fp8:0", "int4:16")])
def test_memory_bytes_is_what_is_stored(content, rope):
    cfg = CacheConfig(content, rope, sink=2, recent=3)
    cache = QuantMLACache(cfg, num_layers=3)
    batch, tokens = 2, 11
    for i in range(3):
        cache.update(torch.randn(batch, 1, 9, DC), torch.randn(batch, 1, 9, DR), i)
        cache.update(torch.randn(batch, 1, 2, DC), torch.randn(batch, 1, 2, DR), i)
    real = sum(t.numel() * t.element_size() for t in _stored_tensors(cache))
    assert cache.memory_bytes() == real
    body, protected = tokens - 5, 5
    per_layer = batch * (body * (bytes_per_token(cfg.content, DC) + bytes_per_token(cfg.rope, DR))
                         + protected * (DC + DR) * 4)  # protected tokens stay fp32 here
    assert real == 3 * per_layer
    assert cache.bytes_per_token() == real / (batch * tokens) / 3
    report = cache.memory_report()
    assert report["tokens"] == tokens and report["layers"] == 3 and report["bytes"] == real
    assert report["content"]["quantized_tokens"] == body and report["rope"]["protected_tokens"] == protected
    assert report["content"]["bytes"] + report["rope"]["bytes"] == real
    assert report["content"]["format"] == str(QuantFormat.parse(content))


def test_memory_report_names_every_layers_format():
    """Per-layer formats (a calibrated checkpoint's section): the report lists each layer's format and token
    counts in layer order; it gave layer 0's as the whole cache's."""
    cfg = CacheConfig("int4:8", "int4:8", sink=2, recent=3, layers=(("int4:8", "int4:8"), ("int2:8", "int8:t4")))
    cache = QuantMLACache(cfg)
    for i in range(2):
        cache.update(torch.randn(1, 1, 10, DC), torch.randn(1, 1, 10, DR), i)
    report = cache.memory_report()
    assert report["content"]["format"] == ["int4:8", "int2:8"] and report["content"]["quantized_tokens"] == 5
    assert report["rope"]["format"] == ["int4:8", "int8:t4"] and report["rope"]["quantized_tokens"] == [5, 4]
    assert report["content"]["bytes"] + report["rope"]["bytes"] == cache.memory_bytes()


def test_bf16_serving_cache_costs_1152_bytes_per_token_at_deepseek_dims():
    cache = QuantMLACache(CacheConfig.bf16())
    cache.update(torch.randn(1, 1, 300, 512, dtype=torch.bfloat16), torch.randn(1, 1, 300, 64).bfloat16(), 0)
    assert cache.bytes_per_token() == 1152  # (512 + 64) channels x 2 bytes


def test_int4_body_shrinks_memory():
    args = (torch.randn(1, 1, 64, DC, dtype=torch.bfloat16), torch.randn(1, 1, 64, DR, dtype=torch.bfloat16), 0)
    bf16, int4 = QuantMLACache(CacheConfig.bf16()), QuantMLACache(CacheConfig("int4:8", "int4:8", 0, 0))
    bf16.update(*args), int4.update(*args)
    assert int4.bytes_per_token() == (DC + DR) / 2 + 4 * (DC + DR) / 8  # codes + fp16 scale/zero per group
    assert bf16.bytes_per_token() == 2 * (DC + DR)


# --- cache housekeeping -------------------------------------------------------------------------------------


def test_reorder_select_crop_reset():
    cfg = CacheConfig("int4:8", "int8:8", sink=1, recent=2)
    c, k = torch.randn(3, 1, 7, DC), torch.randn(3, 1, 7, DR)
    idx = torch.tensor([2, 0, 0])
    ref = QuantMLACache(cfg)
    want = ref.update(c[idx], k[idx], 0)
    cache = QuantMLACache(cfg)
    cache.update(c[..., :4, :], k[..., :4, :], 0)
    cache.reorder_cache(idx)  # quantized per sequence, so a gather is exact
    got = cache.update(c[idx][..., 4:, :], k[idx][..., 4:, :], 0)
    assert all(torch.equal(a, b) for a, b in zip(got, want))

    cache.batch_select_indices(torch.tensor([1]))
    assert cache.layers[0].content.body.codes.shape[0] == 1
    cache.crop(-5)  # 2 recent + 3 body tokens
    assert _parts(cache.layers[0]) == (1, 1, 0) and cache.get_seq_length() == 2
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.memory_bytes() == 0 and cache.bytes_per_token() == 0.0
    cache.update(c, k, 0)
    assert cache.get_seq_length() == 7


@pytest.mark.parametrize("fmts", [("int4:8", "int4:8"), ("int4:t4", "int4:8")])
def test_after_a_crop_the_window_refills_before_more_is_quantized(fmts):
    """A crop leaves the body ahead of the policy (quantized tokens stay quantized); appends then fill the
    window back up, quantizing nothing until the policy catches up, and from there on one token per token."""
    cfg = CacheConfig(*fmts, sink=2, recent=8)
    c, k = torch.randn(1, 1, 40, DC), torch.randn(1, 1, 40, DR)
    cache = QuantMLACache(cfg)
    cache.update(c[..., :30, :], k[..., :30, :], 0)
    body = _parts(cache.layers[0])[1]
    cache.crop(-4)  # from the window: the body keeps its tokens
    assert _parts(cache.layers[0])[1] == body
    for t in range(26, 40):
        cache.update(c[..., t : t + 1, :], k[..., t : t + 1, :], 0)
        content = cache.layers[0].content
        # the policy at t + 1 tokens quantizes [sink, t + 1 - recent) (token axis: whole blocks of it)
        policy = ((t + 1 - 8 - 2) // content.block) * content.block
        assert content.n_body == max(body, policy), t
        assert cache.get_seq_length() == t + 1


def test_a_crop_through_a_block_changes_nothing():
    cfg = CacheConfig("int4:8", "int4:t8", sink=0, recent=0)
    cache = QuantMLACache(cfg)
    for layer in (0, 1):
        cache.update(torch.randn(1, 1, 20, DC), torch.randn(1, 1, 20, DR), layer)
    before = [[t.clone() for t in layer.tensors()] for layer in cache.layers]
    with pytest.raises(ValueError, match="cannot crop 2 quantized tokens out of int4:t8.s blocks of 8"):
        cache.crop(-6)
    assert cache.get_seq_length() == 20
    assert all(torch.equal(a, b) for layer, want in zip(cache.layers, before) for a, b in zip(layer.tensors(), want))


def test_assisted_decoding_with_a_token_axis_format_says_what_it_needs():
    """Prompt-lookup decoding crops rejected draft tokens; with a token-axis format and a window shorter than
    the draft the crop reaches a quantized block. The error named only the block, not assisted decoding or
    the way out; a window of at least the draft length runs."""
    model = _model("deepseek_v3")
    ids = _ids(1, 6).repeat(1, 4)  # repeats, so that the lookup drafts tokens the model rejects
    gen = dict(max_new_tokens=20, do_sample=False, prompt_lookup_num_tokens=8)
    with torch.no_grad():
        cache = QuantMLACache(CacheConfig("int8:8", "int8:t4", sink=1, recent=2))
        with pytest.raises(ValueError, match="cannot crop .* assisted or speculative decoding .* keep `recent` at "
                                             "least the number of draft tokens"):
            model.generate(ids, **gen, **_kw(model, cache))
        cache = QuantMLACache(CacheConfig("int8:8", "int8:t4", sink=1, recent=8))
        assert model.generate(ids, **gen, **_kw(model, cache)).shape[1] == ids.shape[1] + 20


def test_beam_search_matches_dynamic_cache_in_bf16():
    # Beam search goes through batch_repeat_interleave and reorder_cache.
    model = _model("longcat_flash")
    ids = _ids(2, 6)
    gen = dict(max_new_tokens=5, do_sample=False, num_beams=3)
    with torch.no_grad():
        ref = model.generate(ids, **gen, **_kw(model, DynamicCache()))
        got = model.generate(ids, **gen, **_kw(model, QuantMLACache(CacheConfig("bf16", "bf16", sink=1, recent=2))))
    assert torch.equal(ref, got)


# --- left padding -----------------------------------------------------------------------------------------


def _left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """rows [1,1,L_b,D] of different lengths -> [B,1,max L,D], each left-padded with junk (finite, large), and the
    pad counts."""
    width = max(r.shape[-2] for r in rows)
    pads = [width - r.shape[-2] for r in rows]
    junk = [100 * torch.randn(1, 1, p, r.shape[-1]) for p, r in zip(pads, rows)]
    return torch.cat([torch.cat([j, r], dim=-2) for j, r in zip(junk, rows)]), pads


class Alone:
    """One row fed alone, unpadded, through its own cache: what a padded row must return at its real positions."""

    def __init__(self, cfg, c, k):
        self.cache, self.c, self.k, self.length, self.out = QuantMLACache(cfg), c, k, 0, None

    def feed(self, end):
        """Feed the row's tokens up to (real) position end, if any are new."""
        if end > self.length:
            self.out = self.cache.update(self.c[..., self.length:end, :], self.k[..., self.length:end, :], 0)
            self.length = end

    def crop(self, n):
        self.cache.crop(-n)
        self.length -= n


def _check_rows(got, alones, pads, exact_rope=True, sink=4):
    """got: (content, rope) histories of the padded batch; row b from position pads[b] on must equal alones[b]'s
    (bit for bit; exact_rope=False: only the row's sink of the RoPE path)."""
    for b, (alone, pad) in enumerate(zip(alones, pads)):
        if alone.out is None:  # only pads so far
            assert all(g.shape[-2] <= pad for g in got)
            continue
        for path, (g, want) in enumerate(zip(got, alone.out)):
            if path == 0 or exact_rope:
                assert torch.equal(g[b : b + 1, :, pad:], want), (b, path)
            else:  # a token-axis path: only the row's sink is sure to be its own
                n = min(alone.length, sink)
                assert torch.equal(g[b : b + 1, :, pad : pad + n], want[..., :n, :]), b


@pytest.mark.parametrize("fmts, rotation", [(("int4:8", "int2:8"), ""), (("fp8:16", "int4:16"), "hadamard:1"),
                                             (("int4:8", "int4:t4"), "")])
def test_a_left_padded_row_is_stored_as_it_would_be_alone(fmts, rotation):
    """Rows of 14, 6 and 10 tokens, left-padded to 14 (pads 0, 8, 4: past the sink, and across it), prefilled in
    chunks, decoded, cropped through a real sink, reordered, selected and repeated: at every step each row's
    real positions are bit-identical to the row fed alone (channel formats; a token-axis path keeps its sink)."""
    cfg = CacheConfig(*fmts, sink=4, recent=3, rope_rotation=rotation)
    lengths, steps = (14, 6, 10), 8
    rows = [(torch.randn(1, 1, n + steps, DC), torch.randn(1, 1, n + steps, DR)) for n in lengths]
    alones = [Alone(cfg, c, k) for c, k in rows]
    c, pads = _left_padded([c for c, _ in rows])
    k, _ = _left_padded([k for _, k in rows])
    assert pads == [0, 8, 4]
    cache = QuantMLACache(cfg, left_padding=pads)
    exact_rope = cfg.rope.axis != "token"
    src = [0, 1, 2]  # each batch row's row of c and k: batch selection and reordering change it

    def feed(end):
        start = cache.get_seq_length()
        got = cache.update(c[src][..., start:end, :], k[src][..., start:end, :], 0)
        for alone, pad in zip(alones, pads):
            alone.feed(end - pad)
        _check_rows(got, alones, pads, exact_rope)

    for end in (3, 9, 14, 15, 16, 17):  # a prefill in three chunks (the first all pads for row 1), then decoding
        feed(end)
    cache.crop(-9)  # back to 8 tokens: all of row 1 (its real sink past the shared sink comes again)
    for alone in alones:
        alone.crop(9)
    for end in (11, 13):
        feed(end)

    def pick(idx):  # the batch's rows after a selection or reordering by idx
        return [src[i] for i in idx], [alones[i] for i in idx], [pads[i] for i in idx]

    cache.reorder_cache(torch.tensor([2, 0, 1]))
    src, alones, pads = pick([2, 0, 1])
    feed(14)
    cache.batch_select_indices(torch.tensor([0, 2]))
    src, alones, pads = pick([0, 2])
    feed(15)
    cache.batch_repeat_interleave(2)
    src, alones, pads = pick([0, 0, 1, 1])
    alones[1], alones[3] = (Alone(cfg, a.c, a.k) for a in alones[::2])  # the copies' own alone caches
    for twin, alone in zip(alones[1::2], alones[::2]):
        twin.feed(alone.length)
    feed(17)


@pytest.mark.parametrize("num_layers", [None, 1])
def test_pad_counts_follow_rows_reordered_before_the_first_update(num_layers):
    """Reordered and repeated while empty (layers not built yet, or built and not initialized), the cache's pad
    counts follow the rows as the first update will bring them."""
    cfg = CacheConfig("int4:8", "int4:8", sink=4, recent=2)
    rows = [(torch.randn(1, 1, n, DC), torch.randn(1, 1, n, DR)) for n in (12, 5)]
    c, pads = _left_padded([c for c, _ in rows])
    k, _ = _left_padded([k for _, k in rows])
    cache = QuantMLACache(cfg, num_layers=num_layers, left_padding=pads)
    cache.reorder_cache(torch.tensor([1, 0]))
    cache.batch_repeat_interleave(2)
    src = [1, 1, 0, 0]
    got = cache.update(c[src], k[src], 0)
    alones = [Alone(cfg, *rows[i]) for i in src]
    for alone in alones:
        alone.feed(alone.c.shape[-2])
    _check_rows(got, alones, [pads[i] for i in src])


def test_left_padding_costs_what_its_row_sink_holds():
    """The real sink tokens padding pushes past the shared sink are held as given, min(pad, sink) slots per row
    for the most padded row; memory_bytes and the report count them."""
    cfg = CacheConfig("int4:8", "int4:8", sink=4, recent=2)
    c, k = torch.randn(2, 1, 12, DC), torch.randn(2, 1, 12, DR)
    plain = QuantMLACache(cfg)
    plain.update(c, k, 0)
    padded = QuantMLACache(cfg, left_padding=torch.tensor([0, 3]))
    padded.update(c, k, 0)
    layer = padded.layers[0]
    assert layer.content.row_sink.shape == (2, 1, 3, DC) and layer.rope.row_sink.shape == (2, 1, 3, DR)
    assert padded.memory_bytes() == plain.memory_bytes() + 2 * 3 * (DC + DR) * 4
    assert padded.memory_bytes() == sum(t.numel() * t.element_size() for t in _stored_tensors(padded))
    assert padded.memory_report()["content"]["row_sink_slots"] == 3
    assert plain.memory_report()["content"]["row_sink_slots"] == 0


def _prompts_left_padded(lengths, seed=0):
    rows = [_ids(1, n, seed + i) for i, n in enumerate(lengths)]
    width = max(lengths)
    ids = torch.cat([torch.cat([torch.zeros(1, width - r.shape[1], dtype=torch.long), r], 1) for r in rows])
    mask = (torch.arange(width) >= width - torch.tensor(lengths)[:, None]).long()
    return rows, ids, mask


def test_a_left_padded_batch_generates_as_each_row_alone():
    """Tiny DeepSeek-V3, INT4 both paths, sink 4: prompts of 14 and 7 tokens left-padded into one batch give each
    row's own prefill logits and greedy generation, as alone, when the cache is told the padding; without it the
    shorter row's real sink tokens are quantized and its logits move (so this test can fail)."""
    model = _model("deepseek_v3")
    cfg = CacheConfig("int4:16", "int4:16", sink=4, recent=2)
    rows, ids, mask = _prompts_left_padded([14, 7])
    pads = left_pads(mask)
    assert pads.tolist() == [0, 7]
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    gen = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True,
               pad_token_id=0)
    with torch.no_grad():
        def prefill(cache):
            return model(ids, attention_mask=mask, position_ids=positions, **_kw(model, cache)).logits

        def generate(cache):
            return model.generate(ids, attention_mask=mask, **gen, **_kw(model, cache))

        told, untold = prefill(QuantMLACache(cfg, left_padding=pads)), prefill(QuantMLACache(cfg))
        out, out_untold = generate(QuantMLACache(cfg, left_padding=pads)), generate(QuantMLACache(cfg))
        for b, (row, pad) in enumerate(zip(rows, pads.tolist())):
            alone = model(row, **_kw(model, QuantMLACache(cfg))).logits[0]
            torch.testing.assert_close(told[b, pad:], alone, rtol=0, atol=1e-5)
            solo = model.generate(row, **gen, **_kw(model, QuantMLACache(cfg)))
            assert torch.equal(out.sequences[b, ids.shape[1]:], solo.sequences[0, row.shape[1]:])
            for step, (got, want) in enumerate(zip(out.logits, solo.logits)):
                torch.testing.assert_close(got[b], want[0], rtol=0, atol=1e-5, msg=f"row {b} step {step}")
    # Untold, the padded row's real sink is quantized: its logits move (the unpadded row stays as alone).
    assert (untold[1, 7:] - told[1, 7:]).abs().max() > 1e-3
    assert max((u[1] - t[1]).abs().max() for u, t in zip(out_untold.logits, out.logits)) > 1e-3
    torch.testing.assert_close(untold[0], told[0], rtol=0, atol=1e-5)


# --- errors -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 4, 3, DC), (1, 3, DC), (1, 1, 1, 3, DC)])
def test_non_mla_shapes_raise(shape):
    with pytest.raises(ValueError, match=r"layer 0: expected an MLA content latent .* \[batch, 1, tokens, dim\]"):
        QuantMLACache().update(torch.randn(shape), torch.randn(1, 1, 3, DR), 0)


def test_a_multi_head_model_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match="is this an MLA model"):
        model(_ids(1, 4) % 64, **_kw(model, QuantMLACache()))


@pytest.mark.parametrize("content,rope,where", [("int4:24", "int4:8", "layer 0 content"),
                                                 ("int4:8", "int8:12", "layer 0 rope")])
def test_group_not_dividing_raises_at_first_update(content, rope, where):
    model = _model("deepseek_v3")
    cache = QuantMLACache(CacheConfig(content, rope))  # fine until the widths are known
    with pytest.raises(ValueError, match=f"{where} format .*does not divide its (32|16) channels"):
        model(_ids(1, 3), **_kw(model, cache))


def test_default_groups_are_fitted_to_the_models_widths():
    """CacheConfig("int4", "int4") as the README spells it, on minicpm3's 32 latent and 8 RoPE channels (narrower
    than the default group of 64): the cache stores what the CLI and the engine fit it to, int4:32 / int4:8."""
    model = _model("minicpm3")
    ids = _ids(1, 24)
    cache = QuantMLACache(CacheConfig("int4", "int4", sink=2, recent=4))
    fitted = QuantMLACache(CacheConfig("int4", "int4", sink=2, recent=4).fit(DC, 8))
    got, want = (model(ids, **_kw(model, c)).logits for c in (cache, fitted))
    assert torch.equal(got, want)
    report = cache.memory_report()
    assert (report["content"]["format"], report["rope"]["format"]) == ("int4:32", "int4:8")
    assert report["bytes"] == fitted.memory_report()["bytes"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_raise(bad):
    cache = QuantMLACache(CacheConfig("int4:8", "fp8:16", sink=0, recent=8))
    k = torch.randn(1, 1, 3, DR)
    k[0, 0, 1, 2] = bad
    # Raised when the value arrives, although it would sit in the window for 8 more tokens.
    with pytest.raises(ValueError, match="cannot quantize layer 0 rope: it holds 1 non-finite values"):
        cache.update(torch.randn(1, 1, 3, DC), k, 0)


@pytest.mark.parametrize("prefilled", [0, 3])
def test_a_refused_update_stores_nothing_on_either_path(prefilled):
    """A NaN in k_pe is refused after the content path had stored its tokens: the content path ran one call
    ahead, so get_seq_length counted a token the rope path lacked and the next call returned histories of
    different lengths."""
    cache = QuantMLACache(CacheConfig("int4:8", "int4:8", sink=0, recent=0))
    c, k = torch.randn(1, 1, 5, DC), torch.randn(1, 1, 5, DR)
    if prefilled:
        cache.update(c[..., :prefilled, :], k[..., :prefilled, :], 0)
    bad = k[..., prefilled:prefilled + 1, :].clone()
    bad[..., 0] = float("nan")
    with pytest.raises(ValueError, match="layer 0 rope: it holds 1 non-finite"):
        cache.update(c[..., prefilled:prefilled + 1, :], bad, 0)
    assert cache.get_seq_length() == prefilled
    got_c, got_k = cache.update(c[..., prefilled:, :], k[..., prefilled:, :], 0)
    assert got_c.shape[-2] == got_k.shape[-2] == 5


@pytest.mark.parametrize("fmt", ["int4:8", "int4:t4", "bf16"])
def test_a_cache_cropped_to_nothing_takes_another_batch(fmt):
    """Cropped to 0 tokens, a cache holds no sequence: a batch of another size starts it afresh, as a new cache
    would (it failed in torch.cat, its empty rows still sized for the old batch)."""
    config = CacheConfig(fmt, fmt, sink=2, recent=4)
    cache = QuantMLACache(config)
    cache.update(torch.randn(3, 1, 12, DC), torch.randn(3, 1, 12, DR), 0)
    cache.crop(-12)
    assert cache.get_seq_length() == 0
    c, k = torch.randn(2, 1, 12, DC), torch.randn(2, 1, 12, DR)
    got = cache.update(c, k, 0)
    want = QuantMLACache(config).update(c, k, 0)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("config", [None, "int4:8", {"content": "int4:8", "rope": "int4:8"}])
def test_a_config_that_is_not_a_cache_config_is_refused_at_construction(config):
    """It failed inside the model's forward as "'NoneType' object has no attribute 'at'" (None is what
    cache_config_of gives for a checkpoint that was never calibrated)."""
    with pytest.raises(TypeError, match="QuantMLACache takes a CacheConfig.*got " + type(config).__name__):
        QuantMLACache(config)


def test_layer_index_beyond_num_layers_raises():
    with pytest.raises(ValueError, match="built for 2 layers but got layer_idx=3"):
        QuantMLACache(num_layers=2).update(torch.randn(1, 1, 1, DC), torch.randn(1, 1, 1, DR), 3)


def test_width_change_raises():
    cache = QuantMLACache(CacheConfig("int4:8", "int4:8"))
    cache.update(torch.randn(1, 1, 2, DC), torch.randn(1, 1, 2, DR), 0)
    with pytest.raises(ValueError, match="widths changed"):
        cache.update(torch.randn(1, 1, 1, 2 * DC), torch.randn(1, 1, 1, DR), 0)


def test_a_batch_of_another_size_is_refused_by_name():
    cache = QuantMLACache(CacheConfig("int4:8", "int4:8", 1, 2))
    cache.update(torch.randn(1, 1, 5, DC), torch.randn(1, 1, 5, DR), 0)
    with pytest.raises(ValueError, match="layer 0 content: this cache holds 1 sequence.*got a batch of 2"):
        cache.update(torch.randn(2, 1, 1, DC), torch.randn(2, 1, 1, DR), 0)


@pytest.mark.parametrize("sink, recent", [(2.5, 128), (4, "128"), (True, 128)])
def test_sink_and_recent_must_be_whole_numbers(sink, recent):
    with pytest.raises(ValueError, match="sink and recent must be whole numbers"):
        CacheConfig("int4", "int4", sink, recent)


@pytest.mark.parametrize("left_padding, says", [
    ([1, 2, 3], "left_padding has 3 pad counts, one per row, but the batch has 2 rows"),
    ([0, -1], r"left_padding counts must be >= 0, got \[0, -1\]"),
    ([0.0, 2.5], "left_padding takes one whole pad count per row"),
    ([[0, 1]], "left_padding takes one whole pad count per row"),
])
def test_bad_left_padding_is_refused_by_name(left_padding, says):
    with pytest.raises(ValueError, match=says):
        QuantMLACache(CacheConfig("int4:8", "int4:8"), left_padding=left_padding).update(
            torch.randn(2, 1, 5, DC), torch.randn(2, 1, 5, DR), 0)


@pytest.mark.parametrize("mask, says", [
    ([[1, 1, 0], [1, 1, 1]], "row 0 of the attention mask has a pad after a real token; this is not left padding"),
    ([[1, 1, 1], [0, 0, 0]], "row 1 of the attention mask has no real token"),
    ([1, 1, 1], r"takes an attention mask \[batch, tokens\], got \(3,\)"),
])
def test_left_pads_refuses_a_mask_that_is_not_left_padding(mask, says):
    assert left_pads(torch.tensor([[0, 0, 1], [1, 1, 1]])).tolist() == [2, 0]
    with pytest.raises(ValueError, match=says):
        left_pads(torch.tensor(mask))


def test_a_bad_group_spelling_says_what_a_format_looks_like():
    for spec in ("int4:abc", "int4:32cx"):
        with pytest.raises(ValueError, match=r"expected KIND\[:GROUP or :tTOKENS\]"):
            QuantFormat.parse(spec)

