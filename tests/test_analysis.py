"""The amplification experiment and the `info` / `analyze` commands on tiny checkpoints."""

import json
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from quantmla.analysis.amplification import PerturbedCache, add_noise, layer_amplification, nmse, policy_output
from quantmla.capture import capture
from quantmla.cli import main
from quantmla.config import CacheConfig
from quantmla.mla import attention_from_cache
from quantmla.models import attention_module, describe
from quantmla.models.adapters import cache_kwargs
from quantmla.policy import quantized_keys
from quantmla.models.tiny import save_tiny_model, tiny_model


def test_noise_has_exactly_the_requested_nmse():
    x = torch.randn(3, 50, 32)
    y = add_noise(x, 0.01, torch.Generator().manual_seed(1))
    assert nmse(y, x) == pytest.approx(0.01, rel=1e-6)


def test_perturbed_cache_perturbs_only_the_chosen_path_and_layer():
    model = tiny_model("deepseek_v3")
    layers = describe(model)
    ids = torch.randint(0, 128, (1, 16))
    clean = model(ids).logits
    captured = capture(model, layers, ids)
    for path in ("content", "rope"):
        cache = PerturbedCache(model.config, path, 0.05, {1})
        logits = model(ids, use_cache=True, **cache_kwargs(model, cache)).logits
        assert nmse(logits, clean) > 0
        # the stored history is what an unperturbed forward caches
        assert torch.equal(cache.layers[1].keys[:, 0], captured[1].c)
        assert torch.equal(cache.layers[1].values[:, 0], captured[1].k_pe)
    cache = PerturbedCache(model.config, "rope", 0.05, set())
    assert torch.equal(model(ids, use_cache=True, **cache_kwargs(model, cache)).logits, clean)


def test_perturbed_cache_follows_the_serving_policy():
    """Noise only on tokens past the sink that have left the recent window, drawn once and kept."""
    model = tiny_model("deepseek_v3")
    ids = torch.randint(0, 128, (1, 24))
    cache = PerturbedCache(model.config, "content", 0.05, {0, 1}, sink=2, recent=6)
    kw = cache_kwargs(model, cache)
    first = model(ids[:, :12], use_cache=True, **kw).logits
    c = cache.layers[0].keys
    held, _ = cache.update(c[:, :, :0], cache.layers[0].values[:, :, :0], 0)  # what layer 0 hands the model now
    changed = (held != c).any(-1)[0, 0]
    assert changed.tolist() == [False] * 2 + [True] * 4 + [False] * 6  # [sink, 12 - recent)
    noisy = held[:, :, 2:6].clone()
    model(ids[:, 12:], use_cache=True, **kw)
    held, _ = cache.update(cache.layers[0].keys[:, :, :0], cache.layers[0].values[:, :, :0], 0)
    assert torch.equal(held[:, :, 2:6], noisy)  # noise drawn once, when the tokens left the window
    assert (held[:, :, 6:18] != cache.layers[0].keys[:, :, 6:18]).any(-1).all()
    # within one call, as in QuantMLACache, the tokens that leave the window leave for every query of it
    torch.testing.assert_close(first[:, :2], model(ids[:, :2]).logits)  # queries that see only the sink
    assert nmse(first[:, 2:], model(ids[:, :12]).logits[:, 2:]) > 0


def test_amplification_scales_with_noise():
    model = tiny_model("deepseek_v2")
    layers = describe(model)
    ids = torch.randint(0, 128, (2, 32))
    policy = CacheConfig(sink=2, recent=8)
    small = layer_amplification(model, layers, ids, 0.001, progress=False, policy=policy)
    big = layer_amplification(model, layers, ids, 0.01, progress=False, policy=policy)
    for s, b in zip(small, big):
        # attention output error is close to linear in the injected NMSE for small noise
        assert b.content_out_nmse / s.content_out_nmse == pytest.approx(10, rel=0.3)
        assert b.rope_out_nmse > s.rope_out_nmse > 0
    with pytest.raises(ValueError, match="too short for sink 4 \\+ recent 128"):
        layer_amplification(model, layers, ids, 0.01, progress=False)


def test_layer_amplification_is_what_a_noisy_cache_does_to_the_attention():
    """The per-layer number from the policy-masked absorbed attention equals the one from transformers' own
    attention fed token by token through a PerturbedCache (same noise), for the last query."""
    model = tiny_model("deepseek_v3")
    layers = describe(model)
    ids = torch.randint(0, 128, (1, 20))
    policy = CacheConfig(sink=2, recent=5)
    captured = capture(model, layers, ids)[1]
    attn = attention_module(model, layers[1])
    clean, _ = attention_from_cache(attn, layers[1], captured.hidden, captured.position_embeddings, captured.c,
                                    captured.k_pe)
    # the noisy cache as the last query sees it: tokens [2, 15) perturbed
    noisy = captured.c.clone()
    noisy[:, 2:15] = add_noise(captured.c[:, 2:15], 0.02, torch.Generator().manual_seed(3))
    quantized = quantized_keys(torch.arange(20), 20, policy, policy.content).float()
    out, _ = policy_output(attn, layers[1], captured, quantized, noisy - captured.c)
    full, _ = attention_from_cache(attn, layers[1], captured.hidden, captured.position_embeddings, noisy,
                                   captured.k_pe)
    torch.testing.assert_close(out[:, -1], full[:, -1], atol=1e-5, rtol=1e-5)  # the last query sees all of it
    torch.testing.assert_close(out[:, :7], clean[:, :7], atol=1e-6, rtol=1e-6)  # queries 0..6 see none
    assert (out[:, 7:-1] - full[:, 7:-1]).abs().amax() > 1e-4  # the others see part of it


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


def test_info_shows_a_calibrated_checkpoints_own_formats(tiny_dir, tmp_path):
    """Without --content/--rope, info reports the formats the checkpoint's quantmla section serves, per layer."""
    import shutil

    ckpt = tmp_path / "cal"
    shutil.copytree(tiny_dir, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantmla"] = {"method": "quantmla", "content": "int4", "rope": "int4", "layers": [["int2", "int4"],
                                                                                          ["int8", "bf16"]]}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "info.json"
    assert main(["info", str(ckpt), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(r["content"], r["rope"]) for r in data["layers"]] == [("int2:32", "int4:8"), ("int8:32", "bf16")]
    assert data["bytes_per_token"] == (8 + 4) + (4 + 4) + (32 + 4) + 16
    assert main(["info", str(ckpt), "--content", "int4", "--json", str(out)]) == 0  # asked for: as asked
    layers = json.loads(out.read_text())["layers"]
    assert {r["content"] for r in layers} == {"int4:32"}
    # the path not asked for keeps the checkpoint's own formats, as --rope's help says (it fell back to int4)
    assert [r["rope"] for r in layers] == ["int4:8", "bf16"]


def test_info_per_layer_formats_are_readable_at_80_columns(tiny_dir, tmp_path, monkeypatch):
    """A budget-calibrated checkpoint's formats differ by layer: they get a table of layers (the summary's cells
    listed them joined, cut short at 80 columns: 'int8r64,in…', without saying which layer holds which)."""
    import shutil

    from rich.console import Console

    import quantmla.cli

    ckpt = tmp_path / "cal"
    shutil.copytree(tiny_dir, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantmla"] = {"method": "quantmla", "content": "int4", "rope": "int4",
                       "layers": [["int8:16r16c0.95", "int8:4c0.95"], ["int4:16c0.95", "bf16"]]}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    monkeypatch.setattr(quantmla.cli, "console", console)
    assert main(["info", str(ckpt)]) == 0
    text = console.export_text()
    assert "\u2026" not in text and max(map(len, text.splitlines())) <= 80, text
    rows = [line.split() for line in text.splitlines()]
    assert ["0", "int8:16r16c0.95", "int8:4c0.95"] in [r[:3] for r in rows], text
    assert ["1", "int4:16c0.95", "bf16"] in [r[:3] for r in rows], text


def test_output_files_are_written_where_they_were_checked(tiny_dir, tmp_path, monkeypatch):
    """--json=~/x.json (no shell expands a tilde after '='): the check expanded it, but the file went to a literal
    ./~/x.json under the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    assert main(["info", str(tiny_dir), "--json=~/info.json"]) == 0
    assert json.loads((tmp_path / "home" / "info.json").read_text())["layers"]
    assert not (tmp_path / "cwd" / "~").exists()


def test_bad_config_json_and_output_paths_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("[1, 2]")
    assert main(["info", str(tmp_path / "m")]) == 2
    assert "holds a JSON list, not an object" in capsys.readouterr().err
    # output paths are checked before the model loads (they failed only after the run)
    (tmp_path / "file").write_text("mine")
    assert main(["analyze", str(tmp_path / "m"), "--plot", str(tmp_path)]) == 2
    assert "--plot" in (err := capsys.readouterr().err) and "is a directory" in err
    assert main(["info", str(tmp_path / "m"), "--json", str(tmp_path / "file" / "i.json")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


def _rendered_at_80(table) -> list[str]:
    from rich.console import Console

    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    console.print(table)
    return console.export_text().splitlines()


@pytest.mark.parametrize("family", ["deepseek_v3", "longcat_flash"])
def test_info_table_is_readable_at_80_columns(family):
    """Layers that agree collapse into one row; nothing is cut short (rich marks a cut cell with an ellipsis)."""
    from quantmla.cli import layers_table
    from quantmla.models import describe
    from quantmla.models.tiny import tiny_model

    layers = describe(tiny_model(family))
    lines = _rendered_at_80(layers_table("tiny", layers))
    assert all(len(line) <= 80 and "\u2026" not in line for line in lines), "\n".join(lines)
    text = "\n".join(lines)
    assert f"0-{len(layers) - 1}" in text and str(layers[0].kv_lora_rank) in text and layers[0].rope_style in text


def test_info_bytes_table_is_one_row_per_run_of_layers_at_80_columns():
    """A calibrated checkpoint's per-layer formats: one row per run of layers that share them, and the total; the
    formats were joined into one cell, which rich cut short at 80 columns."""
    from quantmla.cli import bytes_table

    formats = [("int8:16r128c0.95", "int4:16c0.9")] * 2 + [("int4:64", "int4:16c0.95")] * 3 + [("int2:64", "int4")]
    nbytes = {"int8:16r128c0.95": 200, "int4:64": 300, "int2:64": 150}
    rows = [{"content": c, "rope": r, "bytes_bf16": 1152, "bytes_quantized": nbytes[c]} for c, r in formats]
    lines = _rendered_at_80(bytes_table(rows, "the checkpoint's own (its quantmla section)"))
    assert all(len(line) <= 80 and "\u2026" not in line for line in lines), "\n".join(lines)
    body = [line.split() for line in lines if line.split() and line.split()[0] in ("all", "0-1", "2-4", "5", "total")]
    assert [r[0] for r in body] == ["all", "0-1", "2-4", "5", "total"], "\n".join(lines)
    assert body[1][1:] == ["int8:16r128c0.95", "int4:16c0.9", "200", "400", "17.4"]
    assert body[-1][-2:] == [str(2 * 200 + 3 * 300 + 150), f"{100 * 1450 / (6 * 1152):.1f}"]


def test_eval_table_is_readable_at_80_columns():
    from quantmla.cli import result_table
    from quantmla.eval.suite import EvalResult

    long_formats = "|".join(["int8:16r128c0.95"] * 4)
    r = EvalResult("quantmla b=0.2823", long_formats, long_formats, 4, 128, 318.8123, 312.0, 1152, 2048, 310.5,
                   ppl=1.9023, ppl_bf16=1.9021, kl=9.538e-06)
    lines = _rendered_at_80(result_table("model", r))
    assert all(len(line) <= 80 and "\u2026" not in line for line in lines), "\n".join(lines)
    text = "\n".join(lines)
    assert "9.538e-06" in text and "1.9023 / 1.9021" in text and "318.8" in text


def test_analyze_command(tiny_dir, tmp_path, capsys):
    out, png = tmp_path / "a.json", tmp_path / "a.png"
    assert main(["analyze", str(tiny_dir), "--length", "192", "--samples", "2", "--json", str(out),
                 "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert len(data["layers"]) == 2 and (data["sink"], data["recent"]) == (4, 128)
    for row in data["layers"]:
        assert {"layer", "content_out_nmse", "rope_out_nmse", "ratio"} <= row.keys()
        assert row["ratio"] == pytest.approx(row["rope_out_nmse"] / row["content_out_nmse"])
    assert data["mean_ratio"] == pytest.approx(sum(r["ratio"] for r in data["layers"]) / 2)
    assert set(data["end_to_end"]) == {"content", "rope"}
    assert png.stat().st_size > 1000
    # a name without an extension is written under that name, as a PNG (it went to noext.png, reported as noext)
    assert main(["analyze", str(tiny_dir), "--length", "32", "--samples", "2", "--sink", "2", "--recent", "8",
                 "--plot", str(tmp_path / "noext")]) == 0
    assert (tmp_path / "noext").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "noext.png").exists()
    # a format matplotlib cannot write is refused before the run (it was refused after it)
    assert main(["analyze", str(tmp_path / "no-model"), "--plot", str(tmp_path / "p.xyz")]) == 2
    assert "cannot write .xyz files" in capsys.readouterr().err
    # a smaller window, as the too-short error suggests, lets short sequences run
    assert main(["analyze", str(tiny_dir), "--length", "32", "--samples", "2", "--sink", "2", "--recent", "8",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert (data["sink"], data["recent"]) == (2, 8)


def test_commands_reject_bad_input(tiny_dir, tmp_path, capsys):
    assert main(["info", str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["info", str(tiny_dir), "--content", "int3"]) == 2
    assert "unknown cache format 'int3'" in capsys.readouterr().err
    assert main(["analyze", str(tiny_dir), "--data", str(tmp_path / "none.txt")]) == 2
    assert "text file not found" in capsys.readouterr().err
    assert main(["analyze", str(tiny_dir), "--length", "100"]) == 2
    assert "with sink 4 + recent 128 BF16 tokens none sees a noised key; use --length 134" in capsys.readouterr().err
    assert main(["analyze", str(tiny_dir), "--length", "600"]) == 2  # the tiny model has 512 positions
    assert "exceeds the model's max_position_embeddings 512" in capsys.readouterr().err
    assert main(["analyze", str(tiny_dir), "--nmse", "2"]) == 2
    with pytest.raises(SystemExit):  # by argparse, before the model loads
        main(["analyze", str(tiny_dir), "--sink", "-1"])
    assert "argument --sink: must be >= 0, got -1" in capsys.readouterr().err
    # one token predicts no next one: the end-to-end KL and perplexity came out nan
    assert main(["analyze", str(tiny_dir), "--length", "1", "--sink", "0", "--recent", "0"]) == 2
    assert "--length 1: the end-to-end KL and perplexity score next-token predictions" in capsys.readouterr().err
    # one token past the window: only the last query sees a noised key, and it predicts no token (KL was 0)
    assert main(["analyze", str(tiny_dir), "--length", "133"]) == 2
    assert "use --length 134 or more" in capsys.readouterr().err
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    llama.save_pretrained(tmp_path / "llama")
    assert main(["info", str(tmp_path / "llama")]) == 2
    err = capsys.readouterr().err
    assert "model_type 'llama'" in err and "not a supported MLA family; supported: axk1, deepseek_v2" in err


def test_calibrate_rejects_a_bad_budget_before_loading_the_model(tiny_dir, tmp_path, capsys, monkeypatch):
    import quantmla.models

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the budget was checked")

    monkeypatch.setattr(quantmla.models, "load_model", no_load)
    assert main(["calibrate", str(tiny_dir), "--budget", "1.3", "--out", str(tmp_path / "c")]) == 2
    assert "a byte budget is a fraction of the BF16 cache in (0, 1], got 1.3" in capsys.readouterr().err


def test_ctrl_c_is_a_short_message_and_exit_130(tiny_dir, monkeypatch, capsys):
    import quantmla.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_info", interrupted)
    assert main(["info", str(tiny_dir)]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_calibration_table_keeps_long_formats_whole_at_80_columns():
    """calibrate's table cut a budget's formats at 80 columns ('int8:16r12…', and the SmoothQuant header)."""
    from types import SimpleNamespace

    from quantmla.cli import calibration_table

    reports = [SimpleNamespace(layer=i, content_identity=3.6e-4, content_smoothquant=1.58e-4, content_best=2.17e-7,
                               content_format="int8:16r128c0.95", rope_identity=3.06e-5, rope_smoothquant=8.84e-6,
                               rope_best=3.98e-6, rope_format="int4:t64c0.95") for i in (12, 13)]
    lines = _rendered_at_80(calibration_table(reports))
    assert all(len(line) <= 80 and "\u2026" not in line for line in lines), "\n".join(lines)
    text = "\n".join(lines)
    assert "int8:16r128c0.95" in text and "SmoothQuant" in text and "1.66e+03x" in text


@pytest.mark.parametrize("family", ["axk1", "mistral4"])
def test_every_command_runs_on_a_checkpoint_of_the_newest_families(family, tmp_path, capsys):
    """An A.X K1 or (text-only) Mistral 4 checkpoint, read from its directory with transformers' own classes:
    info, analyze, calibrate, eval of the calibrated checkpoint, and the engine serving it."""
    from quantmla.engine import LLM, SamplingParams

    src = save_tiny_model(family, tmp_path / "src")
    assert main(["info", str(src), "--json", str(tmp_path / "info.json")]) == 0
    layers = json.loads((tmp_path / "info.json").read_text())["layers"]
    assert [row["rope_style"] for row in layers] == ["interleave"] * 2
    factor = "queries x (1 + 0.5 ln(1 + floor(position / 32)))"  # the tiny mistral4's, in info's caption
    assert (factor in " ".join(capsys.readouterr().out.split())) == (family == "mistral4")
    assert main(["analyze", str(src), "--length", "64", "--samples", "2", "--sink", "2", "--recent", "8"]) == 0
    out = tmp_path / "cal"
    assert main(["calibrate", str(src), "--samples", "4", "--length", "80", "--recent", "16", "--steps", "1",
                 "--out", str(out)]) == 0
    assert main(["eval", str(out), "--lengths", "96", "--samples", "1", "--json", str(tmp_path / "eval.json")]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["method"] == "quantmla" and 0 < result["kl"] < 1e-3
    llm = LLM(str(out), max_num_seqs=2, kv_cache_bytes=1 << 20)
    outs = llm.generate([list(range(3, 60)), [5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [8, 8]
