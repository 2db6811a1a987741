"""The amplification experiment and the `info` / `analyze` commands on tiny checkpoints."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from quantmla.analysis.amplification import PerturbedCache, add_noise, layer_amplification, nmse
from quantmla.cli import main
from quantmla.models import describe
from quantmla.models.adapters import cache_kwargs
from quantmla.models.tiny import save_tiny_model, tiny_model


def test_noise_has_exactly_the_requested_nmse():
    x = torch.randn(3, 50, 32)
    y = add_noise(x, 0.01, torch.Generator().manual_seed(1))
    assert nmse(y, x) == pytest.approx(0.01, rel=1e-6)


def test_perturbed_cache_perturbs_only_the_chosen_path_and_layer():
    model = tiny_model("deepseek_v3")
    ids = torch.randint(0, 128, (1, 16))
    clean = model(ids).logits
    for path in ("content", "rope"):
        cache = PerturbedCache(model.config, path, 0.05, {1})
        logits = model(ids, use_cache=True, **cache_kwargs(model, cache)).logits
        assert nmse(logits, clean) > 0
        assert nmse(cache.layers[1].keys, cache.layers[1].keys) == 0  # stored history stays clean
    cache = PerturbedCache(model.config, "rope", 0.05, set())
    assert torch.equal(model(ids, use_cache=True, **cache_kwargs(model, cache)).logits, clean)


def test_amplification_scales_with_noise():
    model = tiny_model("deepseek_v2")
    layers = describe(model)
    ids = torch.randint(0, 128, (2, 32))
    small = layer_amplification(model, layers, ids, 0.001, progress=False)
    big = layer_amplification(model, layers, ids, 0.01, progress=False)
    for s, b in zip(small, big):
        # attention output error is close to linear in the injected NMSE for small noise
        assert b.content_out_nmse / s.content_out_nmse == pytest.approx(10, rel=0.3)
        assert b.rope_out_nmse > s.rope_out_nmse > 0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model("minicpm3", tmp_path_factory.mktemp("m") / "minicpm3")


def test_info_command(tiny_dir, tmp_path):
    out = tmp_path / "info.json"
    assert main(["info", str(tiny_dir), "--content", "int2", "--rope", "int4", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["bytes_per_token_bf16"] == 2 * 2 * (32 + 8)  # two layers
    # int2 over 32 channels (one group) + int4 over 8 channels (one group): codes + fp16 scale and zero
    assert data["bytes_per_token"] == 2 * ((8 + 4) + (4 + 4))
    assert data["layers"][0]["rope_style"] == "half"


def test_analyze_command(tiny_dir, tmp_path):
    out, png = tmp_path / "a.json", tmp_path / "a.png"
    assert main(["analyze", str(tiny_dir), "--length", "64", "--samples", "2", "--json", str(out),
                 "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert len(data["layers"]) == 2
    for row in data["layers"]:
        assert {"layer", "content_out_nmse", "rope_out_nmse", "ratio"} <= row.keys()
        assert row["ratio"] == pytest.approx(row["rope_out_nmse"] / row["content_out_nmse"])
    assert data["mean_ratio"] == pytest.approx(sum(r["ratio"] for r in data["layers"]) / 2)
    assert set(data["end_to_end"]) == {"content", "rope"}
    assert png.stat().st_size > 1000


def test_commands_reject_bad_input(tiny_dir, tmp_path, capsys):
    assert main(["info", str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["info", str(tiny_dir), "--content", "int3"]) == 2
    assert "unknown cache format 'int3'" in capsys.readouterr().err
    assert main(["analyze", str(tiny_dir), "--data", str(tmp_path / "none.txt")]) == 2
    assert "text file not found" in capsys.readouterr().err
    assert main(["analyze", str(tiny_dir), "--nmse", "2"]) == 2
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    llama.save_pretrained(tmp_path / "llama")
    assert main(["info", str(tmp_path / "llama")]) == 2
    err = capsys.readouterr().err
    assert "model_type 'llama'" in err and "not a supported MLA family; supported: deepseek_v2" in err
