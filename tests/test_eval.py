"""The evaluation suite on tiny random models: metrics, quantized-history scoring, needle plumbing, CLI
(the serving forward itself: test_eval_serving.py)."""

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

from quantmla.cli import main
from quantmla.config import CacheConfig, QuantFormat
from quantmla.eval import retrieval
from quantmla.eval.methods import METHODS, MethodArgs, apply_method
from quantmla.eval.needles import TASKS
from quantmla.eval.perplexity import ppl_kl, score_window, window_stats
from quantmla.eval.suite import EvalSettings, evaluate, heldout_windows, measure_bytes_per_token, paired_changes
from quantmla.models.tiny import save_tiny_model, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model("deepseek_v3")


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, 128, (2, 96), generator=torch.Generator().manual_seed(1))


def test_bf16_scoring_equals_a_plain_forward(model, windows):
    scored = 40
    _, cfg = apply_method("bf16", model)
    lp = score_window(model, windows, scored, cfg)
    with torch.no_grad():
        plain = F.log_softmax(model(windows).logits.float(), -1)[:, -scored - 1:-1]
    torch.testing.assert_close(lp, plain, atol=1e-5, rtol=1e-5)
    stats = window_stats(model, windows, scored, cfg, batch=1)
    targets = windows[:, -scored:]
    expected = -plain.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double().mean(-1)  # per window
    torch.testing.assert_close(stats["nll"], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats["nll_ref"], expected, atol=1e-5, rtol=1e-5)
    assert ppl_kl(stats)["ppl"] == pytest.approx(math.exp(expected.mean().item()), rel=1e-5)
    assert stats["kl"].abs().max() < 1e-7  # a BF16 cache against a forward with no cache at all: measured


def test_suite_kl_is_the_mean_kl_of_the_scored_tokens(model):
    """The reductions the suite keeps give the KL and perplexity computed from full log-probabilities; a
    BF16 cache measures ~0 against the plain forward, a destructive one does not."""
    settings = EvalSettings(tasks=("ppl", "kl"), lengths=(96,), samples=2, scored=32, batch=2, progress=False)
    bf16 = evaluate(model, None, "bf16", settings=settings)
    assert abs(bf16.kl) < 1e-7 and bf16.ppl == pytest.approx(bf16.ppl_bf16, rel=1e-6)
    int2 = evaluate(model, None, "rtn", MethodArgs("int2", "int2", sink=0, recent=16), settings)
    windows = heldout_windows(None, model.config.vocab_size, 96, 2)
    lp = score_window(model, windows, 32, CacheConfig("int2", "int2", 0, 16).fit(32, 16))
    with torch.no_grad():
        ref = F.log_softmax(model(windows).logits.double(), -1)[:, -33:-1]
    kl = (ref.exp() * (ref - lp.double())).sum(-1).mean().item()
    nll = -lp.double().gather(-1, windows[:, -32:, None]).mean().item()
    assert int2.kl == pytest.approx(kl, rel=1e-4) and int2.kl > 1e-4
    assert int2.ppl == pytest.approx(math.exp(nll), rel=1e-6) and int2.ppl_bf16 == pytest.approx(bf16.ppl_bf16)


def test_windows_set_the_ppl_kl_windows_apart_from_the_needle_samples(model):
    """`windows` sizes the ppl/kl set alone: the KL is the mean over those windows' tokens (the first two of
    three held-out windows give the two-window figure), and the needles keep `samples`."""
    base = dict(lengths=(96,), samples=2, scored=32, batch=3, progress=False)
    args = MethodArgs("int2", "int2", sink=0, recent=16)
    three = evaluate(model, None, "rtn", args, EvalSettings(tasks=("ppl", "kl"), windows=3, **base))
    two = evaluate(model, None, "rtn", args, EvalSettings(tasks=("ppl", "kl"), **base))
    assert three.settings["windows"] == [3, 96] and two.settings["windows"] == [2, 96]
    windows = heldout_windows(None, model.config.vocab_size, 96, 3)
    cfg = CacheConfig("int2", "int2", 0, 16).fit(32, 16)
    per_window = window_stats(model, windows, 32, cfg, batch=3, progress=False)["kl"]
    assert three.kl == pytest.approx(per_window.mean().item(), rel=1e-5)
    assert two.kl == pytest.approx(per_window[:2].mean().item(), rel=1e-5) and two.kl != pytest.approx(three.kl)
    needles = evaluate(model, None, "rtn", args, EvalSettings(tasks=("niah",), windows=5, **base))
    assert all(len(o) == 2 for by_n in needles.niah_samples.values() for o in by_n.values())
    with pytest.raises(ValueError, match="windows"):
        EvalSettings(windows=0)


def test_scored_tokens_attend_to_quantized_history(model, windows):
    """A short scored continuation changes under a destructive cache whose protected window is shorter than
    the context, and does not when the window covers everything."""
    ref = score_window(model, windows, 8, CacheConfig.bf16())
    hidden = score_window(model, windows, 8, CacheConfig("int2", QuantFormat("int2", 16), sink=0, recent=16).fit(32, 16))
    assert (hidden - ref).abs().amax() > 1e-2
    # The first scored token (the context's last position) too sees the quantized context.
    assert (hidden[:, 0] - ref[:, 0]).abs().amax() > 1e-2
    covered = score_window(model, windows, 8, CacheConfig("int2", QuantFormat("int2", 16), sink=0, recent=96).fit(32, 16))
    torch.testing.assert_close(covered, ref, atol=1e-5, rtol=1e-5)


def test_methods_table():
    expect = {"bf16": ("bf16", "bf16", 0, 0), "fp8": ("fp8:0", "fp8:0", 0, 0),
              "fp8-content": ("fp8", "bf16", 0, 0), "rtn": ("int4", "int4", 4, 128),
              "rtn-content": ("int4", "bf16", 4, 128)}
    assert set(expect) <= set(METHODS)
    for name, (content, rope, sink, recent) in expect.items():
        _, cfg = METHODS[name](None, MethodArgs())  # unfitted: the real 512/64 widths
        assert (str(cfg.content), str(cfg.rope), cfg.sink, cfg.recent) == (content, rope, sink, recent), name
    assert QuantFormat.parse("fp8").group == 128  # FlashMLA: one scale per 128 content values
    _, cfg = METHODS["rtn"](None, MethodArgs("int2:32", "int8", 0, 64))
    assert (str(cfg.content), str(cfg.rope), cfg.sink, cfg.recent) == ("int2:32", "int8", 0, 64)
    with pytest.raises(ValueError, match="stores rope as bf16"):
        METHODS["rtn-content"](None, MethodArgs(rope="int4"))
    with pytest.raises(ValueError, match="known methods: bf16, fp8"):
        apply_method("nope", None)



def test_python_m_quantmla_runs_the_cli():
    """`python -m quantmla` is the `quantmla` command: same parser, same exit codes."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "quantmla", "info", "/nonexistent/model"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "not found" in run.stderr, run.stderr


def test_eval_help_names_the_methods_that_take_formats():
    """--content/--rope are not rtn's alone: kivi, quarot, smoothquant and quantmla take them too, and the
    BF16 window defaults to 4 + 128 for every method but bf16/fp8/fp8-content."""
    from quantmla.cli import build_parser

    eval_parser = build_parser()._subparsers._group_actions[0].choices["eval"]
    helps = {a.dest: a.help for a in eval_parser._actions}
    for name in ("rtn", "kivi", "quarot", "smoothquant", "quantmla"):
        assert name in helps["content"], name
    _, cfg = METHODS["kivi"](None, MethodArgs(content="int2", rope="int4"))  # taken, as token groups
    assert (str(cfg.content), str(cfg.rope), cfg.sink, cfg.recent) == ("int2:t64", "int4:t64", 4, 128)
    for flag in ("sink", "recent"):
        assert "fp8-content" in helps[flag] and "rtn methods" not in helps[flag], flag

def test_bytes_per_token_is_measured():
    # 1152 B per token in BF16; INT4/INT4 body 256+32 + 4*(8+1) = 324 B; protected tokens at BF16.
    assert measure_bytes_per_token(CacheConfig.bf16(), 512, 64, 256) == 1152
    assert measure_bytes_per_token(CacheConfig("fp8:0", "fp8:0", 0, 0), 512, 64, 256) == 576
    assert measure_bytes_per_token(CacheConfig("fp8", "bf16", 0, 0), 512, 64, 256) == 656
    rtn = measure_bytes_per_token(CacheConfig("int4", "int4", 4, 128), 512, 64, 1024)
    assert rtn == pytest.approx((132 * 1152 + 892 * 324) / 1024)


def test_needle_samples_and_suite_structure(model):
    samples = retrieval.samples_for("multivalue", 200, 3, seed=5)
    assert samples == retrieval.samples_for("multivalue", 200, 3, seed=5)  # the same prompts for every method
    assert samples != retrieval.samples_for("multivalue", 200, 3, seed=6)
    settings = EvalSettings(tasks=("niah",), lengths=(96, 128), samples=2, progress=False)
    r = evaluate(model, None, "rtn", MethodArgs(recent=32), settings)
    assert set(r.niah) == set(TASKS) and all(set(v) == {96, 128} for v in r.niah.values())
    for task, by_length in r.niah_samples.items():  # each sample's outcome, consistent with the accuracy
        assert all(len(o) == 2 and o.count("1") / 2 == r.niah[task][n] for n, o in by_length.items())


def test_paired_changes_count_both_directions_with_an_exact_p():
    assert paired_changes("110010", "101011") == (1, 2, 1.0)
    assert paired_changes("1" * 10, "0" * 10) == (10, 0, 2 / 1024)  # 10 of 10 one way: 2 * 0.5**10
    assert paired_changes("1" * 8 + "0" * 2, "0" * 8 + "1" * 2)[2] == pytest.approx(2 * 56 / 1024)
    assert paired_changes("01", "01") == (0, 0, 1.0)
    with pytest.raises(ValueError, match="not the same samples"):
        paired_changes("1", "10")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model("deepseek_v3", tmp_path_factory.mktemp("tiny") / "model")


def test_cli_json(tiny_dir, tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = main(["eval", str(tiny_dir), "--method", "rtn", "--content", "int2", "--recent", "16", "--lengths",
               "80,96", "--samples", "1", "--scored", "16", "--json", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    for key in ("method", "content", "rope", "bytes_per_token", "ppl", "kl", "niah", "percent_of_bf16"):
        assert key in d
    assert (d["method"], d["content"], d["rope"]) == ("rtn", "int2:32", "int4:16")
    assert d["kl"] > 0 and d["bytes_per_token"] < d["bytes_per_token_bf16"]
    assert set(d["niah"]) == set(TASKS) and set(d["niah"]["single"]) == {"80", "96"}
    assert "Needle retrieval, % exact (greedy answer)" in capsys.readouterr().out  # one line: the table is narrow


def test_cli_scores_half_a_short_window_by_default(tiny_dir, tmp_path):
    """Without --scored, windows shorter than 512 tokens score their second half (256 would not fit)."""
    out = tmp_path / "eval.json"
    assert main(["eval", str(tiny_dir), "--method", "rtn", "--recent", "16", "--lengths", "96", "--samples", "1",
                 "--tasks", "ppl,kl", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["kl"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--method", "nope"], "known methods: bf16, fp8, fp8-content, rtn, rtn-content"),
    (["--method", "rtn", "--content", "int3"], "unknown cache format 'int3'"),
    (["--method", "rtn", "--rope", "int4:5"], "group 5 does not divide"),
    (["--method", "fp8", "--content", "int4"], "method 'fp8' stores content as fp8:0"),
    (["--lengths", "96,4096"], "exceeds the model's max_position_embeddings 512"),
    (["--lengths", "96,x"], "--lengths takes comma-separated integers"),
    (["--tasks", "ppl,bleu"], "unknown task(s) bleu"),
    (["--lengths", "96", "--scored", "16", "--data", "/nonexistent/heldout.txt"], "text file not found"),
])
def test_cli_errors(tiny_dir, capsys, argv, message):
    assert main(["eval", str(tiny_dir), *argv, "--samples", "1"]) == 2
    assert message in capsys.readouterr().err


def test_cli_notes_a_baseline_on_a_calibrated_checkpoint(tiny_dir, tmp_path, capsys):
    """A baseline method on a calibrated checkpoint runs on its folded weights, not the original's: eval says
    so (the row read as the baseline's own figure)."""
    import shutil

    from quantmla.calibrate.export import section

    cal = tmp_path / "cal"
    shutil.copytree(tiny_dir, cal)
    config = json.loads((cal / "config.json").read_text())
    config["quantmla"] = section(CacheConfig("int4", "int4", 4, 16), {})
    (cal / "config.json").write_text(json.dumps(config))
    argv = ["--method", "rtn", "--recent", "16", "--lengths", "96", "--samples", "1", "--tasks", "ppl,kl"]
    assert main(["eval", str(cal), *argv]) == 0
    assert "is calibrated: rtn runs on its folded weights" in capsys.readouterr().out
    assert main(["eval", str(tiny_dir), *argv]) == 0
    assert "calibrated" not in capsys.readouterr().out


def test_cli_checks_the_json_path_before_the_run(tiny_dir, tmp_path, capsys, monkeypatch):
    """--json that is a directory or lies under a file is refused before any work (it failed only after the
    evaluation, a FileExistsError traceback under a file)."""
    import quantmla.eval.suite

    monkeypatch.setattr(quantmla.eval.suite, "evaluate", lambda *a, **k: pytest.fail("evaluated"))
    (tmp_path / "file").write_text("mine")
    for path, message in ((tmp_path, "is a directory"), (tmp_path / "file" / "x.json", "is a file, not a directory")):
        assert main(["eval", str(tiny_dir), "--method", "rtn", "--lengths", "160", "--json", str(path)]) == 2
        assert message in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "mine"


def test_cli_missing_model(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nowhere")]) == 2
    assert "model directory not found" in capsys.readouterr().err


def test_ppl_kl_windows_may_fill_the_models_positions(tiny_dir, capsys):
    """Only the needles need slack for BOS and answer: ppl/kl alone at the model's 512 positions ran nothing."""
    base = ["eval", str(tiny_dir), "--method", "rtn", "--samples", "1", "--scored", "8"]
    assert main(base + ["--lengths", "512", "--tasks", "ppl,kl"]) == 0
    assert main(base + ["--lengths", "513", "--tasks", "ppl,kl"]) == 2
    assert "length 513 exceeds the model's max_position_embeddings 512" in capsys.readouterr().err
    assert main(base + ["--lengths", "512", "--tasks", "niah"]) == 2
    assert "length 512 (+ up to 32 tokens of BOS and answer) exceeds" in capsys.readouterr().err


def test_eval_refuses_lengths_where_nothing_is_quantized(tiny_dir, capsys):
    """At lengths within sink + recent a quantized method would measure as BF16 (KL 0): refused, saying why."""
    assert main(["eval", str(tiny_dir), "--method", "rtn", "--lengths", "96", "--samples", "1",
                 "--tasks", "ppl,kl"]) == 2
    assert "no scored token sees a quantized key (sink 4 + recent 128" in capsys.readouterr().err


@pytest.mark.parametrize("argv, shortest", [(["--method", "rtn", "--recent", "60"], 66),
                                            (["--method", "kivi", "--recent", "16"], 85)])
def test_eval_refuses_lengths_where_no_scored_token_sees_a_quantized_key(tiny_dir, capsys, argv, shortest):
    """The first query that sees a quantized key is at sink + recent + block - 1 (a token-axis block waits in
    BF16 until it is full), and ppl/kl score queries up to length - 2: kivi's int4:t64 at 4 + 16 + 64 = 84
    tokens, or rtn at 4 + 60 + 1 = 65, measured KL 0 and BF16's bytes as if lossless."""
    base = ["eval", str(tiny_dir), *argv, "--samples", "1", "--tasks", "ppl,kl"]
    assert main(base + ["--lengths", str(shortest - 1)]) == 2
    assert f"use lengths above {shortest - 1}" in capsys.readouterr().err
    out = tiny_dir.parent / f"{argv[1]}.json"
    assert main(base + ["--lengths", str(shortest), "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["bytes_per_token"] < d["bytes_per_token_bf16"]  # it stores quantized keys, which one query sees


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "96,4096"], "exceeds the model's max_position_embeddings 512"),
    (["--lengths", "96"], "no scored token sees a quantized key (sink 4 + recent 128"),
])
def test_eval_checks_quantmla_lengths_before_calibrating(tiny_dir, capsys, monkeypatch, argv, message):
    """quantmla calibrates an uncalibrated checkpoint first (minutes on a real model): lengths past the model's
    positions, or within its BF16 window, were refused only after that."""
    import quantmla.calibrate.driver

    monkeypatch.setattr(quantmla.calibrate.driver, "calibrate_model", lambda *a, **k: pytest.fail("calibrated"))
    assert main(["eval", str(tiny_dir), "--method", "quantmla", *argv, "--samples", "1", "--tasks", "ppl"]) == 2
    assert message in capsys.readouterr().err


def test_only_needles_count_slack_in_the_advice_for_longer_lengths(tmp_path, capsys):
    """On a model of 150 positions ppl/kl windows of 134-150 tokens see quantized keys: the advice is those
    lengths; needles, which need up to LENGTH_SLACK more, get a smaller --recent instead."""
    src = tmp_path / "short"
    tiny_model("deepseek_v3", max_position_embeddings=150).save_pretrained(src)
    base = ["eval", str(src), "--method", "rtn", "--lengths", "96", "--samples", "1"]
    assert main(base + ["--tasks", "ppl"]) == 2
    assert "use lengths above 133, or a smaller --recent" in capsys.readouterr().err
    assert main(base + ["--tasks", "niah"]) == 2
    assert "use --recent 90 or less (the model's 150 positions" in capsys.readouterr().err


def test_short_models_get_a_window_that_fits(tmp_path, capsys):
    """On a model of 128 positions, sink 4 + recent 128 BF16 tokens leave nothing quantized and no longer window
    can help: eval, calibrate and analyze name a --recent that fits instead of lengths above 132."""
    src = tmp_path / "short"
    tiny_model("deepseek_v3", max_position_embeddings=128).save_pretrained(src)
    assert main(["eval", str(src), "--method", "rtn", "--lengths", "96", "--samples", "1", "--tasks", "ppl"]) == 2
    assert "use --recent 90 or less (the model's 128 positions" in capsys.readouterr().err
    for cmd in (["calibrate", str(src), "--out", str(tmp_path / "o")], ["analyze", str(src), "--length", "128"]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert "cover all 128 positions" in err and "e.g. --recent 123" in err, err
    assert main(["eval", str(src), "--method", "rtn", "--lengths", "96", "--samples", "1", "--tasks", "ppl",
                 "--recent", "90"]) == 0


def test_eval_methods_parts_merge(tiny_dir, tmp_path):
    """benchmarks/eval_methods.py: parts written in separate runs make one table; other settings refuse."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import eval_methods

    common = ["--model", str(tiny_dir), "--lengths", "160", "--samples", "1", "--scored", "16"]  # > 4 + 128
    assert eval_methods.main(common + ["--methods", "bf16", "--out", str(tmp_path / "a")]) == 0
    assert eval_methods.main(common + ["--methods", "rtn@int2/int4", "--out", str(tmp_path / "b")]) == 0
    parts = [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    assert eval_methods.main(["--merge", *parts, "--out", str(tmp_path / "ab")]) == 0
    merged = json.loads((tmp_path / "ab.json").read_text())
    assert [(r["method"], r["content"]) for r in merged["results"]] == [("bf16", "bf16"), ("rtn", "int2:32")]
    assert merged["parts"] == parts and " ; " in merged["command"]
    md = (tmp_path / "ab.md").read_text()
    assert "under serving semantics" in md and "| rtn | int2:32 |" in md and "- Needles:" in md
    assert eval_methods.main(common + ["--methods", "bf16", "--tasks", "ppl,kl", "--out", str(tmp_path / "k")]) == 0
    assert "- Needles:" not in (tmp_path / "k.md").read_text()  # a KL-only run measured no needles
    assert eval_methods.main(common[:-1] + ["8", "--methods", "bf16", "--out", str(tmp_path / "c")]) == 0
    with pytest.raises(SystemExit, match="other settings"):
        eval_methods.main(["--merge", parts[0], str(tmp_path / "c.json"), "--out", str(tmp_path / "ac")])


def test_eval_methods_budget_row(tiny_dir, tmp_path, monkeypatch):
    """quantmla@budget=F: a row labelled with the budget, per-layer formats in the format columns, bytes
    measured as for every row; bad specs stop before the model is loaded."""
    import sys
    from pathlib import Path

    from quantmla.eval.baselines import Calibration, quantmla

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import eval_methods

    fast = Calibration(samples=3, length=160, steps=2)
    monkeypatch.setitem(METHODS, "quantmla", lambda model, args: quantmla(model, args, fast))
    out = tmp_path / "b"
    assert eval_methods.main(["--model", str(tiny_dir), "--lengths", "160", "--samples", "1", "--scored", "16",
                              "--methods", "rtn@int4/int4,quantmla@budget=0.25", "--out", str(out)]) == 0
    rtn, budget = json.loads(out.with_suffix(".json").read_text())["results"]
    assert budget["method"] == "quantmla b=0.25" and "|" in budget["content"] + budget["rope"]
    assert budget["percent_of_bf16_long"] <= 25 < rtn["percent_of_bf16_long"]
    assert len(budget["settings"]["cache"]["layers"]) == 3
    md = out.with_suffix(".md").read_text().splitlines()
    header, row = next(line for line in md if line.startswith("| method |")), md[-3]
    assert row.startswith("| quantmla b=0.25 | ")
    cells = lambda line: len(re.split(r"(?<!\\)\|", line))  # noqa: E731  (markdown's '\|' is no cell border)
    assert cells(row) == cells(header)
    for spec, message in (("rtn@budget=0.3", "'rtn' takes no byte budget"), ("quantmla@budget=2", "got 2.0"),
                          ("quantmla@budget=x", "could not convert"), ("nope", "unknown method 'nope'")):
        with pytest.raises(SystemExit, match=message):
            eval_methods.parse_rows(spec)
