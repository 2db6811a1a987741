"""The demo pipeline end to end on a tiny checkpoint: calibrated checkpoints written, every row measured."""

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
    assert cache_config_of(tmp_path / "out" / "quantmla-int2-int4") == CacheConfig("int2:32", "int4:16", 4, 8)
