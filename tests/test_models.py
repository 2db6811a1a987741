"""Adapters and the reference MLA math against transformers' own attention, for every family."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from quantmla.capture import capture
from quantmla.mla import attention_from_cache, expanded_attention
from quantmla.models import UnsupportedModelError, attention_module, describe, load_model
from quantmla.models.tiny import TINY_FAMILIES, save_tiny_model, tiny_model

FAMILIES = list(TINY_FAMILIES)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_matches_transformers(family):
    model = tiny_model(family)
    layers = describe(model)
    ids = torch.randint(0, 128, (2, 13))
    cap = capture(model, layers, ids)
    for layer in layers:
        k = cap[layer.cache_idx]
        attn = attention_module(model, layer)
        absorbed, heads = attention_from_cache(attn, layer, k.hidden, k.position_embeddings, k.c, k.k_pe,
                                               positions=k.positions)
        expanded, _ = expanded_attention(attn, layer, k.hidden, k.position_embeddings, k.c, k.k_pe, k.positions)
        assert rel(absorbed, k.output) < 1e-5
        assert rel(heads, k.heads) < 1e-5
        assert rel(expanded, k.output) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_decode_step_matches(family):
    """One query against a longer cache (decode), not only the square prefill case."""
    model = tiny_model(family)
    layers = describe(model)
    ids = torch.randint(0, 128, (1, 9))
    full = capture(model, layers, ids)
    for layer in layers:
        k = full[layer.cache_idx]
        attn = attention_module(model, layer)
        pe = tuple(t[:, -1:] for t in k.position_embeddings) if isinstance(k.position_embeddings, tuple) \
            else k.position_embeddings[:, -1:]
        out, _ = attention_from_cache(attn, layer, k.hidden[:, -1:], pe, k.c, k.k_pe, positions=k.positions[:, -1:])
        assert rel(out, k.output[:, -1:]) < 1e-5


def test_wrong_rope_layout_is_detected():
    """The reference depends on the adapter's pair layout: a wrong style must not match (the test can fail)."""
    model = tiny_model("deepseek_v3")
    layer = describe(model)[0]
    wrong = dataclasses.replace(layer, rope_style="half")
    k = capture(model, [layer], torch.randint(0, 128, (1, 10)))[layer.cache_idx]
    out, _ = attention_from_cache(attention_module(model, layer), wrong, k.hidden, k.position_embeddings, k.c, k.k_pe)
    assert rel(out, k.output) > 1e-3


def test_descriptions():
    by = {f: describe(tiny_model(f)) for f in FAMILIES}
    assert by["deepseek_v2"][0].rope_style == "complex" and by["deepseek_v2"][0].q_path == "q_proj"
    assert by["deepseek_v3"][0].rope_style == "interleave" and by["deepseek_v3"][0].q_path == "q_a_q_b"
    assert by["deepseek_v3_halfsplit"][0].rope_style == "half"
    assert by["minicpm3"][0].rope_dim == 8 and by["minicpm3"][0].rope_style == "half"
    longcat = by["longcat_flash"]
    assert [layer.cache_idx for layer in longcat] == [0, 1, 2, 3]  # two attentions per decoder layer
    assert longcat[0].latent_scale == pytest.approx((64 / 32) ** 0.5)
    v3 = by["deepseek_v3"][0]
    assert v3.weight_pairs[1] == (2, 3) and v3.cache_pairs[1] == (1, 1 + v3.rope_dim // 2)
    assert dataclasses.replace(by["axk1"][0], model_type="deepseek_v3") == v3  # V3's attention, always q LoRA
    mistral4 = by["mistral4"][0]
    assert (mistral4.query_pos_beta, mistral4.query_pos_max) == (0.5, 32) and mistral4.rope_style == "interleave"
    assert all(layer.query_pos_beta == 0 for f in FAMILIES if f != "mistral4" for layer in by[f])


def test_non_mla_model_is_rejected(tmp_path):
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg)
    with pytest.raises(UnsupportedModelError, match="'llama' is not a supported MLA family; supported: axk1, deep"):
        describe(model)
    model.save_pretrained(tmp_path / "llama")
    with pytest.raises(UnsupportedModelError, match="'llama'"):
        load_model(tmp_path / "llama")


def test_checkpoint_dir_round_trip_and_errors(tmp_path):
    path = save_tiny_model("deepseek_v3", tmp_path / "v3")
    assert describe(path) == describe(tiny_model("deepseek_v3"))  # meta-device describe reads only config
    model = load_model(path)
    assert rel(model(torch.arange(8)[None]).logits, tiny_model("deepseek_v3")(torch.arange(8)[None]).logits) < 1e-6
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "empty")
    (tmp_path / "v3" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_model(path)


def test_weights_transformers_cannot_read_are_refused_by_name(tmp_path):
    """Weights only in another layout (Mistral's consolidated.safetensors) were transformers' OSError traceback;
    a sharded checkpoint's index cut short a JSON error naming no file, or without its weight_map a KeyError."""
    import json
    import shutil

    from quantmla.calibrate.streaming import ShardReader

    path = save_tiny_model("deepseek_v3", tmp_path / "v3")
    (path / "model.safetensors").rename(path / "consolidated.safetensors")
    with pytest.raises(FileNotFoundError, match="no weights that transformers reads .*; consolidated.safetensors is"):
        load_model(path)
    shutil.rmtree(path)
    tiny_model("deepseek_v3").save_pretrained(path, max_shard_size="200KB")
    index = path / "model.safetensors.index.json"
    text = index.read_text()
    for broken, error in ((text[:100], "model.safetensors.index.json is not valid JSON"),
                          (json.dumps({"metadata": {}}), "model.safetensors.index.json has no weight_map")):
        index.write_text(broken)
        for read in (load_model, ShardReader):
            with pytest.raises(ValueError, match=error):
                read(path)


def test_a_model_type_that_is_no_name_is_refused_in_one_line(tmp_path):
    import json

    path = save_tiny_model("deepseek_v3", tmp_path / "v3")
    config = json.loads((path / "config.json").read_text())
    for model_type in (5, None):
        (path / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
        with pytest.raises(UnsupportedModelError, match=f"^model_type {model_type} in .* is not a supported MLA"):
            load_model(path, meta=True)


def test_unreadable_config_is_a_one_line_error(tmp_path, capsys):
    from quantmla.cli import main

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path / "bad")
    for command in ("info", "eval"):  # eval reads the quantmla section first, with json itself
        assert main([command, str(tmp_path / "bad")]) == 2
        assert "config.json" in capsys.readouterr().err


def _retyped(tmp_path, model_type: str):
    """A tiny DeepSeek-V3 checkpoint whose config.json declares `model_type` and, as Kimi K2's does, an
    auto_map to its own code."""
    import json

    path = save_tiny_model("deepseek_v3", tmp_path / model_type)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type=model_type, architectures=["DeepseekV3ForCausalLM"],
               auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                         "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_model_type_without_a_transformers_class_is_refused_by_name(tmp_path):
    """A checkpoint needing its own code (a model_type transformers has no class for, with an auto_map)
    gets the supported-families refusal, not transformers' trust_remote_code request (or its prompt)."""
    from quantmla.calibrate.streaming import skeleton

    path = _retyped(tmp_path, "mla_custom")
    for load in (load_model, skeleton):
        with pytest.raises(UnsupportedModelError, match="'mla_custom'.*supported: axk1, deepseek_v2"):
            load(path)


def test_kimi_k2_checkpoints_load_as_deepseek_v3(tmp_path):
    """Kimi K2 declares model_type kimi_k2 with DeepSeek-V3's architecture and its own code: quantmla reads
    it with transformers' DeepSeek-V3 classes (no checkpoint code) and computes the same logits."""
    from quantmla.calibrate.streaming import skeleton

    path = _retyped(tmp_path, "kimi_k2")
    ref = load_model(path)
    ids = torch.randint(0, ref.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    want = tiny_model("deepseek_v3")(ids).logits
    torch.testing.assert_close(ref(ids).logits, want)
    assert ref.config.model_type == "deepseek_v3" and not hasattr(ref.config, "auto_map")
    assert skeleton(path).config.model_type == "deepseek_v3"
    assert len(describe(path)) == ref.config.num_hidden_layers


def test_tokenizer_that_needs_its_own_code_is_a_clear_error(tmp_path):
    """Kimi K2 ships a tiktoken tokenizer behind an auto_map to its own code, which quantmla does not run;
    transformers then builds an empty tokenizer without failing. quantmla refuses it, naming the remedy."""
    import json

    from quantmla.data import tokenizer_for

    path = _retyped(tmp_path, "kimi_k2")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "TikTokenTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}))
    (path / "tiktoken.model").write_text("")
    with pytest.raises(ValueError, match="could not build a tokenizer.*tokenizer.json"):
        tokenizer_for(path)  # the config.json's auto_map: transformers asks for the code
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TikTokenTokenizer"}))
    config = json.loads((path / "config.json").read_text())
    del config["auto_map"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vocabulary of [01];.*tokenizer.json"):
        tokenizer_for(path)  # no auto_map at all: transformers builds an empty tokenizer


def test_kimi_k2_checkpoint_with_a_tokenizer_json_gets_its_tokenizer(tmp_path):
    """The remedy for Kimi K2's tiktoken tokenizer, a tokenizer.json saved beside the weights, works: the
    tokenizer loads although transformers cannot read the kimi_k2 config.json (its auto_map) on its own; its
    fallback fails on Kimi K2's RoPE settings (rope_scaling, rope_theta)."""
    import json
    import shutil

    from quantmla.data import default_model_dir, tokenizer_for

    path = _retyped(tmp_path, "kimi_k2")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["rope_parameters"]
    cfg.update(rope_theta=50000.0, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                                 "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 1.0, "beta_slow": 1.0})
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_model(path).config.rope_parameters["rope_type"] == "yarn"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, path / name)
    want = tokenizer_for(default_model_dir())
    assert tokenizer_for(path).encode("def main():") == want.encode("def main():")


def test_a_checkpoint_missing_a_weight_is_refused_not_filled_with_random_values(tmp_path):
    """transformers initialises a weight the files lack at random and only logs it; load_model refuses."""
    from safetensors.torch import load_file, save_file

    src = save_tiny_model("deepseek_v3", tmp_path / "m")
    load_model(src)  # complete: loads
    shard = next(src.glob("*.safetensors"))
    tensors = load_file(shard)
    name = next(k for k in tensors if "kv_a_proj_with_mqa" in k)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"1 weight\\(s\\) missing in the checkpoint, e.g. {name}"):
        load_model(src)


def _edit_config(path, **fields):
    import json

    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


def test_an_invalid_config_setting_is_a_one_line_error_naming_the_file(tmp_path, capsys):
    """transformers' config classes validate fields with a multi-line error naming no file (it escaped the
    CLI as a traceback): it becomes a ValueError naming config.json and the setting."""
    from quantmla.cli import main

    path = save_tiny_model("deepseek_v2", tmp_path / "m")
    good = (path / "config.json").read_text()
    capsys.readouterr()
    for fields, match in (({"kv_lora_rank": None}, "kv_lora_rank"), ({"qk_rope_head_dim": 15}, "even rotary")):
        (path / "config.json").write_text(good)
        _edit_config(path, **fields)
        with pytest.raises(ValueError, match=f"config.json holds an invalid setting: .*{match}"):
            describe(path)
        assert main(["info", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and match in err


def test_unreadable_or_misshapen_weights_are_refused_by_name(tmp_path, capsys):
    """A truncated safetensors file, or weights of another shape than config.json describes, are one-line
    errors naming the file or weight, in memory and streaming (both were tracebacks from the loaders)."""
    from quantmla.calibrate.streaming import ShardReader
    from quantmla.cli import main

    path = save_tiny_model("deepseek_v3", tmp_path / "m")
    _edit_config(path, kv_lora_rank=16)  # the weights are of kv_lora_rank 32
    with pytest.raises(ValueError, match=r"another shape than config.json describes, e.g. .*: \[.*\] in the checkpoint"):
        load_model(path)
    base = ["calibrate", str(path), "--samples", "3", "--length", "64", "--recent", "16", "--steps", "1"]
    assert main(base + ["--streaming", "--out", str(tmp_path / "o1")]) == 2
    assert "in the checkpoint but" in capsys.readouterr().err
    shard = next(path.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-100])
    for load in (load_model, ShardReader):
        with pytest.raises(ValueError, match=f"{shard.name} is not a readable safetensors file"):
            load(path)
    for streaming in ([], ["--streaming"]):
        assert main(base + streaming + ["--out", str(tmp_path / "o2")]) == 2
        assert "is not a readable safetensors file" in capsys.readouterr().err


def test_shards_without_their_index_are_refused_by_name(tmp_path, capsys):
    """Shards but no model.safetensors.index.json (a write or copy cut short: save_pretrained writes the index
    after the shards): transformers' OSError came as a traceback from every command that loads weights."""
    from quantmla.cli import main

    path = tmp_path / "m"
    tiny_model("deepseek_v3").save_pretrained(path, max_shard_size="100KB")
    (path / "model.safetensors.index.json").unlink()
    with pytest.raises(FileNotFoundError, match="model-00001-of-.*but no model.safetensors.index.json"):
        load_model(path)
    assert main(["calibrate", str(path), "--out", str(tmp_path / "o"), "--samples", "3", "--length", "64"]) == 2
    assert "no model.safetensors.index.json" in capsys.readouterr().err


def test_streaming_refuses_a_layer_missing_a_weight(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from quantmla.cli import main

    path = save_tiny_model("deepseek_v3", tmp_path / "m")
    shard = next(path.glob("*.safetensors"))
    tensors = load_file(shard)
    del tensors["model.layers.1.self_attn.kv_b_proj.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    assert main(["calibrate", str(path), "--streaming", "--samples", "3", "--length", "64", "--recent", "16",
                 "--steps", "1", "--out", str(tmp_path / "o")]) == 2
    assert "layer 1's tensors do not match the model: lacks ['self_attn.kv_b_proj.weight']" in capsys.readouterr().err


def test_calibrate_refuses_a_quantized_checkpoint_before_any_work(tmp_path, capsys):
    """An FP8 checkpoint (DeepSeek-V3's quantization_config) loads dequantized on a CPU, but the folded weights
    cannot be saved in its format: in memory calibration failed at the very end ('Undefined Operation
    encountered!'), streaming with a traceback. Both refuse it first."""
    from quantmla.cli import main

    path = save_tiny_model("deepseek_v3", tmp_path / "m")
    _edit_config(path, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                            "weight_block_size": [128, 128]})
    for streaming in ([], ["--streaming"]):
        assert main(["calibrate", str(path), *streaming, "--samples", "3", "--length", "64", "--recent", "16",
                     "--steps", "1", "--out", str(tmp_path / "o")]) == 2
        assert "holds quantized weights (quantization_config, quant_method 'fp8')" in capsys.readouterr().err
        assert not (tmp_path / "o").exists()


def test_an_fp8_checkpoint_as_published_is_refused_by_every_command_that_reads_its_weights(tmp_path, capsys):
    """DeepSeek-V3's FP8 weights (128 x 128 blocks, one weight_scale_inv per block): on a CPU transformers'
    dequantization failed on kv_a_proj_with_mqa, whose kv_lora_rank + rope rows (576) are no multiple of a
    block, and eval, analyze and serve printed a page of loading report and traceback. They refuse it in one
    line, as calibrate does; info (no weights read) still describes it."""
    from safetensors.torch import load_file, save_file

    from quantmla.cli import main

    path = tmp_path / "m"
    tiny_model("deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64).save_pretrained(path)
    weights = load_file(path / "model.safetensors")
    for name, w in list(weights.items()):
        if w.dim() == 2 and not any(n in name for n in ("embed", "lm_head", "mlp.gate.")):
            weights[name] = w.to(torch.float8_e4m3fn)  # |w| < 448: a scale of 1 in every block
            weights[name + "_scale_inv"] = torch.ones(-(-w.shape[0] // 128), -(-w.shape[1] // 128))
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    _edit_config(path, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                            "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match="holds FP8 weights in blocks .*convert the checkpoint to bf16 first"):
        load_model(path)
    assert main(["eval", str(path), "--method", "rtn", "--tasks", "kl", "--lengths", "64", "--windows", "1"]) == 2
    assert "holds FP8 weights in blocks (quantization_config, quant_method 'fp8'" in capsys.readouterr().err
    assert len(describe(path)) == 3


def test_a_tokenizer_past_the_models_vocabulary_is_a_clear_error(tmp_path, capsys):
    """A checkpoint whose tokenizer gives ids its embedding does not have (here the shipped byte-level
    tokenizer, 259 ids, beside a 64-token model) failed in the forward with 'index out of range in self'."""
    import shutil

    from quantmla.cli import main
    from quantmla.data import default_model_dir, encode, tokenizer_for
    from quantmla.eval.retrieval import Codec

    path = tmp_path / "m"
    tiny_model("deepseek_v3", vocab_size=64).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, path / name)
    tok = tokenizer_for(path)
    for encoded in (lambda: encode("a needle: 1234", tok, 64), lambda: Codec(tok, 64).encode_prompt("x"),
                    lambda: Codec(tok, 64).encode_answer("x")):
        with pytest.raises(ValueError, match="vocabulary has 64 tokens: the tokenizer does not belong"):
            encoded()
    assert encode("a needle", tok, 259).max() < 259  # the tokenizer's own model is fine
    assert main(["calibrate", str(path), "--samples", "3", "--length", "64", "--recent", "16", "--steps", "1",
                 "--out", str(tmp_path / "o")]) == 2
    assert "the tokenizer does not belong to these weights" in capsys.readouterr().err


def test_damaged_weights_and_tokenizer_files_are_one_line_errors(tmp_path):
    """A truncated shard and a tokenizer.json that is not JSON or not a tokenizer gave safetensors' / transformers'
    tracebacks (KeyError 'added_tokens'), or an error naming no file."""
    from quantmla.data import tokenizer_for

    src = save_tiny_model("deepseek_v3", tmp_path / "m")
    shard = next(src.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ValueError, match=f"{shard.name} is not a readable safetensors file"):
        load_model(src)
    for text in ('{"x": 1}', "not json{"):
        (src / "tokenizer.json").write_text(text)
        with pytest.raises(ValueError, match=f"could not read the tokenizer files in {src}"):
            tokenizer_for(src)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rope_dim", [8, 32])
def test_tiny_models_take_another_rope_dim(family, rope_dim):
    """`tiny_model(family, qk_rope_head_dim=...)` builds a model that runs and caches k_pe of that width
    (LongCat's fixed head_dim, its rotary width, failed every rope dim but 16 in the forward)."""
    from transformers import DynamicCache

    model = tiny_model(family, qk_rope_head_dim=rope_dim)
    cache = DynamicCache()
    model(torch.randint(0, 128, (1, 5)), past_key_values=cache)
    assert cache.layers[0].values.shape[-1] == rope_dim


@pytest.mark.parametrize("model_type, why", [
    *((t, "uses DeepSeek Sparse Attention \\(an indexer selects the keys each query sees\\)")
      for t in ("deepseek_v32", "glm_moe_dsa", "axk2", "hy_v4", "glm5_next")),
    ("kimi_linear", "mixes MLA layers with linear-attention"),
])
def test_mla_families_quantmla_does_not_run_are_refused_saying_why(tmp_path, model_type, why):
    """transformers runs these MLA models, but their attention is not one quantmla serves: the refusal names
    the reason on one line (glm5_next by its text model, glm5_next_text)."""
    from transformers import AutoConfig

    AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=f"model_type '{model_type}(_text)?' in .* {why}.*, which "
                                                    "quantmla does not support; supported: axk1, deepseek_v2") as e:
        describe(tmp_path)
    assert "\n" not in str(e.value)


def test_mistral4_text_checkpoints_load_with_transformers_classes(tmp_path):
    """transformers 5.19 has Mistral4ForCausalLM but no AutoModelForCausalLM entry for mistral4 (its released
    checkpoints are multimodal, mistral3 around it: tests/test_multimodal.py): a text-only checkpoint loads all
    the same, as its own class."""
    path = save_tiny_model("mistral4", tmp_path / "m")
    model = load_model(path)
    assert type(model).__name__ == "Mistral4ForCausalLM" and len(describe(path)) == 2
    ids = torch.randint(0, 128, (1, 40))
    torch.testing.assert_close(model(ids).logits, tiny_model("mistral4")(ids).logits)


def test_minicpm3_longrope_without_factor_as_published_loads(tmp_path):
    """MiniCPM3-4B's config.json gives its longrope short/long factors and original_max_position_embeddings
    (= max_position_embeddings) but no `factor`; transformers' MiniCPM3 attention reads that key for any rope
    type but the default one, so every command failed with a KeyError 'factor' traceback. quantmla supplies
    the factor transformers' rope code derives (max_position_embeddings / original_max_position_embeddings)."""
    import json

    from quantmla.calibrate.streaming import skeleton

    path = save_tiny_model("minicpm3", tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    half = cfg["qk_rope_head_dim"] // 2
    cfg.pop("rope_parameters", None)
    cfg.update(rope_theta=10000.0, rope_scaling={"type": "longrope", "original_max_position_embeddings": 512,
                                                 "short_factor": [1.0 + 0.5 * i for i in range(half)],
                                                 "long_factor": [2.0 + 0.5 * i for i in range(half)]})
    (path / "config.json").write_text(json.dumps(cfg))
    model = load_model(path)
    assert model.config.rope_parameters["factor"] == 1.0 and skeleton(path) is not None
    assert [layer.mscale for layer in describe(path)] == pytest.approx([1.0] * cfg["num_hidden_layers"])
    ref = tiny_model("minicpm3")  # the same weights with the plain default RoPE: the short factors move logits
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(model(ids).logits, ref(ids).logits)
