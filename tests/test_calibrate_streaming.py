"""Streaming calibration: one decoder layer's weights resident at a time, the same fused weights as the
in-memory path, resident memory (weights and process RSS) well under the checkpoint's size, and a BF16
export whose KL against the original float32 model shows the fold's rounding but stays at BF16 level."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from quantmla.calibrate.driver import calibrate_model
from quantmla.calibrate.export import cache_config_of, save_calibrated
from quantmla.calibrate.streaming import ShardReader, calibrate_streaming
from quantmla.cli import main
from quantmla.config import CacheConfig
from quantmla.models import describe, load_model
from quantmla.models.tiny import tiny_model

CFG = CacheConfig("int4", "int4", sink=4, recent=16)


def _ids(n=4, t=64, seed=0):
    return torch.randint(0, 128, (n, t), generator=torch.Generator().manual_seed(seed))


def _tensors(path):
    reader = ShardReader(path)
    return reader.read(reader.weight_map)


def _in_memory(src, out, dtype):
    model = load_model(src)
    layers = describe(model)
    torch.manual_seed(0)
    reports = calibrate_model(model, layers, _ids(), CFG, steps=4, progress=False)
    save_calibrated(model, out, CFG.fit(layers[0].kv_lora_rank, layers[0].rope_dim), {}, reports, src, dtype)
    return reports


@pytest.mark.parametrize("family,shard", [("deepseek_v3", "20KB"), ("longcat_flash", None), ("axk1", None),
                                          ("mistral4", "20KB")])
# axk1: a norm its checkpoints store under another name than the module's; mistral4: experts stored fused
def test_streaming_gives_the_in_memory_weights_with_one_layer_resident(family, shard, tmp_path):
    src = tmp_path / "src"
    layers = {"num_layers": 4} if family == "longcat_flash" else {"num_hidden_layers": 5}
    if shard:  # many small shards, a layer's tensors spread over several
        tiny_model(family, **layers).save_pretrained(src, max_shard_size=shard)
        assert len(set(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"].values())) > 5
    else:  # one model.safetensors, no index
        tiny_model(family, **layers).save_pretrained(src)
        assert (src / "model.safetensors").is_file() and not (src / "model.safetensors.index.json").exists()
    (tmp_path / "str").mkdir()
    (tmp_path / "str" / "model.safetensors").write_bytes(b"stale")  # must not shadow the new shards
    reports = _in_memory(src, tmp_path / "mem", torch.float32)
    torch.manual_seed(0)
    res = calibrate_streaming(src, tmp_path / "str", _ids(), CFG, steps=4, progress=False, dtype=torch.float32)
    # the cap: at most the non-layer tensors plus one decoder layer, under half the checkpoint
    assert 0 < res.peak_weight_bytes < res.checkpoint_bytes / 2
    mem, got = _tensors(tmp_path / "mem"), _tensors(tmp_path / "str")
    assert set(got) == set(mem)
    # the index's total_size is the tensors' bytes, as save_pretrained writes it (file sizes add the headers)
    index = json.loads((tmp_path / "str" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in got.values())
    unequal = [k for k in mem if not torch.equal(mem[k], got[k])]
    assert not unequal, unequal[:5]
    orig = _tensors(src)  # and the fold did move the attention weights
    assert any(not torch.equal(orig[k], got[k]) for k in got if "kv_a_proj_with_mqa" in k)
    assert [r.content_best for r in res.reports] == [r.content_best for r in reports]
    assert cache_config_of(tmp_path / "str") == cache_config_of(tmp_path / "mem")
    # the multi-token-prediction layers are not written: neither config may promise them
    configs = [json.loads((d / "config.json").read_text()) for d in (src, tmp_path / "mem", tmp_path / "str")]
    nextn = [c.get("num_nextn_predict_layers") for c in configs]
    assert nextn == ([1, 0, 0] if family == "deepseek_v3" else [None] * 3)


def _kl(logits_p, logits_q):
    """Mean KL(p || q) per token, p the reference."""
    lp, lq = F.log_softmax(logits_p.double(), -1), F.log_softmax(logits_q.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).mean().item()


def test_bf16_streaming_export_against_the_original_model(tmp_path):
    src = tmp_path / "src"
    tiny_model("deepseek_v2").save_pretrained(src, max_shard_size="20KB")
    out = tmp_path / "cal"
    assert main(["calibrate", str(src), "--streaming", "--dtype", "bfloat16", "--samples", "4", "--length", "64",
                 "--recent", "16", "--steps", "4", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(v.dtype == torch.bfloat16 for v in _tensors(out).values())
    ids = _ids(2, 48, seed=1)
    original = load_model(src)  # float32
    fused = load_model(out)  # the BF16 weights, computed in float32
    plain = load_model(src, dtype=torch.bfloat16).float()  # the original, only rounded to BF16
    with torch.no_grad():
        ref, got, rounded = original(ids).logits, fused(ids).logits, plain(ids).logits
    kl_fused, kl_plain = _kl(ref, got), _kl(ref, rounded)
    print(f"KL(original || bf16 fused) {kl_fused:.3e}, KL(original || bf16 original) {kl_plain:.3e}")
    assert kl_fused > 0  # the fold's rounding to BF16 shows up ...
    assert kl_fused < 5 * kl_plain + 1e-6  # ... at the size of BF16 rounding itself, not a broken fold


_RSS = textwrap.dedent("""
    import json, sys, torch
    from quantmla.calibrate.streaming import calibrate_streaming, skeleton
    from quantmla.config import CacheConfig
    def rss(field):  # VmHWM: this process's peak RSS (getrusage's ru_maxrss keeps the forking parent's peak)
        return int(open("/proc/self/status").read().split(field + ":")[1].split()[0]) * 1024
    skeleton(sys.argv[1])  # imports the family's modeling code (~200 MB of RSS), reads no weights
    before = rss("VmHWM")
    ids = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(0))
    res = calibrate_streaming(sys.argv[1], sys.argv[2], ids, CacheConfig("int4", "int4", sink=4, recent=8),
                              steps=1, progress=False)
    peak = rss("VmHWM")
    print(json.dumps({"before": before, "peak": peak, "weights": res.checkpoint_bytes}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_rss_stays_far_below_the_checkpoint(tmp_path):
    """Process RSS, not just the counted tensors: a checkpoint of ~200 MB (wide dense MLPs) calibrates with
    the process's peak RSS growing by less than half of it (16 layers of ~13 MB; measured growth ~45 MB: the
    non-layer tensors, one layer, its serialised shard, activations; the in-memory path needs all ~200 MB)."""
    src = tmp_path / "src"
    model = tiny_model("deepseek_v2", num_hidden_layers=16, first_k_dense_replace=16, hidden_size=256,
                       intermediate_size=4096)
    model.save_pretrained(src, max_shard_size="30MB")
    del model
    run = subprocess.run([sys.executable, "-c", _RSS, str(src), str(tmp_path / "out")], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    print(got)
    assert got["weights"] > 150e6
    assert got["peak"] - got["before"] < got["weights"] / 2


def test_streaming_skips_the_tensors_transformers_ignores(tmp_path, one_thread):
    """LongCat-Flash ships its multi-token-prediction layer as model.mtp.*, which transformers ignores on
    loading (`_keys_to_ignore_on_load_unexpected`) as the in-memory path does; --streaming refused the
    checkpoint ("tensors the model does not have"). It leaves them out, as the in-memory output does."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    tiny_model("longcat_flash").save_pretrained(src)
    tensors = load_file(src / "model.safetensors")
    tensors.update({"model.mtp.eh_proj.weight": torch.randn(64, 128), "model.mtp.norm.weight": torch.ones(64)})
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    _in_memory(src, tmp_path / "mem", torch.float32)
    torch.manual_seed(0)
    calibrate_streaming(src, tmp_path / "str", _ids(), CFG, steps=4, progress=False, dtype=torch.float32)
    mem, got = _tensors(tmp_path / "mem"), _tensors(tmp_path / "str")
    assert set(got) == set(mem) and not any(k.startswith("model.mtp.") for k in got)
    assert all(torch.equal(mem[k], got[k]) for k in mem)


def test_a_failed_streaming_calibration_leaves_no_partial_checkpoint(tmp_path, one_thread):
    """A streaming run that fails at a later layer (here a tensor missing from layer 2) had written the shards of
    the layers before it: the partial --out (a large model's hundreds of GB) made the next `calibrate` refuse it
    as not empty. The run removes what it wrote, and a directory it made; files of the user's stay."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    tiny_model("deepseek_v3").save_pretrained(src, max_shard_size="20KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"].pop("model.layers.2.self_attn.kv_b_proj.weight")
    tensors = load_file(shard)
    del tensors["model.layers.2.self_attn.kv_b_proj.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    for out in (tmp_path / "new", tmp_path / "kept"):
        with pytest.raises(ValueError, match="layer 2's tensors do not match the model: lacks"):
            calibrate_streaming(src, out, _ids(), CFG, steps=1, progress=False)
    assert not (tmp_path / "new").exists()
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["notes.txt"]
