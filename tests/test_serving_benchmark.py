"""benchmarks/serving_pressure.py: the tiny CPU run end to end, and the pieces the H200 run relies on."""

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("serving_pressure", ROOT / "benchmarks" / "serving_pressure.py")
sp = importlib.util.module_from_spec(spec)
sys.modules["serving_pressure"] = sp  # dataclasses look their module up while the file executes
spec.loader.exec_module(sp)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("serving")
    sp.main(["--tiny", "--out", str(out), "--formats", "bf16/bf16,fp8:0/fp8:0,int4/int4", "--sweep", "1.0,0.33",
             "--sweep-formats", "bf16/bf16,int4/int4", "--poisson-formats", "bf16/bf16,int4/int4",
             "--profile-steps", "2"])  # fmt: skip
    return out, json.loads((out / "serving_pressure.json").read_text())


def test_tiny_run_writes_every_output(tiny):
    out, res = tiny
    for key in ("card", "date", "command", "config", "rows", "sweep", "poisson"):
        assert key in res
    assert [r["format"] for r in res["rows"]] == ["bf16/bf16", "fp8:0/fp8:0", "int4/int4"]
    assert len(res["sweep"]) == 4 and len(res["poisson"]) == 2
    md = (out / "serving_pressure.md").read_text()
    assert md.count("(`bf16/bf16`)") == 1 + 2 + 1 and "## Targets" in md  # headline, sweep x2, Poisson
    assert "bf16/bf16 8/8 / 0, fp8:0/fp8:0 8/8 / 0, int4/int4 8/8 / 0" in md  # finished / pages left
    assert (out / "serving_pressure.png").stat().st_size > 1000
    for r in res["rows"] + res["sweep"] + res["poisson"]:
        assert not r.get("skipped") and not r["cut"], r
        for key in ("format", "body_bytes_per_token", "capacity_tokens", "preemptions", "output_tok_s",
                    "request_throughput_rps", "ttft_median_s", "ttft_p99_s", "tpot_median_s", "tpot_p99_s",
                    "peak_batch", "attention_share", "time_split"):  # fmt: skip
            assert key in r, key
        # Every request ran to its full length (ignore_eos), and the clocks are consistent.
        assert r["requests_done"] == r["requests"] and r["requests_lost"] == 0
        assert r["pages_left_allocated"] == 0  # read before the driver aborts anything: a leak would show
        assert r["output_tokens"] == r["requests"] * res["config"]["headline" if r in res["rows"] else "sweep"][
            "output_len"]
        assert 0 < r["ttft_median_s"] <= r["ttft_p99_s"] <= r["wall_s"]
        assert 0 < r["tpot_median_s"] <= r["tpot_p99_s"]
        assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        assert 1 <= r["peak_batch"] <= r["requests"]
        split = r["time_split"]
        assert split["driver_s"] >= -1e-6 and sum(split.values()) == pytest.approx(r["wall_s"])
        assert (split["reprefill_s"] > 0) == (r["preemptions"] > 0) == (r["reprefill_tokens"] > 0)


def test_tiny_run_shows_the_pressure_pattern(tiny):
    _, res = tiny
    rows = {r["format"]: r for r in res["rows"]}
    bf16, q = rows["bf16/bf16"], rows["int4/int4"]
    assert bf16["preemptions"] > 0 and q["preemptions"] == 0
    assert q["peak_batch"] == q["requests"] > bf16["peak_batch"]
    # Same bytes: the pool holds ~the byte ratio more tokens (less the BF16 window's rows of every slot).
    ratio = bf16["body_bytes_per_token"] / q["body_bytes_per_token"]
    assert 0.85 * ratio < q["capacity_tokens"] / bf16["capacity_tokens"] <= ratio
    assert rows["fp8:0/fp8:0"]["body_bytes_per_token"] * 2 == bf16["body_bytes_per_token"]
    assert q["x_bf16"] == pytest.approx(q["output_tok_s"] / bf16["output_tok_s"])
    # At fraction 1.0 BF16 just holds the whole load: no preemption.
    full = [r for r in res["sweep"] if r["budget_fraction"] == 1.0 and r["format"] == "bf16/bf16"][0]
    assert full["preemptions"] == 0 and full["load_tokens"] <= full["capacity_tokens"] < full["load_tokens"] + 16
    # On the CPU the profiler sees no GPU kernels: no attention share, and the output says why.
    assert bf16["attention_share"] is None and "no GPU kernels" in bf16["profile"]["note"]


def test_param_count_matches_v2_lite_active():
    model = sp.build_model(sp.ModelSpec(), torch.device("meta"), 0)
    n = sp.param_counts(model)
    assert n["matmul_per_token"] == pytest.approx(2.4e9, rel=0.01)
    assert [sp.body_bytes_per_token(sp.FORMATS[k], sp.ModelSpec()) for k in sp.FORMATS] == [1152, 576, 656, 324, 196]


def _ev(name, start, end, device=DeviceType.CUDA):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))


def test_every_decode_kernel_counts_as_attention():
    """The profile's attention share covers each kernel mla_decode can run: Triton's, the CUDA kernel (its
    extern "C" name in mla_decode_int.cu), Gluon's, and the split combine."""
    cu = (ROOT / "src" / "quantmla" / "kernels" / "mla_decode_int.cu").read_text()
    name = cu.split('__global__ void __launch_bounds__(NTHREADS, 2) ')[1].split("(")[0]
    for kernel in ("_mla_decode_kernel", name, "_gluon_decode_kernel", "_combine_kernel"):
        assert sp.kernel_class(kernel) == "attention", kernel
    assert sp.kernel_class("_append_decode_kernel") == "cache_write"


def test_window_analysis_splits_decode_steps():
    events = [
        _ev("qm_step_0", 0, 1000, DeviceType.CPU),  # decode
        _ev("qm_step_1", 1000, 5000, DeviceType.CPU),  # prefill: ignored
        _ev("qm_step_0", 0, 1000),  # the GPU copy of our label: not a kernel
        _ev("nvjet_tst_128x64_gemm", 100, 400),
        _ev("_mla_decode_kernel", 400, 600),
        _ev("_combine_kernel", 600, 650),
        _ev("void at::native::reduce_kernel<ArgMaxOps>", 700, 720),
        _ev("void at::native::elementwise_kernel", 350, 450),  # overlaps: busy time is a union
        _ev("_append_decode_kernel", 80, 90),
        _ev("aten::mm", 100, 900, DeviceType.CPU),
        _ev("sm90_xmma_gemm_bf16", 2000, 4000),  # in the prefill step
    ]
    steps = [sp.Step("decode", 1e-3, 4), sp.Step("prefill", 4e-3, 1)]
    out = sp.analyze_window(events, steps)
    assert out["decode_steps"] == 1 and out["kernels_seen"] == 7 and out["mean_batch"] == 4
    assert out["step_ms"] == pytest.approx(1.0)
    assert out["attention_ms"] == pytest.approx(0.25)
    assert out["weights_ms"] == pytest.approx(0.3)
    assert out["sampling_ms"] == pytest.approx(0.02)
    assert out["other_kernels_ms"] == pytest.approx(0.1)
    assert out["cache_write_ms"] == pytest.approx(0.01)
    assert out["gpu_busy_ms"] == pytest.approx(0.58)  # 80..90, 100..650 and 700..720
    assert out["host_ms"] == pytest.approx(0.42)
    assert out["attention_share"] == pytest.approx(0.25)


def test_shares_are_taken_over_the_unprofiled_steps_at_the_window_batch():
    prof = {"attention_share": 0.2, "batches": [4, 4, 3], "step_ms": 2.0, "gpu_busy_ms": 0.9, "attention_ms": 0.5,
            "cache_write_ms": 0.0, "weights_ms": 0.3, "sampling_ms": 0.05, "other_kernels_ms": 0.05}  # fmt: skip
    row = {"decode_step_ms_by_batch": {3: 1.0, 4: 1.0, 8: 5.0}, "time_split": {"decode_s": 10.0}}
    sp.apply_profile(row, prof)
    assert prof["reference_step_ms"] == pytest.approx(1.0) and row["attention_share"] == pytest.approx(0.5)
    assert row["decode_split_s"]["host"] == pytest.approx(1.0) and row["decode_split_s"]["weights"] == pytest.approx(3)
    assert sum(row["decode_split_s"].values()) == pytest.approx(10.0)


def test_budget_is_a_fraction_of_the_bf16_load():
    m, w = sp.ModelSpec(), sp.Workload(64, 8192, 1024)
    page = 64 * 27 * 1152
    assert sp.bf16_load_bytes(w, m, 64) == 64 * 144 * page
    assert sp.budget_bytes(1 / 3, w, m, 64) == 64 * 48 * page + page
    assert sp.arrivals_for(w) == [0.0] * 64
    t = sp.arrivals_for(sp.Workload(64, 8, 8, rate=4.0))
    assert t == sorted(t) and 8 < t[-1] < 32  # ~16 s for 64 requests at 4/s
    with pytest.raises(SystemExit, match="unknown format"):
        sp.format_list("bf16", "4+128")
    assert [f.recent for f in sp.format_list("fp8/bf16,int2/int4", "4+64")] == [0, 64]
    ranked = sp.format_list("int8r128/int4", "4+64")[0]  # any pair quantmla stores, with the window
    assert (ranked.content, ranked.rope, ranked.sink, ranked.recent) == ("int8r128", "int4", 4, 64)
    for bad in ("int4r0/int4", "int4/int4/int4", "int9/int4"):
        with pytest.raises(SystemExit, match="unknown format"):
            sp.format_list(bad, "4+128")


def test_engines_share_one_model_and_put_its_attention_back():
    model = sp.build_model(sp.TINY_MODEL, torch.device("cpu"), 0)
    engines = sp.Engines(model, torch.device("cpu"), 16, None, 2048)
    before = dict(engines.originals)
    w = sp.Workload(2, 64, 4)
    fmt = sp.format_list("int4/int4", "4+8")[0]
    out = sp.profile_twin(engines, fmt, sp.budget_bytes(1.0, w, sp.TINY_MODEL, 16), w, sp.prompts_for(w, 512),
                          2, 2, limit_s=0.0)  # fmt: skip
    assert "cut" in out["error"] and out["attention_share"] is None
    assert all(model.get_submodule(k) is v for k, v in before.items())
    assert model.config._attn_implementation == engines.attn_impl
    # A second engine on the same model serves it exactly as the first.
    with engines.open(fmt, sp.budget_bytes(1.0, w, sp.TINY_MODEL, 16), w) as llm:
        run = sp.drive(llm, w, sp.prompts_for(w, 512), 60.0)
    assert all(run.finished) and run.generated == [4, 4]
