"""QuantMLACache on the tiny models of every family: exactness in BF16, INT8 greedy agreement, the window
policy, exact byte accounting, and clear errors."""

from __future__ import annotations

import inspect
from functools import lru_cache

import pytest
import torch
from transformers import DynamicCache

from quantmla.cache import QuantMLACache, QuantMLALayer
from quantmla.config import CacheConfig, QuantFormat
from quantmla.quant.formats import bytes_per_token, fake_quantize
from quantmla.models.tiny import TINY_FAMILIES, tiny_model

FAMILIES = list(TINY_FAMILIES)
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


@pytest.mark.parametrize("family", FAMILIES)
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


@pytest.mark.parametrize("family", FAMILIES)
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
            yield from (t for t in (path.sink, path.recent, path.body.codes, path.body.scale, path.body.zero)
                        if t is not None)


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
                                                 ("int4:8", "int8:32", "layer 0 rope")])
def test_group_not_dividing_raises_at_first_update(content, rope, where):
    model = _model("deepseek_v3")
    cache = QuantMLACache(CacheConfig(content, rope))  # fine until the widths are known
    with pytest.raises(ValueError, match=f"{where} format .*does not divide its (32|16) channels"):
        model(_ids(1, 3), **_kw(model, cache))


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


def test_a_bad_group_spelling_says_what_a_format_looks_like():
    for spec in ("int4:abc", "int4:32cx"):
        with pytest.raises(ValueError, match=r"expected KIND\[:GROUP or :tTOKENS\]"):
            QuantFormat.parse(spec)

