"""The demo pipeline end to end on a tiny checkpoint: calibrated checkpoints written, every row measured."""

from dataclasses import replace

from quantmla.calibrate.export import cache_config_of
from quantmla.config import CacheConfig
from quantmla.demo import DemoSettings, run_demo
from quantmla.eval.suite import EvalSettings
from quantmla.models.tiny import save_tiny_model


def test_demo_pipeline(tmp_path):
    src = save_tiny_model("deepseek_v3", tmp_path / "src")
    settings = DemoSettings(formats=(("int2", "int4"),), calib_samples=3, calib_length=64, calib_steps=2, recent=8,
                            eval=EvalSettings(lengths=(64,), samples=1, scored=16, batch=1, progress=False))
    rows = run_demo(src, tmp_path / "out", settings, log=lambda m: None)
    assert [label for label, _ in rows] == ["bf16", "rtn int2/int4", "quantmla int2/int4"]
    assert abs(rows[0][1].kl) < 1e-7  # a BF16 cache, measured against a plain forward
    assert rows[1][1].kl > 0 and rows[2][1].kl > 0  # tokens older than the 8-token window are quantized
    cfg = cache_config_of(tmp_path / "out" / "quantmla-int2-int4")  # the asked formats, a clipping ratio per layer
    assert replace(cfg, layers=()) == CacheConfig("int2:32", "int4:16", 4, 8)
    assert all(replace(c, clip=1) == cfg.content and replace(r, clip=1) == cfg.rope for c, r in cfg.per_layer)


def test_demo_table_fits_80_columns_and_shows_the_128k_fraction():
    from types import SimpleNamespace

    from rich.console import Console

    from quantmla.cli import demo_table

    def row(measured, long, multivalue):
        niah = {"single": {512: 1.0}, "multikey": {512: 0.94}, "multivalue": {512: multivalue}}
        return SimpleNamespace(bytes_per_token=measured, bytes_per_token_bf16=1152, bytes_per_token_long=long,
                               kl=1e-3, ppl=2.1, niah=niah)

    # measured at 128 K: 132 BF16 tokens, the rest at 324 (int4/int4) or 196 (int2/int4) bytes
    rows = [("bf16", row(1152, 1152, 0.88)), ("quantmla int4/int4", row(537, 324.83, 0.81)),
            ("quantmla int2/int4", row(442, 196.93, 0.75))]
    console = Console(width=80, record=True)
    console.print(demo_table("default_model", rows, (512,)))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    lines = {line.split()[1] if line.split()[0] == "quantmla" else line.split()[0]: line
             for line in text.splitlines() if line.strip().startswith(("bf16", "quantmla"))}
    assert " 28.2 " in lines["int4/int4"] and " 46.6 " in lines["int4/int4"]
    assert " 17.1 " in lines["int2/int4"] and "100/94/75" in lines["int2/int4"]
    assert lines["bf16"].count("100.0") == 2



def test_demo_tables_show_every_needle_cell_at_several_lengths():
    """`quantmla demo --lengths 512,1024,2048`: one needles column per length made the table wider than 80
    columns, and rich cut its cells to '100/10…' and '1.00e…'; the needles go in a table of their own."""
    from types import SimpleNamespace

    from rich.console import Console

    from quantmla.cli import demo_needles_table, demo_table

    lengths = (512, 1024, 2048)
    niah = {"single": dict.fromkeys(lengths, 1.0), "multikey": dict.fromkeys(lengths, 0.94),
            "multivalue": {512: 0.88, 1024: 0.81, 2048: 0.75}}
    r = SimpleNamespace(bytes_per_token=537, bytes_per_token_bf16=1152, bytes_per_token_long=324.83, kl=1.23e-3,
                        ppl=139.359, niah=niah)
    rows = [("bf16", r), ("quantmla int4/int4", r), ("quantmla int2/int4", r)]
    console = Console(width=80, record=True)
    console.print(demo_table("default_model", rows, lengths))
    console.print(demo_needles_table("default_model", rows, lengths))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80 and "…" not in text
    for cell in ("quantmla int2/int4", "1.23e-03", "139.359", "100/94/88", "100/94/81", "100/94/75"):
        assert cell in text


def test_demo_checks_out_before_any_work(tmp_path, capsys, monkeypatch):
    """--out that is a file, or lies under one, is refused before the BF16 row (it failed only after the BF16 and
    RTN evaluations and a calibration, when the first checkpoint was written)."""
    import pytest

    import quantmla.demo
    from quantmla.cli import main

    monkeypatch.setattr(quantmla.demo, "run_demo", lambda *a, **k: pytest.fail("ran"))
    (tmp_path / "file").write_text("mine")
    for out, message in ((tmp_path / "file", "exists and is not a directory"),
                         (tmp_path / "file" / "demo", "is a file, not a directory")):
        assert main(["demo", "--out", str(out)]) == 2
        assert message in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "mine"


def test_demo_refuses_lengths_and_steps_it_cannot_run(tmp_path, capsys, monkeypatch):
    """Lengths within its 4 + 128 BF16 tokens are refused before the BF16 row, naming no flag the demo lacks (the
    evaluation's errors named --scored / --recent, the latter after the BF16 row); --steps 0 or -1 are refused as
    calibrate refuses them (they ran)."""
    import pytest

    import quantmla.demo
    from quantmla.cli import main

    monkeypatch.setattr(quantmla.demo, "run_demo", lambda *a, **k: pytest.fail("ran"))
    for lengths in ("100", "130", "132"):
        assert main(["demo", "--out", str(tmp_path / "d"), "--lengths", lengths]) == 2
        err = capsys.readouterr().err
        assert "use a length above 132" in err and "--scored" not in err and "--recent" not in err
    for option in ("--steps", "--samples", "--windows"):
        for value in ("0", "-1"):
            with pytest.raises(SystemExit):
                main(["demo", "--out", str(tmp_path / "d"), option, value])
            assert "must be >= 1" in capsys.readouterr().err
