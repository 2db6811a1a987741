"""Mistral 4's query factor: after RoPE its attention multiplies the whole query by
1 + beta * log(1 + floor(position / original_max)) (transformers' get_llama_4_attn_scale). Wherever quantmla
computes attention from the cache instead of calling the module (the reference math, the engine's prefill and
decode steps, the serving forward and served prefill, analysis, SmoothQuant's statistics, calibration), the
query must carry it, at the position of its own token.

The tiny mistral4 model has original_max 32 and beta 0.5: the factor is 1 below position 32, 1.35 from 32,
1.55 from 64, 1.69 from 96, so these windows of ~100 tokens cross it three times. Queries are sharpened (x4)
so that the factor shows in the outputs. Each test compares with the model's own computation; with the factor
left out (`mla.query_position_factor` returning ones) each of them fails but the calibration one, which checks
that the calibration runs (it needs the positions) and folds exactly.
"""

import dataclasses

import pytest
import torch

from quantmla.cache.quant_cache import QuantMLACache
from quantmla.capture import capture
from quantmla.config import CacheConfig
from quantmla.engine import LLM, SamplingParams
from quantmla.mla import attention_from_cache, project_queries
from quantmla.models.adapters import attention_module, cache_kwargs, describe, query_weight
from quantmla.models.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

L = 100


def sharp_mistral4():
    model = tiny_model("mistral4")
    with torch.no_grad():
        for layer in describe(model):
            query_weight(attention_module(model, layer), layer).weight.mul_(4)
    return model


def window(n: int = 2, length: int = L, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(seed))


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_reference_attention_applies_the_factor():
    model = sharp_mistral4()
    layers = describe(model)
    seen = capture(model, layers, window())
    for layer in layers:
        k, attn = seen[layer.cache_idx], attention_module(model, layer)
        out, _ = attention_from_cache(attn, layer, k.hidden, k.position_embeddings, k.c, k.k_pe, positions=k.positions)
        assert rel(out, k.output) < 1e-5
        without = dataclasses.replace(layer, query_pos_beta=0.0)
        out, _ = attention_from_cache(attn, without, k.hidden, k.position_embeddings, k.c, k.k_pe)
        assert rel(out[:, :32], k.output[:, :32]) < 1e-5 and rel(out[:, 32:], k.output[:, 32:]) > 1e-2
    with pytest.raises(ValueError, match="scaled by its position: project_queries needs the query positions"):
        project_queries(attn, layer, k.hidden, k.position_embeddings)


def test_engine_prefill_and_decode_logits_are_the_models():
    """BF16 cache (an fp32 model on the CPU keeps fp32 rows): every next-token logit of the engine (prefill in
    chunks of 16, then decode steps) equals the model's own forward over the same tokens; the short prompt's
    decode crosses position 32, the long one's 96."""
    model = sharp_mistral4()
    llm = LLM(sharp_mistral4(), content="bf16", rope="bf16", block_size=16, max_num_seqs=2, prefill_chunk=16)
    got = []

    def recorded(step):
        def run(seqs):
            logits = step(seqs)
            got.extend((list(s.token_ids), row) for s, row in zip(seqs, logits))
            return logits
        return run

    llm.runner.prefill, llm.runner.decode = recorded(llm.runner.prefill), recorded(llm.runner.decode)
    llm.generate(window(1, 20)[0].tolist(), SamplingParams(max_tokens=30, ignore_eos=True))
    llm.generate(window(1, 70, seed=6)[0].tolist(), SamplingParams(max_tokens=30, ignore_eos=True))
    assert len(got) == 60
    with torch.no_grad():
        want = torch.stack([model(torch.tensor([tokens])).logits[0, -1] for tokens, _ in got])
    torch.testing.assert_close(torch.stack([row for _, row in got]), want, rtol=1e-4, atol=1e-4)


def test_serving_forward_is_the_models_forward_and_the_served_cache():
    """`serving_logits`: BF16 formats give the model's forward; INT4 gives feeding the window token by token
    through a QuantMLACache, whose attention is the module's own."""
    from quantmla.eval.serving import serving_logits

    model, ids = sharp_mistral4(), window()
    with torch.no_grad():
        plain = model(ids).logits
        torch.testing.assert_close(serving_logits(model, ids, CacheConfig.bf16(), 0, query_block=16), plain,
                                   rtol=1e-5, atol=1e-5)
        config = CacheConfig("int4", "int4", 2, 8).fit(32, 16)
        cache = QuantMLACache(config)
        kw = cache_kwargs(model, cache)
        token_by_token = torch.cat([model(ids[:, i:i + 1], use_cache=True, **kw).logits for i in range(L)], dim=1)
        torch.testing.assert_close(serving_logits(model, ids, config, 0, query_block=16), token_by_token,
                                   rtol=2e-5, atol=2e-5)


def test_served_prefill_rolls_each_rows_positions():
    """generate over a left-padded batch inside `served_prefill` (rows of 90 and 50 tokens: the short row's
    position ids, from generate's mask, are its own, not the columns'): each row's logits are those of the
    serving forward over that row alone."""
    from quantmla.eval.serving import served_prefill, serving_logits

    model = sharp_mistral4()
    config = CacheConfig("int4", "int4", 2, 8).fit(32, 16)
    rows = [window(1, 90)[0], window(1, 50, seed=6)[0]]
    pads = [0, 40]
    ids = torch.stack([torch.cat([torch.zeros(p, dtype=torch.long), r]) for p, r in zip(pads, rows)])
    mask = (torch.arange(90)[None] >= torch.tensor(pads)[:, None]).long()
    cache = QuantMLACache(config, left_padding=pads)
    with torch.no_grad(), served_prefill(model, config):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=True, **cache_kwargs(model, cache))
    new, logits = out.sequences[:, 90:], torch.stack(out.logits, dim=1)
    served = [serving_logits(model, torch.cat([r, new[b, :-1]])[None], config, 4)[0] for b, r in enumerate(rows)]
    torch.testing.assert_close(logits, torch.stack(served), rtol=5e-5, atol=5e-5)


def test_analysis_and_smoothquant_statistics_see_the_models_queries():
    """The amplification analysis' clean attention (`policy_output`) is the module's output, and SmoothQuant's
    query maxima are those of the queries at their own positions (with the factor: larger than without)."""
    from quantmla.analysis.amplification import policy_output
    from quantmla.eval.baselines import activation_maxima

    model = sharp_mistral4()
    layers = describe(model)
    ids = window(1)
    seen = capture(model, layers, ids)
    stats = activation_maxima(model, layers, ids)
    for layer in layers:
        k, attn = seen[layer.cache_idx], attention_module(model, layer)
        out, _ = policy_output(attn, layer, k, torch.zeros(L, L))
        assert rel(out, k.output) < 1e-5
        with torch.no_grad():
            q_pe = project_queries(attn, layer, k.hidden, k.position_embeddings, k.positions)[1]
            q_pe_1 = project_queries(attn, dataclasses.replace(layer, query_pos_beta=0.0), k.hidden,
                                     k.position_embeddings)[1]
        pairs = torch.tensor(layer.cache_pairs)
        want = q_pe[..., pairs].norm(dim=-1).amax((0, 1, 2))
        torch.testing.assert_close(stats[layer.cache_idx]["q_pe"], want)
        assert (want > 1.2 * q_pe_1[..., pairs].norm(dim=-1).amax((0, 1, 2))).any()


def test_calibration_and_budget_run_on_windows_past_the_factors_period():
    """Calibration (and the byte-budget search) read the queries' positions from what the model passes its
    attention (without them project_queries refuses), and the folds keep the function exactly."""
    from quantmla.calibrate.budget import format_errors
    from quantmla.calibrate.driver import calibrate_model

    model = sharp_mistral4()
    layers = describe(model)
    ids = window(4, 96)
    cfg = CacheConfig("int4", "int4", sink=4, recent=16)
    assert len(format_errors(model, layers, ids, cfg.fit(32, 16), ranked=False)) == 2 * len(layers)
    with torch.no_grad():
        logits = model(ids).logits
    reports = calibrate_model(model, layers, ids, cfg, steps=2, progress=False)
    assert all(r.content_identity > 0 and r.rope_identity > 0 for r in reports)
    with torch.no_grad():
        assert rel(model(ids).logits, logits) <= 1e-5
