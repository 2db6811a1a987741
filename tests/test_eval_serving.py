"""The serving forward (`eval.serving`) and the scorers built on it: every position's logits equal feeding the
window one token per call through a QuantMLACache (exact serving semantics); BF16 formats give the plain
forward; teacher-forced needles agree with greedy generation; nothing of [L, L] or [L, vocab] size."""

import pytest
import torch
import torch.nn.functional as F

from quantmla.cache.quant_cache import QuantMLACache
from quantmla.config import CacheConfig
from quantmla.data import read_text, resolve_model_dir, tokenizer_for
from quantmla.eval import retrieval
from quantmla.eval.perplexity import score_window
from quantmla.eval.serving import ServingAttention, serving, serving_logits
from quantmla.models import load_model
from quantmla.models.adapters import attention_module, cache_kwargs, describe
from quantmla.models.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

# Tiny models: kv_lora_rank 32, rope 16. Windows of 40 tokens, sink 2, recent 8, query blocks of 16: every
# query block meets sink, stored and BF16 keys, and the staging of blocks of 8 tokens.
CONFIGS = {
    "int4/int4": CacheConfig("int4", "int4", 2, 8),
    "int2 clipped/int4": CacheConfig("int2:32c0.9", "int4", 2, 8),
    "per-layer": CacheConfig("int4", "int4", 2, 8, layers=(("int2", "int4"), ("bf16", "int2"), ("int4", "bf16"))),
    "rope rotation": CacheConfig("int4", "int2", 2, 8, rope_rotation="hadamard:1"),
    "token axis": CacheConfig("int4:t8", "int4:t8", 2, 8),
    "token-axis content, channel rope": CacheConfig("int4:t8", "int2", 2, 8),  # the paths' thresholds differ
    "no protected tokens": CacheConfig("int4", "int2", 0, 0),
}


@pytest.fixture(scope="module")
def models():
    return {family: tiny_model(family) for family in ("deepseek_v2", "deepseek_v3", "mistral4")}


@pytest.fixture(scope="module")
def window():
    return torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def token_by_token(model, ids, config):
    cache = QuantMLACache(config)
    kw = cache_kwargs(model, cache)
    return torch.cat([model(ids[:, i:i + 1], use_cache=True, **kw).logits for i in range(ids.shape[1])], dim=1)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_serving_forward_is_token_by_token_cache(models, window, family, name):
    model, config = models[family], CONFIGS[name].fit(32, 16)
    served = serving_logits(model, window, config, 0, query_block=16)
    expected = token_by_token(model, window, config)
    torch.testing.assert_close(served, expected, atol=2e-5, rtol=2e-5)
    with torch.no_grad():
        plain = model(window).logits
    assert (served - plain).abs().amax() > 1e-3  # the quantized keys were seen


# mistral4: queries past position 32 carry its position factor (tests/test_position_factor.py has more)
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "mistral4"])
def test_bf16_serving_is_the_plain_forward_and_modules_come_back(models, window, family):
    model = models[family]
    layers = describe(model)
    modules = [attention_module(model, layer) for layer in layers]
    implementation = model.config._attn_implementation
    with torch.no_grad():
        plain = model(window).logits
    for config in (CacheConfig.bf16(), CacheConfig("bf16", "bf16", 2, 8)):
        torch.testing.assert_close(serving_logits(model, window, config, 0, query_block=16), plain,
                                   atol=1e-5, rtol=1e-5)
    with serving(model, CacheConfig.bf16()):
        assert all(isinstance(attention_module(model, layer), ServingAttention) for layer in layers)
    with pytest.raises(RuntimeError, match="boom"), serving(model, CacheConfig.bf16()):
        raise RuntimeError("boom")
    assert [attention_module(model, layer) for layer in layers] == modules and describe(model) == layers
    assert model.config._attn_implementation == implementation


def test_memory_no_square_scores_and_logits_at_scored_positions_only(models, monkeypatch):
    """Attention runs per block of queries over keys up to the block's end, and the lm_head sees the
    scored positions only: nothing of [L, L] or [L, vocab] size for a window of L."""
    model, length, block, scored = models["deepseek_v3"], 256, 32, 24
    config = CacheConfig("int4", "int4", 4, 16).fit(32, 16)
    calls, rows = [], []
    real = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, **kw):
        calls.append((q.shape[-2], k.shape[-2], tuple(attn_mask.shape)))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    handle = model.get_output_embeddings().register_forward_hook(lambda m, i, o: rows.append(o.shape[-2]))
    ids = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(8))
    try:
        lp = score_window(model, ids, scored, config, query_block=block)
        codec = retrieval.Codec(None, 128)
        samples = retrieval.samples_for("single", 120, 2)
        retrieval.accuracy(model, config, codec, samples)
    finally:
        handle.remove()
    assert lp.shape == (1, scored, 128)
    answer = len(codec.encode_answer(samples[0].answer))
    assert rows == [scored, answer], rows  # the window, then one batch of the two needle samples
    window_calls = calls[:3 * length // block]  # 3 layers x 8 blocks
    assert all(q <= block for q, _, _ in window_calls)
    # Each block reads the keys up to its end once, plus one more version of ~ block + recent of them.
    assert max(k for _, k, _ in window_calls) <= length + block + 16 + 64
    assert max(q * k for q, k, _ in window_calls) < length * length / 4


@pytest.mark.parametrize("predicted, ok", [("482913\n", True), ("482913E", True), ("48291\n\n", False),
                                           ("482913 ", False), ("E82913\n", False)])
def test_answer_correct(predicted, ok):
    ids = lambda text: [ord(ch) if ch != "E" else 999 for ch in text]  # noqa: E731
    assert retrieval.answer_correct(ids(predicted), ids("482913\n"), {999}, final_newline=True) == ok
    assert not retrieval.answer_correct(ids("482913E"), ids("482913\n"), {999}, final_newline=False)


@pytest.fixture(scope="module")
def default_model():
    model_dir = resolve_model_dir(None)
    return load_model(model_dir), retrieval.Codec(tokenizer_for(model_dir), 259)


@torch.no_grad()
def greedy_text_correct(model, codec, samples, config, new_tokens) -> list[bool]:
    """Greedy generation through a QuantMLACache fed one token per call, judged on the text as before
    teacher forcing: the text before the first newline (special tokens dropped) equals the answer."""
    ids = torch.tensor([codec.encode_prompt(s.prompt) for s in samples])
    cache = QuantMLACache(config)
    kw = cache_kwargs(model, cache)
    for i in range(ids.shape[1]):
        logits = model(ids[:, i:i + 1], use_cache=True, **kw).logits[:, -1]
    out = []
    for _ in range(new_tokens):
        out.append(logits.argmax(-1))
        logits = model(out[-1][:, None], use_cache=True, **kw).logits[:, -1]
    texts = [codec.decode(row) for row in torch.stack(out, 1).tolist()]
    return [t.split("\n", 1)[0] == s.answer.rstrip("\n") for t, s in zip(texts, samples)]


def _corrupt(sample):
    """The needle's value changed in the prompt (same length): the right answer is no longer in it."""
    value = sample.answer.rstrip("\n")
    wrong = "".join(str((int(ch) + 1) % 10) for ch in value)
    return type(sample)(sample.task, sample.prompt.replace(f": {value}\n", f": {wrong}\n"), sample.answer)


@pytest.mark.parametrize("config, expected", [
    (CacheConfig.bf16(), [True, True, False, True, True, True, False, True]),  # samples 2 and 6 corrupted
    (CacheConfig("int2", "int4", 0, 2), [False, False, True, True, True, False, True, True]),
])
def test_teacher_forced_needles_are_greedy_generation(default_model, config, expected):
    model, codec = default_model
    samples = retrieval.samples_for("multikey", 160, 8, seed=3, filler=read_text(None, "heldout.txt"))
    if config == CacheConfig.bf16():
        samples = [_corrupt(s) if i in (2, 6) else s for i, s in enumerate(samples)]
    config = config.fit(512, 64)
    greedy = greedy_text_correct(model, codec, samples, config, 8)
    forced = [retrieval.accuracy(model, config, codec, [s]) == 1.0 for s in samples]
    assert forced == greedy == expected
    assert retrieval.accuracy(model, config, codec, samples, batch=8) == sum(expected) / 8  # batched alike
    assert retrieval.outcomes(model, config, codec, samples, batch=3) == expected  # in sample order, batched


# The per-layer config has formats for 3 cache layers: the 3-layer DeepSeek tiny models only.
@pytest.mark.parametrize("family, name", [
    *((f, n) for f in ("deepseek_v2", "deepseek_v3", "minicpm3", "longcat_flash")
      for n in ("int4/int4", "int2 clipped/int4", "rope rotation")),
    ("deepseek_v2", "per-layer"), ("deepseek_v3", "per-layer")])
def test_served_prefill_generates_as_the_serving_forward(family, name):
    """generate over a left-padded batch inside `served_prefill`, through a QuantMLACache told the padding: at
    every step each row's logits are those of the serving forward over that row alone, unpadded (prompt and
    generated tokens so far). Without it the prompt's prefill goes through the cache in one call, so its
    tokens see keys older than the prompt's last `recent` quantized, and the logits move (so this can fail)."""
    from quantmla.eval.serving import served_prefill

    model = tiny_model(family)
    layer = describe(model)[0]
    config = CONFIGS[name].fit(layer.kv_lora_rank, layer.rope_dim)
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 128, (n,), generator=gen) for n in (30, 19)]
    pads = [30 - len(r) for r in rows]
    ids = torch.stack([torch.cat([torch.zeros(p, dtype=torch.long), r]) for p, r in zip(pads, rows)])
    mask = (torch.arange(30)[None] >= torch.tensor(pads)[:, None]).long()

    def generate(served: bool):
        cache = QuantMLACache(config, left_padding=pads)
        with torch.no_grad(), (served_prefill(model, config) if served else torch.enable_grad()):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                                 return_dict_in_generate=True, output_logits=True, **cache_kwargs(model, cache))
        return out.sequences[:, 30:], torch.stack(out.logits, dim=1)  # [2, 5], [2, 5, vocab]

    new, logits = generate(served=True)
    served = [serving_logits(model, torch.cat([r, new[b, :-1]])[None], config, 5)[0] for b, r in enumerate(rows)]
    torch.testing.assert_close(logits, torch.stack(served), atol=5e-5, rtol=5e-5)
    assert all(isinstance(attention_module(model, la), type(attention_module(tiny_model(family), la)))
               for la in describe(model))  # the modules came back
    _, pessimistic = generate(served=False)
    assert (pessimistic[:, 0] - logits[:, 0]).abs().amax() > 2e-4  # 4x the tolerance above
