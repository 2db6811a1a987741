"""What calibration may choose besides the transforms (issue 10, items 2-4): clipping ratios in the formats,
per-layer formats in the cache config and the caches, equal-bytes accounting, and the byte budget."""

import itertools
import sys
from pathlib import Path

import pytest
import torch

from quantmla.cache import QuantMLACache
from quantmla.cache.paged import PagedMLACache
from quantmla.calibrate.budget import candidates, choose_formats, fraction_at, knapsack
from quantmla.config import CacheConfig, QuantFormat
from quantmla.eval.suite import body_bytes_per_token, measure_bytes_per_token
from quantmla.models import attention_module, describe
from quantmla.models.tiny import tiny_model
from quantmla.quant.formats import bytes_per_token, dequantize, fake_quantize, quantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


# ---------------------------------------------------------------- clipping ratio
@pytest.mark.parametrize("spec,clip", [("int4c0.9", 0.9), ("int2:32c0.75", 0.75), ("int8:t64c0.5", 0.5)])
def test_clip_spelling_round_trips(spec, clip):
    fmt = QuantFormat.parse(spec)
    assert fmt.clip == clip and QuantFormat.parse(str(fmt)) == fmt and str(fmt) == spec


@pytest.mark.parametrize("spec", ["int4c0", "int4c1.5", "int4cx", "fp8c0.9", "bf16c0.9", "lm3c0.9"])
def test_bad_clips_are_refused(spec):
    with pytest.raises(ValueError):
        QuantFormat.parse(spec)


def test_clipped_scale_and_zero_recomputed_independently():
    """One group of 8 values: the codes span the middle 60 % of [min, max] (centred), the values beyond clip
    to the end codes, and the bytes are those of the unclipped format."""
    x = torch.tensor([[-10.0, -1.0, 0.0, 0.5, 1.0, 2.0, 3.0, 10.0]])
    fmt = QuantFormat("int4", 8, clip=0.6)
    p = quantize(x, fmt)
    lo, span = -10 + 20 * 0.2, 20 * 0.6
    assert p.zero.item() == pytest.approx(lo, abs=1e-3)
    assert p.scale.item() == pytest.approx(span / 15, rel=2e-3)
    y = dequantize(p, fmt)[0]
    assert y[0] == pytest.approx(lo, abs=1e-2) and y[-1] == pytest.approx(lo + span, rel=2e-3)  # clipped
    inner = (y[1:-1] - x[0, 1:-1]).abs().max().item()
    assert inner <= p.scale.item() / 2 + 1e-4  # rounding error of a step 0.6x the unclipped one
    assert (fake_quantize(x, QuantFormat("int4", 8))[0, 1:-1] - x[0, 1:-1]).abs().max() > inner
    assert p.nbytes == quantize(x, QuantFormat("int4", 8)).nbytes


# ---------------------------------------------------------------- per-layer formats
def test_per_layer_config_round_trips_and_picks_layers():
    cfg = CacheConfig("int4", "int4", layers=[["int2c0.8", "int4"], ["int4:32", "int8c0.9"]])
    assert CacheConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.at(1) == CacheConfig("int4:32", "int8c0.9")
    assert CacheConfig().at(7) == CacheConfig()
    with pytest.raises(ValueError, match="formats for 2 layers, not for layer 2"):
        cfg.at(2)
    with pytest.raises(ValueError, match="group 48 does not divide"):
        CacheConfig(layers=[["int4", "int4:48"]]).check_dims(512, 64)


def test_quant_cache_stores_each_layers_format():
    cfg = CacheConfig("int4", "int4", sink=2, recent=4, layers=[["int2", "int4:16"], ["int8", "bf16"]])
    cache = QuantMLACache(cfg)
    for i in range(2):
        cache.update(torch.randn(1, 1, 70, 64), torch.randn(1, 1, 70, 16), i)
    assert [str(layer.content.fmt) for layer in cache.layers] == ["int2", "int8"]
    per_layer = [layer.memory_bytes() for layer in cache.layers]
    body = [bytes_per_token(QuantFormat("int2"), 64) + bytes_per_token(QuantFormat("int4", 16), 16),
            bytes_per_token(QuantFormat("int8"), 64) + 2 * 16 * 2]  # the bf16 rope body holds fp32 inputs here
    assert per_layer == [64 * b + 6 * 4 * (64 + 16) for b in body]


def test_paged_cache_needs_one_layers_config():
    cfg = CacheConfig(layers=[["int4", "int4"]])
    with pytest.raises(ValueError, match="per-layer formats"):
        PagedMLACache.allocate(cfg, 512, 64, 2, 1)
    assert PagedMLACache.allocate(cfg.at(0), 512, 64, 2, 1).body_bytes_per_token == 324
    # token-axis: fp16 scale + zero per channel and block of 64 tokens, the same bytes as groups of 64 channels
    tokens = PagedMLACache.allocate(CacheConfig("int4:t64", "int4:t64"), 512, 64, 2, 1)
    assert tokens.body_bytes_per_token == 324 == bytes_per_token(tokens.content.fmt, 512) + 36
    with pytest.raises(ValueError, match="int4:t64's block of 64 tokens must divide the page size 32"):
        PagedMLACache.allocate(CacheConfig("int4", "int4:t64"), 512, 64, 2, 1, block_size=32)


def test_measured_bytes_average_the_layers():
    a, b = CacheConfig("int2", "int4"), CacheConfig("int8", "int8")
    both = CacheConfig(layers=[["int2", "int4"], ["int8", "int8"], ["int8", "int8"]])
    want = (measure_bytes_per_token(a, 512, 64, 600) + 2 * measure_bytes_per_token(b, 512, 64, 600)) / 3
    assert measure_bytes_per_token(both, 512, 64, 600) == pytest.approx(want)
    assert body_bytes_per_token(both, 512, 64) == pytest.approx((128 + 32 + 36 + 2 * (512 + 32 + 64 + 4)) / 3)


# ---------------------------------------------------------------- equal bytes
@pytest.mark.parametrize("length", [2048, 3000])
def test_equal_bytes_rows_match_kivis_measured_bytes(length):
    from eval_methods import equal_bytes_rows, parse_rows

    from quantmla.eval.baselines import kivi

    rows = equal_bytes_rows(parse_rows("rtn,kivi@int4/int4,kivi@int2/int4"), length)
    assert [m for m, _ in rows] == ["rtn", "kivi", "quantmla", "kivi", "quantmla"]
    for (_, k_args), (_, q_args) in ((rows[1], rows[2]), (rows[3], rows[4])):
        _, k_cfg = kivi(None, k_args)
        q_cfg = CacheConfig(q_args.content, q_args.rope, 4, q_args.recent)
        assert q_cfg.content.axis == "channel" and q_cfg.recent > 128
        k, q = (measure_bytes_per_token(c, 512, 64, n) for c in (k_cfg, q_cfg) for n in (length,))
        assert k == q
    assert measure_bytes_per_token(k_cfg, 512, 64, 131072) == measure_bytes_per_token(q_cfg, 512, 64, 131072) or \
        length % 64 != 0


# ---------------------------------------------------------------- byte budget
def test_knapsack_is_optimal():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        items = [[(float(torch.rand(1, generator=g)), int(torch.randint(1, 9, (1,), generator=g)))
                  for _ in range(3)] for _ in range(4)]
        cap = int(torch.randint(4, 30, (1,), generator=g))
        feasible = [c for c in itertools.product(range(3), repeat=4) if sum(items[i][k][1] for i, k in enumerate(c)) <= cap]
        got = knapsack(items, cap)
        if not feasible:
            assert got is None
            continue
        best = min(sum(items[i][k][0] for i, k in enumerate(c)) for c in feasible)
        assert sum(items[i][k][1] for i, k in enumerate(got)) <= cap
        assert sum(items[i][k][0] for i, k in enumerate(got)) == pytest.approx(best)


def test_budget_choice_meets_the_budget_and_spends_it():
    model = tiny_model("deepseek_v3")
    layers = describe(model)
    ids = torch.randint(0, 128, (4, 96))
    cfg = CacheConfig("int4", "int4", sink=4, recent=16)
    bf16 = 2 * (layers[0].kv_lora_rank + layers[0].rope_dim)
    fractions = []
    for budget in (0.25, 0.35, 0.5):
        alloc = choose_formats(model, layers, ids, cfg, budget, context=4096)
        body = body_bytes_per_token(alloc.config, layers[0].kv_lora_rank, layers[0].rope_dim)
        assert alloc.fraction == pytest.approx(fraction_at(body, bf16, alloc.config, 4096))
        assert alloc.fraction <= budget and len(alloc.config.layers) == len(layers)
        fractions.append(alloc.fraction)
        # nothing cheaper would be chosen if more error could be removed: the budget is (nearly) spent
        assert alloc.fraction > budget - 0.1
    assert fractions == sorted(fractions)
    with pytest.raises(ValueError, match="even the smallest formats"):
        choose_formats(model, layers, ids, cfg, 0.05, context=4096)
    # at 40 tokens the BF16 window (4 + 16) alone is half the cache: no body fits 0.3 (was a negative-size tensor)
    assert knapsack([[(0.0, 1)]], -1) is None
    with pytest.raises(ValueError, match="even the smallest formats take .* at 40 tokens"):
        choose_formats(model, layers, ids, cfg, 0.3, context=40)


def test_budget_candidates_are_servable_channel_formats():
    from quantmla.calibrate.space import SearchSpace

    got = candidates(512, (32, 64, 128, 256))
    assert QuantFormat("bf16") in got and QuantFormat("int2", 256) in got and len(got) == 13
    assert all(SearchSpace.servable(f) for f in got)
    assert candidates(32, (16, 32, 64)) == [QuantFormat("bf16")] + [QuantFormat(k, g) for k in ("int8", "int4", "int2")
                                                                      for g in (16, 32)]


def test_ranked_candidates_pack_into_whole_bytes_on_any_width():
    """A latent whose eighth is odd (kv_lora_rank 40: ranked groups of 5) gets only ranks its kind packs into
    whole bytes, from the budget's candidates and from calibration's ranked formats; --budget on such a model
    used to crash in the packer (int4r5)."""
    from quantmla.calibrate.budget import ranked_candidates
    from quantmla.calibrate.space import ranked_formats

    for dim, group in ((40, 5), (200, 25)):
        formats = ranked_candidates(dim) + ranked_formats(QuantFormat("int2", group), dim)
        assert formats and any(f.kind == "int4" for f in formats)
        for f in formats:
            f.check_dim(dim)
    model = tiny_model("deepseek_v3", kv_lora_rank=40)
    layers = describe(model)
    alloc = choose_formats(model, layers, torch.randint(0, 128, (3, 64)), CacheConfig(sink=4, recent=16).fit(40, 16),
                           0.3, context=4096)
    alloc.config.check_dims(40, 16)


def test_budget_picks_ranked_content_where_the_latent_is_low_rank():
    """Content latents confined to 2 of 32 dimensions: at a tight budget the allocation stores a ranked content
    format (scored in its principal axes) in every layer; with ranked=False it cannot, and its summed error
    is far larger."""
    from quantmla.calibrate.budget import ranked_candidates

    assert {str(f) for f in ranked_candidates(512)} >= {"int8r64", "int4r256", "int2r384"}
    assert all(f.group == 4 for f in ranked_candidates(32))
    torch.manual_seed(0)
    model = tiny_model("deepseek_v3")
    layers = describe(model)
    dc = layers[0].kv_lora_rank
    with torch.no_grad():
        for layer in layers:
            w = attention_module(model, layer).kv_a_proj_with_mqa.weight
            w[:dc] = w[:dc, :2] @ torch.randn(2, w.shape[1])
    ids = torch.randint(0, 128, (4, 96))
    cfg = CacheConfig("int4", "int4", sink=4, recent=16)
    ranked = choose_formats(model, layers, ids, cfg, 0.3, context=4096)
    plain = choose_formats(model, layers, ids, cfg, 0.3, context=4096, ranked=False)
    assert all(c.rank for c, _ in ranked.config.per_layer)
    assert not any(c.rank for c, _ in plain.config.per_layer)

    def summed(alloc):
        return sum(alloc.errors[(layer.cache_idx, p)][f] for layer, pair in zip(layers, alloc.config.per_layer)
                   for p, f in zip(("content", "rope"), pair))

    assert ranked.fraction <= 0.3 and summed(ranked) < 0.5 * summed(plain)
