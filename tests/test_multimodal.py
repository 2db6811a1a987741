"""Multimodal checkpoints around an MLA language model (Mistral Small 4: mistral3 around mistral4; Kimi K2.5:
kimi_k25 around deepseek_v3): quantmla reads the language model alone, as a text-only causal LM of its family,
from either layout of the text weights, and writes a text-only checkpoint of that family."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from quantmla.calibrate.streaming import ShardReader
from quantmla.cli import main
from quantmla.models import UnsupportedModelError, describe, load_model
from quantmla.models.adapters import check_unquantized, multimodal
from quantmla.models.tiny import save_tiny_model, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = {"mistral3": "mistral4", "kimi_k25": "deepseek_v3"}
CAUSAL_LM = {"mistral3": "Mistral4ForCausalLM", "kimi_k25": "DeepseekV3ForCausalLM"}
# Small vision towers; Kimi K2.5 as released does not tie its head (mistral3's default ties it).
SETTINGS = {
    "mistral3": dict(vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, head_dim=16, image_size=32, patch_size=8)),
    "kimi_k25": dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                        patch_size=8, pos_emb_height=4, pos_emb_width=4),
                     projection_hidden_size=32, tie_word_embeddings=False),
}


def _multimodal_model(kind, **text):
    """transformers' own multimodal model of `kind` around a tiny MLA text model, random, eager attention."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from quantmla.models.adapters import register_causal_lms

    register_causal_lms()
    config = AutoConfig.for_model(kind, text_config=tiny_config(TEXT[kind], **text).to_dict(), **SETTINGS[kind])
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # random init leaves RMSNorm weights at 1
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(1 + 0.2 * torch.randn_like(p))
    return model.eval()


# The text weights' names in either layout (save_pretrained writes the older one, and for kimi_k25 in 5.19 its
# decoder layers as `blocks`, the reverse of its vision tower's renaming).
LAYOUTS = {"legacy": {"language_model.model.blocks.": "language_model.model.layers."},
           "v5": {"language_model.model.blocks.": "model.language_model.layers.",
                  "language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head."}}


def _save(model, path, layout="legacy", **kw):
    """save_pretrained, then the text weights renamed into `layout`: "legacy" (language_model.model.layers...,
    language_model.lm_head, as Kimi K2.5 is released) or "v5" (model.language_model.layers..., lm_head: the
    multimodal model's own names); experts stay as save_pretrained writes them."""
    model.save_pretrained(path, **kw)

    def rename(key):
        for src, dst in LAYOUTS[layout].items():
            if key.startswith(src):
                return dst + key[len(src):]
        return key

    for file in path.glob("*.safetensors"):
        save_file({rename(k): v for k, v in load_file(file).items()}, file, metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {rename(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data))
    names = ShardReader(path).weight_map
    assert any(n.startswith("language_model.model.layers." if layout == "legacy" else "model.language_model.layers.")
               for n in names)
    return path


@pytest.mark.parametrize("layout", ["legacy", "v5"])
@pytest.mark.parametrize("kind", ["mistral3", "kimi_k25"])
def test_the_language_model_of_a_multimodal_checkpoint_loads_as_a_text_causal_lm(tmp_path, kind, layout, caplog):
    """Refused by name before ('wraps a ... language model'), so the released checkpoints could not be used."""
    full = _multimodal_model(kind)
    path = _save(full, tmp_path / "m", layout)
    model = load_model(path)
    assert type(model).__name__ == CAUSAL_LM[kind] and model.config.model_type == TEXT[kind]
    assert not any("vision" in n or "projector" in n for n in model.state_dict())  # the vision tower not read
    assert "LOAD REPORT" not in caplog.text  # transformers' table of every vision weight it did not load
    ids = torch.randint(0, 128, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, full(input_ids=ids).logits, rtol=0, atol=1e-5)
    layers = describe(path)
    assert [layer.module for layer in layers] == [f"model.layers.{i}.self_attn" for i in range(len(layers))]
    assert {layer.model_type for layer in layers} == {TEXT[kind]} and len(layers) >= 2


@pytest.mark.parametrize("kind", ["mistral3", "kimi_k25"])
def test_calibrate_writes_the_language_model_as_a_text_only_checkpoint(tmp_path, kind, capsys):
    """In memory and --streaming: the same text-only checkpoint of the text family (its config, its names),
    which load_model reads back; the streaming source is sharded, in the older layout."""
    src = _save(_multimodal_model(kind), tmp_path / "src", max_shard_size="20KB")
    assert (src / "model.safetensors.index.json").is_file()
    base = ["calibrate", str(src), "--samples", "3", "--length", "64", "--recent", "16", "--steps", "1"]
    for out, streaming in ((tmp_path / "mem", []), (tmp_path / "str", ["--streaming"])):
        assert main([*base, "--out", str(out), *streaming]) == 0
        said = capsys.readouterr().out.replace("\n", " ")
        assert f"is a multimodal {kind} checkpoint" in said and f"holds its {TEXT[kind]} language model alone" in said
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == TEXT[kind] and config["architectures"] == [CAUSAL_LM[kind]]
        assert "text_config" not in config and "vision_config" not in config and multimodal(out) is None
    mem, got = (ShardReader(d).read(ShardReader(d).weight_map) for d in (tmp_path / "mem", tmp_path / "str"))
    assert set(got) == set(mem) and all(k.startswith(("model.", "lm_head.")) for k in got)
    assert not any("vision" in k or "projector" in k or "language_model" in k for k in got)
    unequal = [k for k in mem if not torch.equal(mem[k], got[k])]
    assert not unequal, unequal[:5]
    ids = torch.randint(0, 128, (1, 40))
    with torch.no_grad():
        a, b = (load_model(d)(ids).logits for d in (tmp_path / "mem", tmp_path / "str"))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["legacy", "v5"])
def test_a_multimodal_checkpoint_missing_a_text_weight_is_refused(tmp_path, layout, capsys):
    path = _save(_multimodal_model("mistral3"), tmp_path / "m", layout)
    file = path / "model.safetensors"
    tensors = load_file(file)
    gone = next(k for k in tensors if k.endswith("layers.1.self_attn.kv_b_proj.weight"))
    del tensors[gone]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="1 weight\\(s\\) missing in the checkpoint, e.g. "
                                         "model.layers.1.self_attn.kv_b_proj.weight"):
        load_model(path)
    assert main(["calibrate", str(path), "--streaming", "--samples", "3", "--length", "64", "--recent", "16",
                 "--steps", "1", "--out", str(tmp_path / "o")]) == 2
    assert "layer 1's tensors do not match the model: lacks ['self_attn.kv_b_proj.weight']" in capsys.readouterr().err


def test_a_multimodal_checkpoint_without_its_language_model_is_refused_naming_where_it_looked(tmp_path):
    path = _save(_multimodal_model("kimi_k25"), tmp_path / "m", "legacy")
    file = path / "model.safetensors"
    save_file({k: v for k, v in load_file(file).items() if not k.startswith("language_model.")}, file,
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{path}: no weight of its deepseek_v3 language model found \\(looked for "
                                         "names under model.language_model, lm_head, as transformers' Kimi_K25ForConditionalGeneration"):
        load_model(path)


def test_a_multimodal_model_around_a_text_model_that_is_not_mla_is_refused_by_name(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("mistral3", text_config={"model_type": "mistral"}).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="model_type 'mistral' in .* is not a supported MLA family"):
        describe(tmp_path)


def test_a_quantized_multimodal_checkpoint_is_refused_for_calibration(tmp_path):
    """Kimi K2.5's INT4 experts (compressed-tensors): the quantization_config sits in its text_config."""
    path = _save(_multimodal_model("kimi_k25"), tmp_path / "m", "legacy")
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="holds quantized weights \\(quantization_config, quant_method "
                                         "'compressed-tensors'\\)"):
        check_unquantized(path)


def test_a_multimodal_checkpoints_vision_weights_are_not_read(tmp_path, monkeypatch):
    """The streaming reader opens only the language model's tensors."""
    path = _save(_multimodal_model("mistral3"), tmp_path / "m", "legacy")
    reader = ShardReader(path)
    reader.rename(multimodal(path).text_names(reader.weight_map))
    with safe_open(path / "model.safetensors", "pt") as f:
        vision = [k for k in f.keys() if not k.startswith("language_model.")]
    assert vision and not set(vision) & set(reader.stored.values())
    assert set(reader.read(reader.weight_map)) == set(reader.weight_map)


def test_info_says_it_reads_the_language_model_of_a_multimodal_checkpoint(tmp_path, capsys):
    path = _save(_multimodal_model("kimi_k25"), tmp_path / "m", "v5")
    assert main(["info", str(path), "--json", str(tmp_path / "i.json")]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "the language model of a multimodal kimi_k25 checkpoint" in said and "as DeepseekV3ForCausalLM" in said
    assert json.loads((tmp_path / "i.json").read_text())["multimodal"] == "kimi_k25"
    assert main(["info", str(save_tiny_model("deepseek_v3", tmp_path / "t")), "--json", str(tmp_path / "t.json")]) == 0
    assert "multimodal" not in capsys.readouterr().out
    assert json.loads((tmp_path / "t.json").read_text())["multimodal"] is None


def test_kimi_k25_as_released_names_its_text_model_kimi_k2_and_carries_auto_maps(tmp_path):
    """Kimi K2.5's config.json says model_type kimi_k2 in its text_config (transformers reads that as deepseek_v3)
    and points at its own code (auto_map): read as deepseek_v3, and no auto_map goes into what quantmla writes."""
    full = _multimodal_model("kimi_k25")
    path = _save(full, tmp_path / "m", "legacy")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["KimiK25ForConditionalGeneration"]
    config["auto_map"] = {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                          "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"}
    config["text_config"].update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    (path / "config.json").write_text(json.dumps(config))
    model = load_model(path)
    assert model.config.model_type == "deepseek_v3" and "auto_map" not in model.config.to_dict()
    ids = torch.randint(0, 128, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, full(input_ids=ids).logits, rtol=0, atol=1e-5)
    assert {layer.model_type for layer in describe(path)} == {"deepseek_v3"}
