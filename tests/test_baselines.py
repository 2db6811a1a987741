"""The baselines: their formats (fp4, Lloyd-Max codebooks, token-axis groups), the cache's staging and online
rotation, and every method on tiny models (exact folds, byte counts at DeepSeek dims, clear errors)."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantmla.cache import QuantMLACache
from quantmla.cache.quant_cache import online_rotation
from quantmla.config import CacheConfig, QuantFormat
from quantmla.eval.baselines import (
    BASELINES,
    Calibration,
    activation_maxima,
    calibration_ids,
    method_info,
    online_cost,
    quantmla,
)
from quantmla.eval.methods import MethodArgs
from quantmla.models import describe
from quantmla.models.adapters import MLALayer, cache_kwargs
from quantmla.models.tiny import tiny_model
from quantmla.quant.formats import (
    FP4_VALUES,
    bytes_per_token,
    dequantize,
    fake_quantize,
    fake_quantize_ste,
    lloyd_max_gaussian,
    pack_bits,
    quantize,
    unpack_bits,
)

FAST = settings(max_examples=30, deadline=None)
FAMILIES = ["deepseek_v2", "deepseek_v3", "longcat_flash", "minicpm3"]  # every rope style, LongCat's scales
FAST_CALIBRATION = Calibration(samples=3, length=160, steps=2)  # 160 > sink 4 + recent 128


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add overhead


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def nmse(x, y):
    return ((x - y).pow(2).sum() / x.pow(2).sum()).item()


# --- formats -------------------------------------------------------------------------------------------


@FAST
@given(lead=st.lists(st.integers(1, 3), max_size=2).map(tuple), words=st.integers(1, 5), seed=st.integers(0, 999))
def test_3bit_pack_round_trip(lead, words, seed):
    codes = torch.randint(0, 8, lead + (8 * words,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_bits(codes, 3)
    assert packed.shape == lead + (3 * words,) and packed.dtype == torch.uint8
    assert torch.equal(unpack_bits(packed, 3), codes)


def test_3bit_layout_is_little_endian_24_bit_words():
    # channel 8i+k in bits 3k..3k+2 of the 24-bit word made of bytes 3i (low) .. 3i+2 (high)
    assert pack_bits(torch.tensor([5, 0, 0, 0, 0, 0, 0, 0]), 3).tolist() == [5, 0, 0]
    assert pack_bits(torch.tensor([0, 0, 7, 0, 0, 0, 0, 0]), 3).tolist() == [7 << 6 & 0xFF, 7 >> 2, 0]
    assert pack_bits(torch.tensor([0, 0, 0, 0, 0, 0, 0, 7]), 3).tolist() == [0, 0, 7 << 5]


@pytest.mark.parametrize("spec", ["fp4", "fp4:32", "lm4", "lm3", "lm2", "lm3:64", "int4:t64", "int2:t32", "int8:t16"])
@pytest.mark.parametrize("dim", [64, 512])
def test_bytes_per_token_is_what_is_stored(spec, dim):
    fmt = QuantFormat.parse(spec)
    x = torch.randn(2, 1, 64, dim)
    assert quantize(x, fmt).nbytes == bytes_per_token(fmt, dim) * 2 * 64


def test_reference_byte_counts_at_deepseek_dims():
    b = lambda spec, dim: bytes_per_token(QuantFormat.parse(spec), dim)  # noqa: E731
    assert b("fp4", 512) + b("fp4", 64) == 288 + 36 == 324  # NVFP4-style pool
    assert b("lm3", 512) + b("bf16", 64) == 192 + 2 + 128 == 322  # TurboQuant-style latent, RoPE BF16
    assert b("int4:t64", 512) + b("int4:t64", 64) == 324  # KIVI at G = 64: as int4 in channel groups of 64
    assert b("int4:t32", 512) + b("int4:t32", 64) == 360  # KIVI's paper setting
    assert b("int4:t64", 8) == 4.5  # a fraction where a block's scales do not split evenly over its tokens


def test_fp4_representable_values_are_exact_and_nibbles_as_int4():
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 8, (5, 64), generator=g)
    idx[:, ::16] = 7  # every block holds +-6, so its scale is exactly the e4m3 value chosen below
    sign = torch.randint(0, 2, (5, 64), generator=g) * 2 - 1
    scale = torch.tensor([2.0**-9, 0.0625, 1.0, 13.0, 448.0])[:, None]  # e4m3 values, subnormal to max
    x = torch.tensor(FP4_VALUES)[idx] * sign * scale
    fmt = QuantFormat("fp4")
    assert torch.equal(fake_quantize(x, fmt), x)
    p = quantize(torch.tensor([[6.0, -6.0] + [0.0] * 14]), fmt)
    assert p.codes[0, 0].item() == 0xF7  # channel 0: +6 = 0b0111 low nibble; channel 1: -6 = 0b1111 high
    assert p.scale.view(torch.float8_e4m3fn).float().item() == 1.0


def test_fp4_error_is_within_half_a_gap():
    x = torch.randn(64, 256) * torch.logspace(-2, 2, 64)[:, None]
    p = quantize(x, QuantFormat("fp4"))
    scale = p.scale.view(torch.float8_e4m3fn).float().repeat_interleave(16, -1)
    # the widest gap between e2m1 values is 2 (4 -> 6): at most 1 step unit of error, 0.25 near zero
    y = (x / scale).abs()
    half_gap = torch.where(y > 4, 1.0, torch.where(y > 2, 0.5, 0.25))
    assert ((dequantize(p, QuantFormat("fp4")) - x).abs() <= half_gap * scale * (1 + 1e-6)).all()


def test_lloyd_max_levels_match_max_1960():
    assert lloyd_max_gaussian(1)[0][1] == pytest.approx(0.7979, abs=1e-4)
    assert lloyd_max_gaussian(2)[0][2:] == pytest.approx((0.4528, 1.5104), abs=1e-4)
    assert lloyd_max_gaussian(3)[0][4:] == pytest.approx((0.2451, 0.7560, 1.3439, 2.1520), abs=1e-4)


def test_codebook_beats_uniform_3_bit_on_gaussian_data():
    x = torch.randn(4096, 512, generator=torch.Generator().manual_seed(0))
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)  # uniform 3-bit, per-token min/max
    uniform = ((x - lo) / (hi - lo) * 7).round() / 7 * (hi - lo) + lo
    errors = {k: nmse(x, fake_quantize(x, QuantFormat(k))) for k in ("lm2", "lm3", "lm4")}
    assert errors["lm3"] < 0.6 * nmse(x, uniform)  # min/max uniform wastes levels on the rare tails
    assert errors["lm3"] == pytest.approx(0.03455, rel=0.03)  # Max's distortion for 8 levels
    assert errors["lm4"] < errors["lm3"] < errors["lm2"]


def test_token_axis_groups_each_channel_over_blocks_of_tokens():
    fmt = QuantFormat.parse("int4:t8")
    assert (fmt.kind, fmt.group, fmt.axis, str(fmt)) == ("int4", 8, "token", "int4:t8")
    assert QuantFormat.parse("int2:t").group == 32 and QuantFormat.parse(str(fmt)) == fmt
    assert fmt.fit(4) == fmt  # the group counts tokens: never shrunk to a path's width
    x = torch.randn(2, 1, 16, 12) * torch.logspace(-1, 2, 12)  # channels of very different ranges
    y = fake_quantize(x, fmt)
    blocks = x.unflatten(-2, (2, 8))  # [..., block, token, channel]
    step = (blocks.amax(-2) - blocks.amin(-2)) / 15
    assert ((y - x).abs().unflatten(-2, (2, 8)) <= step.unsqueeze(-2) * 0.51 + 1e-3 * step.unsqueeze(-2)).all()
    assert nmse(x, y) < nmse(x, fake_quantize(x, QuantFormat("int4", 12)))  # per-channel wins here
    with pytest.raises(ValueError, match="multiple of 8 tokens"):
        quantize(x[..., :5, :], fmt, "content")


@pytest.mark.parametrize("spec", ["fp4", "lm3", "int4:t8"])
def test_straight_through_forward_is_fake_quantize(spec):
    x = torch.randn(3, 16, 32, requires_grad=True)
    y = fake_quantize_ste(x, QuantFormat.parse(spec))
    # x + (q - x): equal to q up to one rounding of the addition
    torch.testing.assert_close(y, fake_quantize(x.detach(), QuantFormat.parse(spec)), rtol=0, atol=1e-6)
    (y * torch.linspace(-1, 1, 32)).sum().backward()
    if spec == "int4:t8":  # the integer surrogate along tokens: min/max scale gradients, not plain identity
        xt = x.detach().transpose(-1, -2).requires_grad_(True)
        (fake_quantize_ste(xt, QuantFormat("int4", 8)).transpose(-1, -2) * torch.linspace(-1, 1, 32)).sum().backward()
        assert torch.equal(x.grad, xt.grad.transpose(-1, -2))
        assert not torch.equal(x.grad, torch.linspace(-1, 1, 32).expand_as(x))
    else:
        assert torch.equal(x.grad, torch.linspace(-1, 1, 32).expand_as(x))


@pytest.mark.parametrize("spec,dim,match", [
    ("fp4:0", 64, "needs a group size"), ("fp8:t32", 64, "cannot group along tokens"),
    ("lm3:t32", 64, "cannot group along tokens"), ("bf16:t8", 64, "cannot group along tokens"),
    ("int4:t0", 64, "needs a group size"), ("lm3", 44, "cannot be packed 8 per 3 bytes"),
    ("fp4", 40, "group 16 does not divide"), ("int4:tx", 64, "expected KIND:tTOKENS")])
def test_bad_new_formats_raise(spec, dim, match):
    with pytest.raises(ValueError, match=match):
        QuantFormat.parse(spec).check_dim(dim)


# --- the cache: staging (token-axis formats) and the online rotation -------------------------------------


@pytest.mark.parametrize("chunks", [[23], [1] * 23, [5, 1, 9, 2, 6]])
def test_token_axis_staging_counts_and_history(chunks):
    cfg = CacheConfig("int4:t4", "int2:t4", sink=1, recent=3)
    cache = QuantMLACache(cfg)
    c_all, r_all = torch.randn(2, 1, 23, 32), torch.randn(2, 1, 23, 16)
    t = 0
    for n in chunks:
        c, r = cache.update(c_all[..., t : t + n, :], r_all[..., t : t + n, :], 0)
        t += n
        layer = cache.layers[0]
        leaving = max(0, t - 1 - 3)
        for path in (layer.content, layer.rope):
            assert (path.sink.shape[-2], path.n_body, path.staging.shape[-2], path.recent.shape[-2]) == (
                min(t, 1), leaving - leaving % 4, leaving % 4, min(max(t - 1, 0), 3))
            assert len(path) == t
        body = leaving - leaving % 4
        # sink, staging and recent are returned as given; the body is quantized in blocks of 4 tokens
        expect_c = torch.cat([c_all[..., :1, :], fake_quantize(c_all[..., 1 : 1 + body, :], cfg.content),
                              c_all[..., 1 + body : t, :]], dim=-2)
        assert torch.equal(c, expect_c)
        assert r.shape == (2, 1, t, 16)
    report = cache.memory_report()
    assert report["content"]["staged_tokens"] == 19 % 4 and report["content"]["quantized_tokens"] == 16
    protected = 2 * (1 + 3 + 3) * (32 + 16) * 4  # batch 2, sink + staging + recent, fp32 inputs
    assert cache.memory_bytes() == protected + 2 * 16 * (bytes_per_token(cfg.content, 32) +
                                                          bytes_per_token(cfg.rope, 16))


def test_token_axis_crop_and_batch_ops():
    cache = QuantMLACache(CacheConfig("int4:t4", "int4:t4", sink=0, recent=2))
    cache.update(torch.randn(3, 1, 13, 32), torch.randn(3, 1, 13, 16), 0)  # body 8, staging 3, recent 2
    layer = cache.layers[0]
    layer.batch_select_indices(torch.tensor([0, 2]))
    assert layer.content.staging.shape[0] == 2 and layer.content.body.scale.shape == (2, 1, 2, 32)
    layer.crop(-9)  # recent 2 + staging 3 + one whole block of 4
    assert (layer.content.n_body, layer.content.body.scale.shape[-2], layer.get_seq_length()) == (4, 1, 4)
    with pytest.raises(ValueError, match="blocks of 4 tokens"):
        layer.crop(-1)


def test_online_rotation_round_trips_and_quantizes_the_rotated_key():
    x, c = torch.randn(2, 1, 40, 16), torch.randn(2, 1, 40, 32)
    h = online_rotation("hadamard:3", 16)
    assert torch.allclose(h @ h.T, torch.eye(16), atol=1e-6)
    plain = QuantMLACache(CacheConfig("bf16", "bf16", sink=0, recent=0, rope_rotation="hadamard:3"))
    _, r = plain.update(c, x, 0)
    assert rel(r, x) < 1e-6  # quantization aside, H then H^T is the identity
    cfg = CacheConfig("int4:8", "int4:8", sink=2, recent=6, rope_rotation="hadamard:3")
    cache = QuantMLACache(cfg)
    c_out, r_out = cache.update(c, x, 0)
    store = cache.layers[0].rope
    assert torch.equal(store.body.codes, quantize(x[..., 2:34, :] @ h.T, cfg.rope).codes)
    assert torch.allclose(r_out[..., 2:34, :], fake_quantize(x[..., 2:34, :] @ h.T, cfg.rope) @ h, atol=1e-6)
    assert torch.equal(r_out[..., :2, :], x[..., :2, :]) and torch.equal(r_out[..., 34:, :], x[..., 34:, :])
    assert torch.equal(c_out, QuantMLACache(CacheConfig("int4:8", "int4:8", 2, 6)).update(c, x, 0)[0])
    unrotated = QuantMLACache(CacheConfig("int4:8", "int4:8", 2, 6))
    unrotated.update(c, x, 0)
    assert cache.memory_bytes() == unrotated.memory_bytes()  # the matrix is per model, not per token


def test_rope_rotation_spec_is_checked_and_recorded():
    assert CacheConfig(rope_rotation="hadamard:7").to_dict()["rope_rotation"] == "hadamard:7"
    assert "rope_rotation" not in CacheConfig().to_dict()
    assert CacheConfig.from_dict(CacheConfig(rope_rotation="hadamard").to_dict()).rope_rotation == "hadamard"
    assert CacheConfig(rope_rotation="hadamard:1").fit(32, 16).rope_rotation == "hadamard:1"
    for bad in ("givens", "hadamard:x", ":3"):
        with pytest.raises(ValueError, match="rope_rotation"):
            CacheConfig(rope_rotation=bad)


# --- the methods ---------------------------------------------------------------------------------------

_MODELS: dict = {}


def _model(family, **overrides):
    key = (family, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        _MODELS[key] = tiny_model(family, **overrides)
    return _MODELS[key]


def _run(name, model, args=MethodArgs()):
    if name == "quantmla":
        return quantmla(model, args, FAST_CALIBRATION)
    return BASELINES[name](model, args)


def _logits(model, ids, cfg):
    with torch.no_grad():
        return model(ids, **cache_kwargs(model, QuantMLACache(cfg))).logits


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(BASELINES))
def test_folds_are_exact_and_the_given_model_is_untouched(family, name):
    model = _model(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = _logits(model, ids, CacheConfig.bf16())
    new, cfg = _run(name, model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert (new is model) == (name in ("fp4", "kivi"))  # only the format-only methods keep the model
    # BF16 cache (with the method's online rotation, if any, over every token): the original function
    bf16 = CacheConfig("bf16", "bf16", sink=0, recent=0, rope_rotation=cfg.rope_rotation)
    assert rel(_logits(new, ids, bf16), ref) <= 1e-5


@pytest.mark.parametrize("name,body", [("fp4", 324), ("turboquant", 322), ("kivi", 324), ("quarot", 324),
                                       ("smoothquant", 324), ("quantmla", 324)])
def test_bytes_per_token_at_deepseek_dims(name, body):
    model = _model("deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=1,
                   first_k_dense_replace=1)
    if name == "quantmla":  # a calibrated checkpoint: the section is used as is (no calibration here)
        model = tiny_model("deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=1,
                           first_k_dense_replace=1)
        model.config.quantmla = {"method": "quantmla", **CacheConfig().to_dict()}
    new, cfg = _run(name, model)
    cfg = cfg.fit(512, 64)
    assert bytes_per_token(cfg.content, 512) + bytes_per_token(cfg.rope, 64) == body
    n = cfg.sink + cfg.recent + 64 * 3  # whole KIVI blocks: nothing left in staging
    cache = QuantMLACache(cfg)
    cache.update(torch.randn(1, 1, n, 512, dtype=torch.bfloat16), torch.randn(1, 1, n, 64, dtype=torch.bfloat16), 0)
    assert cache.memory_bytes() == (cfg.sink + cfg.recent) * 1152 + 64 * 3 * body


def test_quarot_reports_its_online_cost():
    layer = MLALayer("deepseek_v2", 0, "m", num_heads=16, kv_lora_rank=512, rope_dim=64, nope_dim=128, v_dim=128,
                     q_path="q_proj", rope_style="complex")  # DeepSeek-V2-Lite's attention
    cost = online_cost(CacheConfig(rope_rotation="hadamard:0"), layer)
    assert cost["online_flops_per_token"] == 17 * 2 * 64 * 64 == 139264  # new key + 16 query heads, dense
    assert cost["online_flops_per_token_fwht"] == 17 * 64 * 6
    model = _model("deepseek_v3")
    new, cfg = BASELINES["quarot"](model, MethodArgs())
    assert cfg.rope_rotation and method_info(new, cfg)["online_flops_per_token"] == 5 * 2 * 16 * 16
    _, cfg = BASELINES["quarot"](model, MethodArgs(rope="bf16"))
    assert not cfg.rope_rotation and method_info(model, cfg)["online_flops_per_token"] == 0
    assert method_info(model, CacheConfig())["online_flops_per_token"] == 0


def test_smoothquant_balances_cache_and_query_maxima():
    model = _model("deepseek_v3")
    new, _ = BASELINES["smoothquant"](model, MethodArgs())
    ids = calibration_ids(model, 4, 512)
    for s in activation_maxima(new, describe(new), ids).values():
        # alpha = 0.5 leaves max|c'_j| / max|q~'_j| the same for every channel (and pair)
        for a, b in (("c", "q"), ("k_pe", "q_pe")):
            ratio = s[a] / s[b]
            assert (ratio.max() / ratio.min()).item() == pytest.approx(1.0, abs=1e-3)


def test_formats_follow_the_arguments():
    fmt = lambda c: (str(c.content), str(c.rope), c.sink, c.recent)  # noqa: E731
    assert fmt(BASELINES["kivi"](None, MethodArgs())[1]) == ("int4:t64", "int4:t64", 4, 128)
    assert fmt(BASELINES["kivi"](None, MethodArgs("int2", "int4:t32", 0, 32))[1]) == ("int2:t64", "int4:t32", 0, 32)
    assert fmt(BASELINES["kivi"](None, MethodArgs(rope="bf16"))[1]) == ("int4:t64", "bf16", 4, 128)
    assert fmt(BASELINES["fp4"](None, MethodArgs(sink=0, recent=0))[1]) == ("fp4", "fp4", 0, 0)
    model = _model("deepseek_v3")
    assert fmt(BASELINES["turboquant"](model, MethodArgs("lm4"))[1]) == ("lm4", "bf16", 4, 128)
    assert fmt(BASELINES["quarot"](model, MethodArgs("int2", "int4"))[1]) == ("int2", "int4", 4, 128)
    assert fmt(BASELINES["smoothquant"](model, MethodArgs("int4", "bf16"))[1]) == ("int4", "bf16", 4, 128)


@pytest.mark.parametrize("name,args,match", [
    ("fp4", MethodArgs(content="int4"), "stores content as fp4"),
    ("fp4", MethodArgs(rope="bf16"), "stores rope as fp4"),
    ("turboquant", MethodArgs(content="int4"), "stores content as a Lloyd-Max codebook"),
    ("turboquant", MethodArgs(rope="int4"), "stores rope as bf16"),
    ("kivi", MethodArgs(content="int4:64"), "grouped along tokens, e.g. int4:t64"),
    ("kivi", MethodArgs(rope="fp8"), "grouped along tokens"),
])
def test_bad_arguments_raise(name, args, match):
    with pytest.raises(ValueError, match=match):
        BASELINES[name](_model("deepseek_v3"), args)


def test_quantmla_uses_a_calibrated_section_or_calibrates_first(capsys):
    model = tiny_model("deepseek_v3")
    new, cfg = quantmla(model, MethodArgs("int2", "int4"), FAST_CALIBRATION)
    assert "calibrating first" in capsys.readouterr().out
    assert new is not model and (cfg.content.kind, cfg.rope.kind) == ("int2", "int4")
    assert all((c.kind, r.kind) == ("int2", "int4") for c, r in cfg.per_layer)  # clipping ratios may differ
    model.config.quantmla = {"method": "quantmla", **CacheConfig("int4:32", "int4:16", 4, 64).to_dict()}
    same, cfg = quantmla(model, MethodArgs(recent=16))
    assert same is model and "calibrating" not in capsys.readouterr().out
    assert (str(cfg.content), str(cfg.rope), cfg.sink, cfg.recent) == ("int4:32", "int4:16", 4, 16)
    assert quantmla(model, MethodArgs("int4", "int4"))[1].content == cfg.content  # int4 fits to int4:32 here
    with pytest.raises(ValueError, match="calibrated for content int4:32; --content int2 needs a calibration"):
        quantmla(model, MethodArgs(content="int2"))


def test_quantmla_budget_chooses_per_layer_formats_within_the_budget(capsys):
    from quantmla.calibrate.budget import choose_formats
    from quantmla.eval.suite import LONG_CONTEXT, measure_bytes_per_token

    model = tiny_model("deepseek_v3")
    layers = describe(model)
    dc, dr = layers[0].kv_lora_rank, layers[0].rope_dim
    int4 = measure_bytes_per_token(CacheConfig("int4", "int4", 4, 128).fit(dc, dr), dc, dr, LONG_CONTEXT)
    budget = 0.25  # below int4/int4 here (33.4 %): formats that ignored the budget would not fit
    assert int4 / (2 * (dc + dr)) > budget
    new, cfg = quantmla(model, MethodArgs(budget=budget), FAST_CALIBRATION)
    assert new is not model and "budget 25.0 % of BF16 at 131072 tokens: chose" in capsys.readouterr().out
    fraction = measure_bytes_per_token(cfg, dc, dr, LONG_CONTEXT) / (2 * (dc + dr))
    assert budget - 0.05 < fraction <= budget  # measured from the cache, and (nearly) spent
    # per layer, the formats `quantmla calibrate --budget` chooses on the same calibration windows (the search
    # after it only picks clipping ratios, which keep bits and groups)
    ids = calibration_ids(model, FAST_CALIBRATION.samples, FAST_CALIBRATION.length)
    alloc = choose_formats(model, layers, ids, CacheConfig("int4", "int4", 4, 128), budget)
    shape = lambda pairs: [tuple((f.kind, f.group, f.axis) for f in pair) for pair in pairs]  # noqa: E731
    assert cfg.layers is not None and shape(cfg.per_layer) == shape(alloc.config.per_layer)


@pytest.mark.parametrize("args,match", [
    (dict(budget=0.0), "fraction of the BF16 cache in \\(0, 1\\], got 0.0"),
    (dict(budget=1.5), "got 1.5"),
    (dict(budget=-0.2), "got -0.2"),
    (dict(budget=float("nan")), "got nan"),
    (dict(budget=0.3, content="int4"), "chooses the formats per layer; it cannot be given with content/rope"),
    (dict(budget=0.3, rope="int8"), "cannot be given with content/rope formats \\(None/int8\\)"),
])
def test_bad_budgets_raise(args, match):
    with pytest.raises(ValueError, match=match):
        MethodArgs(**args)


def test_budget_needs_an_uncalibrated_model_and_a_budgeted_method():
    from quantmla.eval.methods import apply_method

    model = tiny_model("deepseek_v3")
    model.config.quantmla = {"method": "quantmla", **CacheConfig("int4:32", "int4:16", 4, 64).to_dict()}
    with pytest.raises(ValueError, match="already calibrated .* a byte budget needs the original checkpoint"):
        quantmla(model, MethodArgs(budget=0.3))
    with pytest.raises(ValueError, match=r"method 'rtn' takes no byte budget; the methods that do: quantmla, quantmla-t"):
        apply_method("rtn", model, MethodArgs(budget=0.3))


def test_a_budget_checkpoint_refuses_formats():
    """A budget checkpoint's section names base formats that chose nothing (its layers hold what the budget
    chose): --rope int4 matched that base and ran the checkpoint's int2 RoPE, labelled as asked."""
    model = tiny_model("deepseek_v3")
    model.config.quantmla = {"method": "quantmla", **CacheConfig("int4:32", "int4:16", 4, 64,
                                                                 layers=(("int4", "int2"),) * 3).to_dict(),
                             "calibration": {"budget": {"fraction": 0.3, "context": 131072}}}
    for args in (MethodArgs(rope="int4"), MethodArgs(content="int4:32")):
        with pytest.raises(ValueError, match=r"chosen per layer for a byte budget \(0.3 of BF16's\)"):
            quantmla(model, args)
    assert [str(r) for _, r in quantmla(model, MethodArgs())[1].per_layer] == ["int2"] * 3


def test_registered_as_eval_methods():
    from quantmla.eval.methods import METHODS, apply_method

    assert all(METHODS[name] is fn for name, fn in BASELINES.items())
    model, cfg = apply_method("fp4", _model("minicpm3"))  # fitted: rope is 8 wide there
    assert (str(cfg.content), str(cfg.rope)) == ("fp4", "fp4:8")


def test_paged_cache_refuses_what_its_kernel_cannot_serve():
    from quantmla.cache.paged import PagedMLACache

    with pytest.raises(ValueError, match="online rotation"):
        PagedMLACache.allocate(CacheConfig("int4", "int4", rope_rotation="hadamard"), 64, 64, num_blocks=2, max_seqs=1)
    with pytest.raises(ValueError, match="stores bf16, fp8, int8, int4, int2, not fp4"):
        PagedMLACache.allocate(CacheConfig("fp4", "fp4"), 64, 64, num_blocks=2, max_seqs=1)
