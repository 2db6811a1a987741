"""Calibration: the objectives model the serving policy, fall on sequences the fit never saw, beat the
identity on untouched report sequences, and the fused checkpoint round-trips exactly."""

import json
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantmla.calibrate.content import calibrate_content, content_objective
from quantmla.calibrate.driver import calibrate_model
from quantmla.calibrate.export import cache_config_of, quantmla_section
from quantmla.calibrate.rope import calibrate_rope, rope_objective
from quantmla.calibrate.search import Splits
from quantmla.cache import QuantMLACache
from quantmla.cli import main
from quantmla.config import CacheConfig, QuantFormat
from quantmla.mla import absorb_queries, project_cache, project_queries, split_kv_b
from quantmla.models import attention_module, describe
from quantmla.models.tiny import save_tiny_model, tiny_model
from quantmla.quant.formats import fake_quantize, fake_quantize_ste
from quantmla.capture import capture
from quantmla.policy import query_positions, quantized_keys
from quantmla.transforms import ContentTransform, RopeTransform


POLICY = CacheConfig("int2:32", "int4:16", sink=4, recent=16)  # queries at 36..95 see up to 76 quantized keys


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _layer_data(plant) -> dict:
    """Layer 1 of a seeded tiny deepseek_v3 after plant(attn, layer) edits its weights, and what calibration
    reads from 8 x 96 random tokens."""
    torch.manual_seed(0)
    model = tiny_model("deepseek_v3")
    layer = describe(model)[1]
    attn = attention_module(model, layer)
    with torch.no_grad():
        plant(attn, layer)
    ids = torch.randint(0, 128, (8, 96))
    k = capture(model, [layer], ids)[layer.cache_idx]
    with torch.no_grad():
        q_nope, q_pe = project_queries(attn, layer, k.hidden, k.position_embeddings)
        c, k_pe = project_cache(attn, layer, k.hidden, k.position_embeddings)
    pos = query_positions(96, POLICY, 16)
    w_uk, w_uv = split_kv_b(attn, layer)
    q_abs = absorb_queries(q_nope[:, :, pos], w_uk).detach()
    return dict(layer=layer, attn=attn, k=k, c=c, k_pe=k_pe, q_abs=q_abs, q_pe=q_pe[:, :, pos].detach(),
                w_uv=w_uv.detach(), gamma=attn.kv_a_layernorm.weight.detach(), pos=pos)


def _outliers(attn, layer):
    # Real MLA caches have outlier channels and a few dominant RoPE pairs; random tiny weights have neither,
    # and without structure there is nothing for a transform to find. Plant some (the model stays an MLA model).
    w = attn.kv_a_proj_with_mqa.weight
    w[:4] *= 8
    dc = layer.kv_lora_rank
    for i, j in layer.weight_pairs[:2]:
        w[dc + i] *= 6
        w[dc + j] *= 6


@pytest.fixture(scope="module")
def layer_data():
    return _layer_data(_outliers)


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


@pytest.mark.parametrize("fmt", ["int4", "int2:32", "int4:t8"])
def test_quantized_keys_are_what_the_cache_holds_quantized(fmt):
    """Decode token by token through QuantMLACache: the keys each step returns altered are exactly the
    policy's quantized region for that query (token-axis formats: whole blocks after the sink)."""
    cfg = CacheConfig(fmt, "bf16", sink=3, recent=5).fit(32, 8)
    x = torch.randn(1, 1, 38, 32)
    cache = QuantMLACache(cfg)
    mask = quantized_keys(torch.arange(38), 38, cfg, cfg.content)
    for t in range(38):
        held, _ = cache.update(x[:, :, t:t + 1], torch.zeros(1, 1, 1, 8), 0)
        changed = (held[0, 0] != x[0, 0, :t + 1]).any(-1)
        assert torch.equal(changed, mask[t, :t + 1]), t
    assert mask[37].sum() == (30 if cfg.content.axis == "channel" else 24)  # 38 - 3 - 5, in blocks of 8


def test_splits_are_disjoint_and_cover_the_sequences():
    for n in range(3, 12):
        s = Splits.of(n)
        parts = [list(range(n))[sl] for sl in (s.fit, s.select, s.report)]
        assert sorted(sum(parts, [])) == list(range(n)) and all(parts) and len(parts[0]) >= n // 2
    with pytest.raises(ValueError, match="at least 3 calibration sequences"):
        Splits.of(2)




def _content_args(d):
    return (d["q_abs"], d["q_pe"], d["c"], d["k_pe"], d["w_uv"], d["gamma"], d["layer"].softmax_scale, d["pos"])


def _report(args, sl):
    """The args restricted to the sequences sl (dim 0 of the per-sequence tensors)."""
    per_sequence = {0, 1, 2, 3}  # q_abs, q_pe, c, k_pe
    return tuple(a[sl] if i in per_sequence else a for i, a in enumerate(args))


def test_content_calibration_beats_identity_on_the_report_sequences(layer_data):
    d = layer_data
    args = _content_args(d)
    t, res = calibrate_content(*args, POLICY, steps=40)
    identity = ContentTransform.identity(d["c"].shape[-1], d["gamma"])
    report = _report(args, Splits.of(8).report)
    # The reported numbers are the report sequences' (recomputed here from the transform alone) ...
    assert res.report["calibrated"] == pytest.approx(content_objective(*report, POLICY, t), rel=1e-4)
    assert res.report["identity"] == pytest.approx(content_objective(*report, POLICY, identity), rel=1e-4)
    # ... which neither fit nor selected it: the calibrated transform wins there too.
    assert res.report["calibrated"] < 0.8 * res.report["identity"]
    assert torch.allclose(t.rotation.T @ t.rotation, torch.eye(t.rotation.shape[0], dtype=t.rotation.dtype),
                          atol=1e-5)


def test_surrogate_steps_lower_the_real_objective_on_held_out_sequences(layer_data):
    """Adam on the straight-through surrogate (fit sequences) lowers the real quantized objective on the
    selection sequences, which the surrogate never sees: the current iterate, not the best kept."""
    d = layer_data
    _, res = calibrate_content(*_content_args(d), POLICY, steps=40)
    start, after = res.start["hadamard"], res.history[-1][2]
    assert after < 0.95 * start
    pairs = d["layer"].cache_pairs
    _, res = calibrate_rope(d["q_pe"], d["k_pe"], d["pos"], pairs, POLICY, steps=40)
    assert res.history[-1][2] < res.start["equalised"]


def test_objectives_see_only_the_quantized_region(layer_data):
    """With a recent window covering every query's history but the oldest block, quantization error in the
    never-quantized tail cannot reach the objective: only the keys left of t + 1 - recent count."""
    d = layer_data
    args = _content_args(d)
    identity = ContentTransform.identity(d["c"].shape[-1], d["gamma"])
    pos = d["pos"][-2:]  # the two last queries; the wide window leaves them 1 and (1 + gap) quantized keys
    wide = CacheConfig("int2:32", "int4:16", sink=4, recent=int(pos[0]) - 4)
    narrow = CacheConfig("int2:32", "int4:16", sink=4, recent=16)
    sub = (d["q_abs"][:, :, -2:], d["q_pe"][:, :, -2:], *args[2:7], pos)
    assert 0 < content_objective(*sub, wide, identity) < 0.2 * content_objective(*sub, narrow, identity)


def test_rope_calibration_beats_identity_on_the_report_sequences(layer_data):
    d = layer_data
    pairs = d["layer"].cache_pairs
    t, res = calibrate_rope(d["q_pe"], d["k_pe"], d["pos"], pairs, POLICY, steps=40)
    sl = Splits.of(8).report
    identity = RopeTransform.identity(d["k_pe"].shape[-1])
    assert res.report["calibrated"] == pytest.approx(
        rope_objective(d["q_pe"][sl], d["k_pe"][sl], d["pos"], pairs, POLICY, t), rel=1e-4)
    assert res.report["identity"] == pytest.approx(
        rope_objective(d["q_pe"][sl], d["k_pe"][sl], d["pos"], pairs, POLICY, identity), rel=1e-4)
    assert res.report["calibrated"] < res.report["identity"]
    assert torch.exp(torch.log(t.scale).mean()) == pytest.approx(1.0, abs=1e-5)  # common scale pinned


def test_rope_points_judged_on_the_attention_output(layer_data):
    """With the attention's other inputs given, the RoPE search reports (and chooses on) the attention-output
    error: its identity point is the byte budget's measure for RTN on the RoPE path alone, an independent
    implementation; the fitted point beats it on the report sequences, which neither fit nor chose it."""
    from quantmla.calibrate.budget import rope_error
    from quantmla.calibrate.content import attention_heads

    d = layer_data
    pairs, scale = d["layer"].cache_pairs, d["layer"].softmax_scale
    heads = (d["q_abs"], d["c"], d["w_uv"], scale)
    t, res = calibrate_rope(d["q_pe"], d["k_pe"], d["pos"], pairs, POLICY, steps=40, heads=heads)
    sl = Splits.of(8).report
    args = (d["q_abs"][sl], d["q_pe"][sl], d["c"][sl].float(), d["k_pe"][sl].float(), d["w_uv"].float(), scale, d["pos"])
    ref = attention_heads(*args)
    assert res.report["identity"] == pytest.approx(float(rope_error(*args, POLICY, ref)), rel=1e-4)
    qk_identity = rope_objective(d["q_pe"][sl], d["k_pe"][sl], d["pos"], pairs, POLICY,
                                 RopeTransform.identity(d["k_pe"].shape[-1]))
    assert res.report["identity"] != pytest.approx(qk_identity, rel=1e-2)  # not the QK error
    assert res.report["calibrated"] < res.report["identity"]


@pytest.mark.parametrize("family", ["deepseek_v2", "longcat_flash"])
def test_calibrate_model_keeps_the_function(family):
    model = tiny_model(family)
    layers = describe(model)
    ids = torch.randint(0, 128, (4, 64))
    logits = model(ids).logits
    reports = calibrate_model(model, layers, ids, CacheConfig("int4", "int4", recent=16), steps=5, progress=False)
    assert len(reports) == len(layers)
    assert rel(model(ids).logits, logits) <= 1e-5
    for r in reports:
        assert all(v > 0 for v in (r.content_identity, r.content_best, r.rope_identity, r.rope_best))


def test_calibrate_command_round_trip(tmp_path):
    src = save_tiny_model("minicpm3", tmp_path / "src")
    out = tmp_path / "cal"
    assert main(["calibrate", str(src), "--content", "int2", "--rope", "int4", "--samples", "4", "--length", "64",
                 "--recent", "16", "--steps", "5", "--out", str(out)]) == 0
    section = quantmla_section(out)
    assert section["method"] == "quantmla" and section["content"] == "int2:32" and section["rope"] == "int4:8"
    report = json.loads((out / "calibration_report.json").read_text())
    chosen = tuple((QuantFormat.parse(r["content_format"]), QuantFormat.parse(r["rope_format"])) for r in report)
    # the section serves what the search chose per layer: the asked formats with a clipping ratio each
    assert cache_config_of(out).per_layer == chosen
    assert all(replace(c, clip=1.0) == QuantFormat.parse("int2:32") for c, _ in chosen)
    assert cache_config_of(out).at(1) == CacheConfig(*chosen[1], 4, 16)
    ids = torch.randint(0, 128, (2, 24))
    original = AutoModelForCausalLM.from_pretrained(src).eval()
    fused = AutoModelForCausalLM.from_pretrained(out).eval()  # plain transformers, no quantmla involved
    assert rel(fused(ids).logits, original(ids).logits) <= 1e-5
    # the selection may keep the identity in a layer and path, not everywhere
    assert any(not torch.equal(fused.model.layers[i].self_attn.kv_a_proj_with_mqa.weight,
                               original.model.layers[i].self_attn.kv_a_proj_with_mqa.weight) for i in (0, 1))
    assert len(report) == 2 and "history" in report[0]


@pytest.mark.parametrize("budget", [0.3, 0.6])
def test_calibrate_budget_command_meets_its_byte_budget(tmp_path, capsys, budget):
    """`calibrate --budget F --context N`: the checkpoint's cache, measured with the evaluation's own byte count
    at N tokens, holds at most F of BF16's bytes, and the fused weights still compute the original function."""
    from quantmla.eval.suite import measure_bytes_per_token

    src = save_tiny_model("minicpm3", tmp_path / "src")  # kv_lora_rank 32, rope 8
    out = tmp_path / "cal"
    assert main(["calibrate", str(src), "--budget", str(budget), "--context", "4096", "--samples", "4",
                 "--length", "64", "--recent", "16", "--steps", "2", "--out", str(out)]) == 0
    cfg = cache_config_of(out)
    held = measure_bytes_per_token(cfg, 32, 8, 4096) / (2 * (32 + 8))
    assert held <= budget, (held, cfg.per_layer)
    assert held > budget - 0.15, (held, cfg.per_layer)  # spends the budget rather than buying nothing
    ids = torch.randint(0, 128, (2, 24))
    original = AutoModelForCausalLM.from_pretrained(src).eval()
    fused = AutoModelForCausalLM.from_pretrained(out).eval()
    assert rel(fused(ids).logits, original(ids).logits) <= 1e-5
    assert "budget" in capsys.readouterr().out.lower()


def test_calibration_length_defaults_to_2048_or_the_models_positions(tmp_path):
    """Without --length, calibrate uses 2048-token sequences, cut to max_position_embeddings (the tiny
    model has 512), and says so in the section's calibration settings."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from quantmla.calibrate.driver import default_length
    from quantmla.data import resolve_model_dir

    assert default_length(tiny_model("deepseek_v3")) == 512
    shipped = SimpleNamespace(config=AutoConfig.from_pretrained(resolve_model_dir(None)))  # 32 K positions
    assert default_length(shipped) == 2048
    src = save_tiny_model("deepseek_v3", tmp_path / "src")
    out = tmp_path / "cal"
    assert main(["calibrate", str(src), "--samples", "3", "--recent", "16", "--steps", "1", "--out", str(out)]) == 0
    assert quantmla_section(out)["calibration"]["length"] == 512


def test_a_quantmla_section_quantmla_did_not_write_is_named(tmp_path, capsys):
    """An edited (or another tool's) quantmla section in config.json was a KeyError, TypeError or AttributeError
    traceback in info and eval, and an unknown format in it an error that named no file."""
    src = save_tiny_model("deepseek_v3", tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    for section, error, commands in (([1, 2], "is not one quantmla writes", ("info", "eval")),
                                     ({"sink": 4}, "is not one quantmla writes", ("info", "eval")),
                                     ({"content": "int3", "rope": "int4"}, "does not hold a cache configuration: "
                                      "unknown cache format 'int3'", ("info",))):
        (src / "config.json").write_text(json.dumps({**config, "quantmla": section}))
        for command in commands:
            assert main([command, str(src)]) == 2
            err = capsys.readouterr().err
            assert f"{src / 'config.json'}: its quantmla section {error}" in err, err


def test_a_bad_data_file_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """calibrate and analyze read --data only after loading the model (minutes for a large checkpoint), and eval
    found an empty file only then: a typo cost the load."""
    import quantmla.models

    src = save_tiny_model("deepseek_v3", tmp_path / "src")
    (tmp_path / "empty.txt").write_text("\n")

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(quantmla.models, "load_model", no_load)
    monkeypatch.setattr("quantmla.calibrate.streaming.skeleton", no_load)
    out = ["--out", str(tmp_path / "o")]
    for command in (["calibrate", *out], ["calibrate", "--streaming", *out], ["analyze"], ["eval"]):
        for data, error in (("missing.txt", "text file not found"), ("empty.txt", "text file is empty")):
            assert main([command[0], str(src), *command[1:], "--data", str(tmp_path / data)]) == 2
            assert error in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_calibrate_command_rejects_bad_arguments(tmp_path, capsys):
    src = save_tiny_model("deepseek_v3", tmp_path / "src")
    base = ["calibrate", str(src), "--out", str(tmp_path / "o"), "--samples", "2", "--length", "32"]
    assert main(base + ["--content", "int5"]) == 2
    assert "unknown cache format 'int5'" in capsys.readouterr().err
    assert main(base + ["--rope", "int4:6"]) == 2
    assert "group 6 does not divide" in capsys.readouterr().err
    assert main(base + ["--data", str(tmp_path / "missing.txt")]) == 2
    assert "text file not found" in capsys.readouterr().err
    assert main(base + ["--samples", "4"]) == 2  # 32 tokens, sink 4 + recent 128: nothing is ever quantized
    assert "too short for sink 4 + recent 128" in capsys.readouterr().err
    assert main(base + ["--samples", "4", "--recent", "8", "--content", "fp8"]) == 2
    assert "content fp8 has no calibration surrogate" in capsys.readouterr().err
    for streaming in ([], ["--streaming"]):  # the tiny model has 512 positions
        assert main(base + ["--samples", "4", "--length", "600", *streaming]) == 2
        assert "--length 600 exceeds the model's max_position_embeddings 512" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert main(base + ["--budget", "0.5", "--context", "100"]) == 2  # <= sink 4 + recent 128
    assert "--context 100 leaves no quantized tokens" in capsys.readouterr().err
    for option, value in (("--length", "0"), ("--samples", "-1"), ("--steps", "0"), ("--context", "0"),
                          ("--group", "0")):
        with pytest.raises(SystemExit) as e:  # argparse: usage and exit 2
            main(base + [option, value])
        assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["calibrate"], ["calibrate", "--streaming"], ["demo"]])
def test_commands_that_write_name_a_missing_checkpoint(tmp_path, capsys, command):
    """calibrate and demo read config.json first (for a quantization_config): a missing directory or
    config.json is named as such, as info/analyze/eval name it, not as a bare [Errno 2]."""
    (tmp_path / "weights_only").mkdir()
    for model, message in (("nowhere", "model directory not found"), ("weights_only", "has no config.json")):
        assert main([command[0], str(tmp_path / model), *command[1:], "--out", str(tmp_path / "o")]) == 2
        assert message in capsys.readouterr().err



def test_group_keeps_the_rank_and_clipping_ratio_it_is_given_with():
    """--group replaces only the group of a format that names none: `--content int8r64 --group 32` calibrated
    int8:32 (every channel stored, twice int8r64's bytes) and `int4c0.9` lost its clipping ratio, unsaid."""
    from types import SimpleNamespace

    from quantmla.cli import _formats

    content, rope = _formats(SimpleNamespace(content="int8r64", rope="int4c0.9", group=32))
    assert (content, rope) == (QuantFormat("int8", 32, rank=64), QuantFormat("int4", 32, clip=0.9))
    assert _formats(SimpleNamespace(content="int4:16", rope="bf16", group=32)) == [QuantFormat("int4", 16),
                                                                                QuantFormat("bf16")]
    # a rank that is a multiple of --group but not of the kind's default group (64)
    assert _formats(SimpleNamespace(content="int8r48", rope="fp8", group=16))[0] == QuantFormat("int8", 16, rank=48)

@pytest.mark.parametrize("bad, message", [
    (["--budget", "0.3", "--clips", "1,0.9,1.5"], "clipping ratio must be in (0, 1], got 1.5"),
    (["--content", "fp8"], "content fp8 has no calibration surrogate"),
    (["--clips", ","], "--clips takes comma-separated numbers, e.g. 1,0.9,0.8, got ','"),
    (["--clips", "1,x"], "--clips takes comma-separated numbers")])
def test_calibrate_refuses_bad_search_options_before_loading_the_model(tmp_path, capsys, monkeypatch, bad, message):
    """A clipping ratio out of range, or a format calibration cannot fit, was refused only at the first layer's
    search: after the model load and, with --budget, after every format of every layer had been scored."""
    import quantmla.models

    monkeypatch.setattr(quantmla.models, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    src = save_tiny_model("deepseek_v3", tmp_path / "src")
    assert main(["calibrate", str(src), "--out", str(tmp_path / "o"), *bad]) == 2
    assert message in capsys.readouterr().err

@pytest.mark.parametrize("streaming", [[], ["--streaming"]])
def test_calibrate_never_overwrites_what_it_was_not_asked_to(tmp_path, capsys, streaming):
    """--out is checked before any work: the model's own directory is refused (--streaming used to delete its
    weights first), so are an empty name, a file and a non-empty directory; --overwrite allows the last."""
    src = save_tiny_model("deepseek_v3", tmp_path / "src")
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    base = ["calibrate", str(src), "--samples", "3", "--length", "160", "--recent", "16", "--steps", "1", *streaming]
    assert main(base + ["--out", str(src)]) == 2
    assert "is the model's own directory" in capsys.readouterr().err
    assert main(base + ["--out", str(src) + "/../src/", "--overwrite"]) == 2  # the same directory, spelt otherwise
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before  # nothing touched
    assert main(base + ["--out", ""]) == 2 and "--out is empty" in capsys.readouterr().err
    (tmp_path / "file").write_text("mine")
    assert main(base + ["--out", str(tmp_path / "file")]) == 2 and "not a directory" in capsys.readouterr().err
    assert main(base + ["--out", str(tmp_path / "file" / "new")]) == 2  # was refused only after the calibration
    assert "file is a file, not a directory" in capsys.readouterr().err
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert main(base + ["--out", str(mine)]) == 2 and "is not empty (1 entries" in capsys.readouterr().err
    assert main(base + ["--out", str(mine), "--overwrite"]) == 0
    assert (mine / "notes.txt").read_text() == "keep me" and quantmla_section(mine) is not None


@pytest.mark.parametrize("streaming", [[], ["--streaming"]])
def test_calibrate_writes_where_it_checked(tmp_path, monkeypatch, streaming, one_thread):
    """--out=~/cal (no shell expands a tilde after '='): the checks ran on $HOME/cal, but the checkpoint was
    written to a literal ./~/cal under the working directory, and reported as written to ~/cal."""
    src = save_tiny_model("deepseek_v3", tmp_path / "src")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    assert main(["calibrate", str(src), "--samples", "3", "--length", "64", "--recent", "16", "--steps", "1",
                 "--out=~/cal", *streaming]) == 0
    assert quantmla_section(tmp_path / "home" / "cal") is not None
    assert not (tmp_path / "cwd" / "~").exists()


@pytest.mark.parametrize("streaming", [[], ["--streaming"]])
def test_calibrate_overwrite_leaves_nothing_of_the_old_checkpoint(tmp_path, streaming):
    """--overwrite over another (sharded) checkpoint: its index and tokenizer do not survive. In memory the old
    index stayed beside the new model.safetensors (a later --streaming read looked for its missing shards) and
    the old tokenizer.json was kept instead of the source's."""
    from quantmla.calibrate.streaming import ShardReader

    src = save_tiny_model("deepseek_v3", tmp_path / "src")
    (src / "special_tokens_map.json").write_text('{"new": true}')
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old")
    (out / "tokenizer.json").write_text('{"old": true}')
    (out / "special_tokens_map.json").write_text('{"old": true}')
    (out / "tiktoken.model").write_text("old")  # another family's tokenizer
    assert main(["calibrate", str(src), "--samples", "3", "--length", "160", "--recent", "16", "--steps", "1",
                 "--out", str(out), "--overwrite", *streaming]) == 0
    assert not (out / "tokenizer.json").exists()  # the source has none: the old one is not the model's
    assert not (out / "tiktoken.model").exists()
    assert (out / "special_tokens_map.json").read_text() == '{"new": true}'
    assert all((out / f).is_file() for f in set(ShardReader(out).weight_map.values()))
    assert not (out / "model-00001-of-00002.safetensors").exists() or streaming



@pytest.mark.parametrize("streaming", [[], ["--streaming"]])
def test_calibrated_checkpoint_keeps_the_chat_template(tmp_path, streaming):
    """transformers 5 saves a tokenizer's chat template as chat_template.jinja beside tokenizer_config.json;
    the calibrated checkpoint lost it, and `quantmla serve` on it then formatted chats as plain 'role: text'
    lines instead of the model's template."""
    from quantmla.data import default_model_dir, tokenizer_for

    src = tmp_path / "src"
    tiny_model("deepseek_v3", vocab_size=259).save_pretrained(src)  # the shipped byte-level tokenizer's vocabulary
    tok = tokenizer_for(default_model_dir())
    tok.chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    tok.save_pretrained(src)
    assert (src / "chat_template.jinja").is_file()
    out = tmp_path / "out"
    assert main(["calibrate", str(src), "--samples", "3", "--length", "160", "--recent", "16", "--steps", "1",
                 "--out", str(out), *streaming]) == 0
    assert tokenizer_for(out).chat_template == tok.chat_template

@pytest.mark.parametrize("streaming", [[], ["--streaming"]])
def test_calibrated_checkpoint_keeps_a_tokenizer_of_its_own_code_and_the_licence(tmp_path, streaming, one_thread):
    """Kimi K2's tokenizer is its own code (tokenization_kimi.py, named by tokenizer_config.json's auto_map)
    over tiktoken.model; quantmla reads the tokenizer.json saved beside them. The output kept
    tokenizer_config.json, auto_map included, but neither file, so loading its tokenizer with
    trust_remote_code (transformers, vLLM) failed; nor did the model's licence go with the weights."""
    from quantmla.data import default_model_dir, tokenizer_for

    src = tmp_path / "src"
    tiny_model("deepseek_v3", vocab_size=259).save_pretrained(src)  # the shipped byte-level tokenizer's vocabulary
    tokenizer_for(default_model_dir()).save_pretrained(src)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    files = {"tokenizer_config.json": json.dumps(config), "tokenization_kimi.py": "# the tokenizer's code\n",
             "tiktoken.model": "aGk= 0\n", "LICENSE-MODEL": "the model licence\n"}
    for name, text in files.items():
        (src / name).write_text(text)
    out = tmp_path / "out"
    assert main(["calibrate", str(src), "--samples", "3", "--length", "64", "--recent", "16", "--steps", "1",
                 "--out", str(out), *streaming]) == 0
    assert {name: (out / name).read_text() for name in files} == files


@pytest.mark.parametrize("streaming", [[], ["--streaming"]])
def test_calibrated_checkpoint_keeps_the_generation_config(tmp_path, streaming, one_thread):
    """The source's generation_config.json (sampling defaults, a chat model's end-of-turn token among its
    eos ids) is the output's. --streaming wrote one derived from config.json instead: eos_token_id 1 only,
    no sampling settings, so generation ran past the end of a turn."""
    src = save_tiny_model("deepseek_v3", tmp_path / "src")
    mine = {"bos_token_id": 0, "eos_token_id": [1, 5], "do_sample": True, "temperature": 0.6, "top_p": 0.95}
    (src / "generation_config.json").write_text(json.dumps(mine))
    out = tmp_path / "out"
    assert main(["calibrate", str(src), "--samples", "3", "--length", "64", "--recent", "16", "--steps", "1",
                 "--out", str(out), *streaming]) == 0
    written = json.loads((out / "generation_config.json").read_text())
    assert {k: written.get(k) for k in mine} == mine


@pytest.mark.parametrize("streaming", [[], ["--streaming"]])
def test_a_generation_config_transformers_only_warns_about_is_copied(tmp_path, streaming, one_thread):
    """Sampling settings beside do_sample false: transformers loads such a generation_config.json with a
    warning but refuses to save it, so the in-memory calibrate failed after the whole calibration, leaving
    a config.json without weights. The source's file is copied as it is."""
    src = save_tiny_model("deepseek_v3", tmp_path / "src")
    text = json.dumps({"eos_token_id": [1, 5], "do_sample": False, "temperature": 0.6, "top_p": 0.95})
    (src / "generation_config.json").write_text(text)
    out = tmp_path / "out"
    assert main(["calibrate", str(src), "--samples", "3", "--length", "64", "--recent", "16", "--steps", "1",
                 "--out", str(out), *streaming]) == 0
    assert (out / "generation_config.json").read_text() == text
    assert AutoModelForCausalLM.from_pretrained(out).generation_config.eos_token_id == [1, 5]


@pytest.mark.parametrize("streaming", [[], ["--streaming"]])
def test_calibrated_checkpoint_loads_with_trust_remote_code(tmp_path, streaming, one_thread):
    """DeepSeek-V3 as published names its own modeling code in config.json's auto_map, and its card loads it
    with trust_remote_code=True (as vLLM users pass --trust-remote-code). The calibrated config kept the
    auto_map without the code files, so that load failed (OSError: no configuration_deepseek.py); the
    output is folded and checked against transformers' own classes, and now names no code."""
    src = save_tiny_model("deepseek_v3", tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                          "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert main(["calibrate", str(src), "--samples", "3", "--length", "64", "--recent", "16", "--steps", "1",
                 "--out", str(out), *streaming]) == 0
    assert "auto_map" not in json.loads((out / "config.json").read_text())
    fused = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ids = torch.randint(0, 128, (2, 24))
    original = AutoModelForCausalLM.from_pretrained(src).eval()
    assert rel(fused(ids).logits, original(ids).logits) <= 1e-5


@pytest.mark.parametrize("streaming", [[], ["--streaming"]])
def test_output_dtype_defaults_to_the_stored_weights_where_config_names_none(tmp_path, streaming, one_thread):
    """--dtype auto writes the source's dtype: its config.json's, else (no dtype / torch_dtype there) that of
    its stored weights, as transformers' dtype="auto" reads it. A BF16 checkpoint without one was written
    in float32, twice its size."""
    from quantmla.calibrate.streaming import ShardReader

    src = tmp_path / "src"
    tiny_model("deepseek_v3", dtype=torch.bfloat16).save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert main(["calibrate", str(src), "--samples", "3", "--length", "64", "--recent", "16", "--steps", "1",
                 "--out", str(out), *streaming]) == 0
    reader = ShardReader(out)
    tensors = reader.read(reader.weight_map)  # but the router bias transformers keeps in float32
    assert {v.dtype for k, v in tensors.items() if not k.endswith("e_score_correction_bias")} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("streaming", [[], ["--streaming"]])
def test_router_bias_transformers_keeps_in_float32_is_written_in_float32(tmp_path, streaming, one_thread):
    """GLM-4.7-Flash and DeepSeek-V3 store their router's e_score_correction_bias in float32 beside BF16
    weights, and transformers computes with it in float32 (`_keep_in_fp32_modules_strict`). The BF16 output
    rounded it, and expert choices near a tie flipped: the calibrated model did not compute the original's
    function. It is written in float32, as transformers' own save_pretrained writes it."""
    from quantmla.calibrate.streaming import ShardReader

    src = tmp_path / "src"
    model = tiny_model("glm4_moe_lite", dtype=torch.bfloat16)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(1)) * 3)
    model.save_pretrained(src)
    out = tmp_path / "out"
    assert main(["calibrate", str(src), "--samples", "3", "--length", "64", "--recent", "16", "--steps", "1",
                 "--out", str(out), *streaming]) == 0
    before, after = (ShardReader(d).read(ShardReader(d).weight_map) for d in (src, out))
    bias = [k for k in before if k.endswith("e_score_correction_bias")]
    assert bias and all(before[k].dtype == torch.float32 and torch.equal(after[k], before[k]) for k in bias)
    assert after["model.embed_tokens.weight"].dtype == torch.bfloat16


# ---------------------------------------------------------------- the quantizer search (clipping, axis)
def test_rtn_and_smoothquant_are_points_of_the_search(layer_data):
    """The scored points include RTN (recomputed here from the identity transform) and SmoothQuant
    (recomputed from its scales, as the smoothquant baseline builds them), and the choice on the selection
    sequences is no worse than either at any clipping ratio tried."""
    from quantmla.calibrate.smooth import smooth_scales
    from quantmla.calibrate.space import SearchSpace

    d = layer_data
    args = _content_args(d)
    t, res = calibrate_content(*args, POLICY, steps=10, space=SearchSpace(clips=(0.9, 0.7)))
    select = _report(args, Splits.of(8).select)
    fit = Splits.of(8).fit
    rtn = content_objective(*select, POLICY, ContentTransform.identity(d["c"].shape[-1], d["gamma"]))
    assert res.points["identity@int2:32"] == pytest.approx(rtn, rel=1e-4)
    gamma = d["gamma"].double()
    m = smooth_scales(d["c"][fit].abs().amax((0, 1)), d["q_abs"][fit].abs().amax((0, 1, 2)))
    sq = ContentTransform(torch.diag(torch.where(gamma < 0, -1.0, 1.0)), (gamma.abs() * m).float())
    assert res.points["smoothquant@int2:32"] == pytest.approx(content_objective(*select, POLICY, sq), rel=1e-4)
    # identity, smoothquant, calibrated, axes x 3 formats (32 channels in one group of 32 leave no rank to drop)
    assert len(res.points) == 4 * 3 and res.best == min(res.points.values())
    assert res.best <= min(rtn, res.points["smoothquant@int2:32"])
    assert res.format.clip in (1.0, 0.9, 0.7) and res.format.group == 32


def test_clipping_lowers_the_int2_objective_on_report_sequences(layer_data):
    """At INT2 a group's extreme values waste most of the 4 levels: the search picks a clipping ratio, and
    the chosen point is better than the same transform unclipped on the report sequences (held out)."""
    from quantmla.calibrate.space import SearchSpace

    d = layer_data
    args = _content_args(d)
    t, res = calibrate_content(*args, POLICY, steps=20, space=SearchSpace())
    assert res.format.clip < 1
    report = _report(args, Splits.of(8).report)
    unclipped = content_objective(*report, POLICY, t)
    clipped = content_objective(*report, replace(POLICY, content=res.format), t)
    assert clipped == pytest.approx(res.report["calibrated"], rel=1e-4) and clipped < 0.9 * unclipped


def test_token_axis_points_are_opt_in_servable_and_at_no_more_bytes():
    from quantmla.calibrate.space import SearchSpace

    base = QuantFormat.parse("int4")
    assert SearchSpace(clips=(0.9,)).formats(base, 512) == [base, QuantFormat("int4", 64, clip=0.9)]  # default
    axis = SearchSpace(clips=(0.9,), token_axis=True)
    wide = axis.formats(base, 64)  # KIVI's blocks of 64 tokens
    token = [QuantFormat("int4", 64, "token"), QuantFormat("int4", 64, "token", 0.9)]
    assert wide == [base, QuantFormat("int4", 64, clip=0.9), *token] and all(SearchSpace.servable(f) for f in wide)
    assert not SearchSpace.servable(token[0], page=32)  # blocks must divide the engine's page
    # a group of 128 channels costs fewer bytes than blocks of 64 tokens: no token-axis point then
    assert all(f.axis == "channel" for f in axis.formats(QuantFormat("int4", 128), 512))
    assert axis.formats(QuantFormat("fp8"), 512) == [QuantFormat("fp8")]
    # calibration sequences too short for the first scored query to see a quantized block: no token points
    cfg = CacheConfig("int4", "int4", sink=4, recent=128)
    assert QuantFormat("int4", 64, "token") in axis.formats(base, 64, first_query=4 + 128 + 63, cfg=cfg)
    assert all(f.axis == "channel" for f in axis.formats(base, 64, first_query=4 + 128 + 62, cfg=cfg))


def test_rope_search_with_token_axis_scores_kivi(layer_data):
    """With token_axis, KIVI (identity at int4:t16 here, the block of the policy test) is a scored point."""
    from quantmla.calibrate.space import SearchSpace

    d = layer_data
    pairs = d["layer"].cache_pairs
    space = SearchSpace(clips=(), token_axis=True, kivi_tokens=16)
    t, res = calibrate_rope(d["q_pe"], d["k_pe"], d["pos"], pairs, POLICY, steps=10, space=space)
    sel = Splits.of(8).select
    kivi = rope_objective(d["q_pe"][sel], d["k_pe"][sel], d["pos"], pairs, replace(POLICY, rope="int4:t16"),
                          RopeTransform.identity(d["k_pe"].shape[-1]))
    assert res.points["identity@int4:t16"] == pytest.approx(kivi, rel=1e-4)
    assert res.best <= kivi


# ---------------------------------------------------------------- ranked content formats
def test_ranked_formats_are_the_widest_that_fit_the_bytes():
    from quantmla.calibrate.space import ranked_formats
    from quantmla.quant.formats import bytes_per_token

    parse = QuantFormat.parse
    assert ranked_formats(parse("int2"), 512) == [parse("int8r128"), parse("int4r256")]
    assert ranked_formats(parse("int4"), 512) == [parse("int8r256")]
    assert ranked_formats(parse("int8"), 512) == []
    for base in ("int2", "int4", "int2:32", "int4:128"):
        for f in ranked_formats(parse(base), 512):
            assert bytes_per_token(f, 512) <= bytes_per_token(parse(base), 512)
            assert bytes_per_token(replace(f, rank=f.rank + f.group), 512) > bytes_per_token(parse(base), 512)


def test_principal_axes_put_the_energy_in_the_leading_group():
    from quantmla.calibrate.content import principal_axes

    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(64, 64, generator=g))[0]
    x = torch.randn(500, 6, generator=g) @ basis[:6] * 3 + 1e-3 * torch.randn(500, 64, generator=g)
    r = principal_axes(x, 16, g)
    torch.testing.assert_close(r @ r.T, torch.eye(64), atol=1e-5, rtol=0)
    energy = (x @ r.T).pow(2).sum(0)
    assert energy[:16].sum() > 0.9999 * energy.sum()
    # within the leading group the Hadamard spreads the energy: no channel holds most of it
    assert energy[:16].max() < 0.2 * energy[:16].sum()


def _low_rank(rank: int):
    """A plant for _layer_data: the content latent confined to `rank` dimensions (kv_a_proj's content rows of
    rank `rank`; RMSNorm and gamma keep it in a rank-dim subspace)."""
    def plant(attn, layer):
        w = attn.kv_a_proj_with_mqa.weight
        dc = layer.kv_lora_rank
        w[:dc] = w[:dc, :rank] @ torch.randn(rank, w.shape[1]) * 0.5
    return plant


def test_a_ranked_format_wins_where_the_latent_is_low_rank_at_no_more_bytes():
    """A content latent of rank 4 in 32 channels: at int2:8's bytes (24 B) the search picks a ranked format
    (the principal axes, int8:8r16 or int4:8r24), and on the report sequences (held out) it beats the best
    point without ranks by far; where every channel carries signal (layer_data), no ranked format is chosen."""
    from quantmla.calibrate.space import SearchSpace
    from quantmla.quant.formats import bytes_per_token

    policy = replace(POLICY, content=QuantFormat.parse("int2:8"))
    args = _content_args(_layer_data(_low_rank(4)))
    _, ranked = calibrate_content(*args, policy, steps=10, space=SearchSpace(clips=()))
    _, channels = calibrate_content(*args, policy, steps=10, space=SearchSpace(clips=(), ranked=False))
    assert ranked.format.rank in (16, 24) and bytes_per_token(ranked.format, 32) <= 24
    assert channels.format.rank == 0
    assert ranked.report["calibrated"] < 0.1 * channels.report["calibrated"]


def test_no_ranked_format_where_every_channel_carries_signal(layer_data):
    from quantmla.calibrate.space import SearchSpace

    policy = replace(POLICY, content=QuantFormat.parse("int2:8"))
    _, res = calibrate_content(*_content_args(layer_data), policy, steps=10, space=SearchSpace(clips=()))
    assert res.format.rank == 0
    assert any(QuantFormat.parse(k.split("@")[1]).rank for k in res.points)  # ranked points were scored
