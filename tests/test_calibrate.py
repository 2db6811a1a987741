"""Calibration: the objectives go down, beat the identity, and the fused checkpoint round-trips exactly."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantmla.calibrate.content import calibrate_content, content_objective
from quantmla.calibrate.driver import calibrate_model
from quantmla.calibrate.export import cache_config_of, quantmla_section
from quantmla.calibrate.rope import calibrate_rope, rope_objective
from quantmla.cli import main
from quantmla.config import CacheConfig, QuantFormat
from quantmla.mla import absorb_queries, project_cache, project_queries, split_kv_b
from quantmla.models import attention_module, describe
from quantmla.models.tiny import save_tiny_model, tiny_model
from quantmla.quant.formats import fake_quantize, fake_quantize_ste
from quantmla.capture import capture
from quantmla.transforms import ContentTransform, RopeTransform


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def layer_data():
    torch.manual_seed(0)
    model = tiny_model("deepseek_v3")
    layer = describe(model)[1]
    attn = attention_module(model, layer)
    # Real MLA caches have outlier channels and a few dominant RoPE pairs; random tiny weights have neither,
    # and without structure there is nothing for a transform to find. Plant some (the model stays an MLA model).
    with torch.no_grad():
        w = attn.kv_a_proj_with_mqa.weight
        w[:4] *= 8
        dc = layer.kv_lora_rank
        for i, j in layer.weight_pairs[:2]:
            w[dc + i] *= 6
            w[dc + j] *= 6
    ids = torch.randint(0, 128, (6, 96))
    k = capture(model, [layer], ids)[layer.cache_idx]
    with torch.no_grad():
        q_nope, q_pe = project_queries(attn, layer, k.hidden, k.position_embeddings)
        c, k_pe = project_cache(attn, layer, k.hidden, k.position_embeddings)
    pos = torch.arange(32, 96, 4)
    w_uk, w_uv = split_kv_b(attn, layer)
    q_abs = absorb_queries(q_nope[:, :, pos], w_uk).detach()
    return dict(layer=layer, attn=attn, k=k, c=c, k_pe=k_pe, q_abs=q_abs, q_pe=q_pe[:, :, pos].detach(),
                w_uv=w_uv.detach(), gamma=attn.kv_a_layernorm.weight.detach(), pos=pos)


def test_project_cache_matches_what_the_model_caches(layer_data):
    d = layer_data
    assert rel(d["c"], d["k"].c) < 1e-6 and rel(d["k_pe"], d["k"].k_pe) < 1e-6


def test_straight_through_forward_is_the_real_quantizer():
    x = torch.randn(5, 64, requires_grad=True)
    for spec in ("int4", "int2", "int8:16", "fp8:32"):
        fmt = QuantFormat.parse(spec)
        y = fake_quantize_ste(x, fmt)
        assert torch.equal(y.detach(), fake_quantize(x.detach(), fmt))
        y.sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
        x.grad = None


def test_content_calibration_beats_identity_and_its_loss_decreases(layer_data):
    d = layer_data
    fmt = QuantFormat("int2", 32)
    args = (d["q_abs"], d["q_pe"], d["c"], d["k_pe"], d["w_uv"], d["gamma"], d["layer"].softmax_scale, d["pos"])
    t, res = calibrate_content(*args, fmt, steps=40)
    surrogate = [h[1] for h in res.history]
    assert surrogate[-1] < surrogate[0]
    assert res.best < res.start["identity"]
    # judged on all sequences with real quantization, the calibrated transform still wins
    identity = ContentTransform.identity(d["c"].shape[-1], d["gamma"])
    assert content_objective(*args, fmt, t) < content_objective(*args, fmt, identity)
    assert torch.allclose(t.rotation.T @ t.rotation, torch.eye(t.rotation.shape[0], dtype=t.rotation.dtype),
                          atol=1e-5)


def test_rope_calibration_lowers_positional_qk_error(layer_data):
    d = layer_data
    fmt = QuantFormat("int4", 16)
    pairs = d["layer"].cache_pairs
    t, res = calibrate_rope(d["q_pe"], d["k_pe"], d["pos"], pairs, fmt, steps=40)
    assert res.best < res.start["identity"]
    identity = RopeTransform.identity(d["k_pe"].shape[-1])
    assert rope_objective(d["q_pe"], d["k_pe"], d["pos"], pairs, fmt, t) < \
        rope_objective(d["q_pe"], d["k_pe"], d["pos"], pairs, fmt, identity)
    assert torch.exp(torch.log(t.scale).mean()) == pytest.approx(1.0, abs=1e-5)  # common scale pinned


@pytest.mark.parametrize("family", ["deepseek_v2", "longcat_flash"])
def test_calibrate_model_keeps_the_function(family):
    model = tiny_model(family)
    layers = describe(model)
    ids = torch.randint(0, 128, (4, 64))
    logits = model(ids).logits
    reports = calibrate_model(model, layers, ids, CacheConfig("int4", "int4"), steps=5, progress=False)
    assert len(reports) == len(layers)
    assert rel(model(ids).logits, logits) <= 1e-5
    for r in reports:
        assert r.content_best <= r.content_identity and r.rope_best <= r.rope_identity


def test_calibrate_command_round_trip(tmp_path):
    src = save_tiny_model("minicpm3", tmp_path / "src")
    out = tmp_path / "cal"
    assert main(["calibrate", str(src), "--content", "int2", "--rope", "int4", "--samples", "4", "--length", "64",
                 "--steps", "5", "--out", str(out)]) == 0
    section = quantmla_section(out)
    assert section["method"] == "quantmla" and section["content"] == "int2:32" and section["rope"] == "int4:8"
    assert cache_config_of(out) == CacheConfig("int2:32", "int4:8", 4, 128)
    ids = torch.randint(0, 128, (2, 24))
    original = AutoModelForCausalLM.from_pretrained(src).eval()
    fused = AutoModelForCausalLM.from_pretrained(out).eval()  # plain transformers, no quantmla involved
    assert rel(fused(ids).logits, original(ids).logits) <= 1e-5
    assert not torch.equal(fused.model.layers[0].self_attn.kv_b_proj.weight,
                           original.model.layers[0].self_attn.kv_b_proj.weight)
    report = json.loads((out / "calibration_report.json").read_text())
    assert len(report) == 2 and "history" in report[0]


def test_calibrate_command_rejects_bad_arguments(tmp_path, capsys):
    src = save_tiny_model("deepseek_v3", tmp_path / "src")
    base = ["calibrate", str(src), "--out", str(tmp_path / "o"), "--samples", "2", "--length", "32"]
    assert main(base + ["--content", "int5"]) == 2
    assert "unknown cache format 'int5'" in capsys.readouterr().err
    assert main(base + ["--rope", "int4:6"]) == 2
    assert "group 6 does not divide" in capsys.readouterr().err
    assert main(base + ["--data", str(tmp_path / "missing.txt")]) == 2
    assert "text file not found" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
