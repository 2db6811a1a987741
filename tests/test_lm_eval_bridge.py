"""The lm-eval bridge, offline: a tiny MLA model with a byte tokenizer, and the local tasks in tests/data."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ["HF_DATASETS_OFFLINE"] = "1"  # no hub: the tasks' data are the jsonl files in tests/data
os.environ["HF_HUB_OFFLINE"] = "1"
lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's HFLM needs it

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from quantmla.cache.quant_cache import QuantMLACache  # noqa: E402
from quantmla.eval.lm_eval_bridge import QuantMLALM  # noqa: E402
from quantmla.eval.serving import ServedPrefillAttention  # noqa: E402
from quantmla.models.adapters import describe  # noqa: E402
from quantmla.models.tiny import tiny_model  # noqa: E402

TASKS_DIR = Path(__file__).parent / "data" / "lm_eval_tasks"
TASKS = ["quantmla_code_mc", "quantmla_needles"]

pytestmark = pytest.mark.usefixtures("one_thread")


def byte_tokenizer():
    """256 byte tokens + <bos> (256, prepended), <eos>, <pad>: the default model's scheme, in miniature."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<bos>", "<eos>", "<pad>"])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 256)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("deepseek_v3", vocab_size=260), byte_tokenizer()


@pytest.fixture(scope="module")
def tiny_dir(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("lm_eval") / "model"
    tiny[0].save_pretrained(path)
    tiny[1].save_pretrained(path)
    return path


REQUESTS = [("def add(a, b):\n    return a", " + b"), ("x = 1\n" * 40, "y = 2\n"), ("import numpy as", " np")]


def loglikelihoods(lm) -> list[float]:
    reqs = [Instance("loglikelihood", {}, r, i) for i, r in enumerate(REQUESTS)]
    return [ll for ll, _ in lm.loglikelihood(reqs, disable_tqdm=True)]


def test_bf16_matches_plain_hflm_and_int2_changes_it(tiny):
    model, tok = tiny
    plain = loglikelihoods(HFLM(pretrained=model, tokenizer=tok, batch_size=2))
    bf16 = loglikelihoods(QuantMLALM(pretrained=model, tokenizer=tok, batch_size=2, method="bf16"))
    assert bf16 == pytest.approx(plain, abs=1e-4)
    int2 = QuantMLALM(pretrained=model, tokenizer=tok, batch_size=2, method="rtn", content="int2", rope="int2",
                      sink=0, recent=8)
    assert str(int2.cache_config.content) == "int2:32"
    changed = loglikelihoods(int2)
    assert max(abs(a - b) for a, b in zip(changed, plain)) > 1e-3


def test_loglikelihoods_are_served_and_do_not_depend_on_the_batch(tiny):
    """lm-eval right-pads a loglikelihood batch to its longest request. Through a cache quantizing what left the
    window at the end of the padded forward, a shorter row saw its last real tokens quantized (the window was
    the pads') and scored otherwise than alone. Under serving semantics every query sees its own last `recent`
    tokens in BF16, so batch_size=3 scores what batch_size=1 does, and what `quantmla eval`'s serving forward
    gives each request alone."""
    from quantmla.eval.serving import serving_logits

    model, tok = tiny
    args = dict(pretrained=model, tokenizer=tok, method="rtn", content="int2", rope="int4", sink=4, recent=8)
    one = loglikelihoods(QuantMLALM(batch_size=1, **args))
    three = QuantMLALM(batch_size=3, **args)
    assert loglikelihoods(three) == pytest.approx(one, abs=1e-5)
    context, continuation = REQUESTS[0]  # the shortest: right-padded in the batch of 3
    ctx, cont = tok(context)["input_ids"], tok(continuation, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([ctx + cont])
    logp = serving_logits(model, ids[:, :-1], three.cache_config, ids.shape[1] - 1).log_softmax(-1)
    expected = logp[0, -len(cont):].gather(-1, torch.tensor(cont)[:, None]).sum().item()
    assert one[0] == pytest.approx(expected, abs=1e-5)


def test_generation_runs_through_a_fresh_quantized_cache(tiny, monkeypatch):
    model, tok = tiny
    lm = QuantMLALM(pretrained=model, tokenizer=tok, method="rtn", content="int2", recent=16)
    seen, modules = [], []
    real = model.generate
    first = describe(model)[0].module

    def spy(*args, **kwargs):
        seen.append(kwargs.get("cache", kwargs.get("past_key_values")))
        modules.append(type(model.get_submodule(first)))  # the prompt is prefilled as served
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    context = torch.tensor([tok("some text\nQ: ")["input_ids"]])
    for _ in range(2):
        lm._model_generate(context, context.shape[1] + 3, stop=["\n"])
    assert all(isinstance(c, QuantMLACache) and c.config == lm.cache_config for c in seen)
    assert len(seen) == 2 and seen[0] is not seen[1]
    assert modules == [ServedPrefillAttention] * 2
    assert type(model.get_submodule(first)) is not ServedPrefillAttention  # and put back


def test_a_left_padded_generation_batch_generates_as_batch_size_1(tiny, monkeypatch):
    """lm-eval left-pads generation batches: the bridge tells the cache each row's padding, so batch_size=2
    generates what batch_size=1 does with INT4 and a sink of 4; untold (pads counted as 0), the shorter row's
    real sink is quantized and its generation changes (so this test can fail)."""
    import quantmla.eval.lm_eval_bridge as bridge

    model, tok = tiny
    contexts = ["def add(a, b):\n    return a", "x = 1"]
    reqs = [Instance("generate_until", {}, (c, {"until": ["\n\n"], "max_gen_toks": 12}), i)
            for i, c in enumerate(contexts)]

    def generate(batch_size):
        lm = QuantMLALM(pretrained=model, tokenizer=tok, batch_size=batch_size, method="rtn", content="int4",
                        rope="int4", sink=4, recent=2)
        return lm.generate_until(reqs, disable_tqdm=True)

    seen = []
    real = model.generate

    def spy(*args, **kwargs):
        seen.append(kwargs.get("cache", kwargs.get("past_key_values")).left_padding.tolist())
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    alone, batched = generate(1), generate(2)
    pads = len(tok(contexts[0])["input_ids"]) - len(tok(contexts[1])["input_ids"])
    assert pads > 0 and seen == [[0], [0], [0, pads]]  # lm-eval batches the longest context first
    assert batched == alone
    monkeypatch.setattr(bridge, "left_pads", lambda mask: torch.zeros(len(mask), dtype=torch.long))
    assert generate(2) != alone


def test_local_tasks_through_the_registered_model(tiny_dir):
    """Through lm-eval's own task pipeline: method bf16 reproduces lm-eval's plain `hf` model sample by sample
    (log-likelihoods of every choice, generated needles), and an INT2 cache changes the log-likelihoods."""
    def run(model, args):
        return lm_eval.simple_evaluate(
            model=model, model_args=f"pretrained={tiny_dir},device=cpu,dtype=float32" + args, tasks=TASKS,
            task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False), log_samples=True)

    def lls(out):
        return [ll for s in out["samples"]["quantmla_code_mc"] for (ll, _), in s["resps"]]

    def answers(out):
        return [s["filtered_resps"] for s in out["samples"]["quantmla_needles"]]

    plain = run("hf", "")
    bf16 = run("quantmla", ",method=bf16")
    int2 = run("quantmla", ",method=rtn,content=int2,rope=int2,sink=0,recent=8")
    assert lls(bf16) == pytest.approx(lls(plain), abs=1e-4) and answers(bf16) == answers(plain)
    assert bf16["results"]["quantmla_code_mc"]["acc,none"] == plain["results"]["quantmla_code_mc"]["acc,none"]
    assert max(abs(a - b) for a, b in zip(lls(int2), lls(plain))) > 1e-3
    assert int2["results"]["quantmla_code_mc"]["sample_len"] == 6


def test_default_model_retrieves_needles_through_lm_eval():
    out = lm_eval.simple_evaluate(
        model="quantmla", model_args="method=rtn,content=int4,rope=int4,device=cpu,dtype=float32",
        tasks=TASKS, task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False))
    assert out["results"]["quantmla_needles"]["exact_match,none"] >= 0.75
    assert out["results"]["quantmla_code_mc"]["acc,none"] >= 0.5


def test_cli_hands_its_arguments_to_lm_eval(monkeypatch):
    import lm_eval.__main__
    from lm_eval.api.registry import get_model

    from quantmla.cli import main

    seen = []
    monkeypatch.setattr(sys, "argv", sys.argv[:])  # the command rewrites sys.argv for lm-eval
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: seen.append(list(sys.argv)))
    argv = ["run", "--model", "quantmla", "--model_args", "method=rtn,content=int2", "--tasks", "x"]
    assert main(["lm-eval", *argv]) == 0
    assert seen == [["lm-eval", *argv]] and get_model("quantmla") is QuantMLALM


@pytest.mark.parametrize("model_args, error, says", [
    (dict(pretrained="/nonexistent/checkpoint"), FileNotFoundError, "model directory not found"),
    (dict(contnet="int2"), ValueError, "did you mean 'content'"),
    (dict(sink="abc"), ValueError, "sink='abc': expected a whole number"),
    (dict(recent=float("inf")), ValueError, "recent=inf: expected a whole number"),  # int() raised OverflowError
    (dict(method="quantmla", budget=True), ValueError, "budget=True: expected a number"),  # lm-eval's "true"; was 1.0
    (dict(method="rtn", budget=0.2), ValueError, "takes no byte budget"),  # budget is read, and checked
    (dict(method="quantmla", budget="abc"), ValueError, "budget='abc': expected a number"),
    (dict(recent="inf"), ValueError, "recent='inf': expected a whole number"),
    (dict(method="nope"), ValueError, "unknown method 'nope'"),
    # the shipped model's 32768 positions all in BF16: rtn would score as BF16
    (dict(method="rtn", recent=100000), ValueError, "recent 100000 BF16 tokens cover all 32768 positions"),
])
def test_bad_model_args_fail_before_the_model_loads_and_say_why(model_args, error, says):
    from quantmla.eval.lm_eval_bridge import QuantMLALM

    with pytest.raises(error, match=says):
        QuantMLALM(**model_args)


def test_checkpoints_lm_eval_cannot_run_are_refused_by_name_before_loading(tmp_path):
    """A checkpoint without a tokenizer failed inside lm-eval with a multi-line error about sentencepiece and
    slow tokenizers; a non-MLA one was loaded whole before quantmla refused it."""
    from transformers import LlamaConfig

    from quantmla.eval.lm_eval_bridge import QuantMLALM

    bare = tmp_path / "bare"
    tiny_model("deepseek_v3").save_pretrained(bare)
    with pytest.raises(ValueError, match="has no tokenizer .* model_args tokenizer=PATH"):
        QuantMLALM(pretrained=str(bare))
    llama = tmp_path / "llama"
    LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=64).save_pretrained(llama)  # a config alone: nothing is loaded
    with pytest.raises(ValueError, match="model_type 'llama' .* is not a supported MLA family"):
        QuantMLALM(pretrained=str(llama))
    fp8 = tmp_path / "fp8"  # DeepSeek-V3's FP8 weights, which transformers fails to dequantize on a CPU
    tiny_model("deepseek_v3").config.save_pretrained(fp8)
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="holds FP8 weights in blocks .* convert the checkpoint to bf16 first"):
        QuantMLALM(pretrained=str(fp8))


def test_kimi_k2_checkpoints_run_with_their_familys_classes(tiny_dir, tmp_path):
    """A kimi_k2 checkpoint (DeepSeek-V3's architecture under its own model_type, with an auto_map to its own
    code) failed in lm-eval's loader, which refuses to run a checkpoint's code; quantmla reads it as DeepSeek-V3."""
    import json
    import shutil

    kimi = tmp_path / "kimi"
    shutil.copytree(tiny_dir, kimi)
    config = json.loads((kimi / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    (kimi / "config.json").write_text(json.dumps(config))
    args = dict(method="rtn", content="int2", recent=8, device="cpu", dtype="float32")
    assert loglikelihoods(QuantMLALM(pretrained=str(kimi), **args)) == pytest.approx(
        loglikelihoods(QuantMLALM(pretrained=str(tiny_dir), **args)), abs=1e-5)


def test_a_calibrated_checkpoint_runs_with_its_own_formats_by_default(tiny):
    """As `quantmla eval`: without a method, a calibrated checkpoint is evaluated as it serves (quantmla, its own
    formats), an uncalibrated one as BF16. The bridge always took bf16, so a calibrated checkpoint measured
    unquantized unless the user knew to add method=quantmla."""
    import copy

    from quantmla.calibrate.export import mark_calibrated
    from quantmla.config import CacheConfig

    model, tok = tiny
    calibrated = copy.deepcopy(model)
    mark_calibrated(calibrated.config, CacheConfig("int2", "int4", 4, 16), {})
    lm = QuantMLALM(pretrained=calibrated, tokenizer=tok)
    assert lm.method == "quantmla" and str(lm.cache_config.content).startswith("int2")
    assert QuantMLALM(pretrained=model, tokenizer=tok).method == "bf16"


def test_a_tokenizer_not_the_weights_own_is_named():
    """model_args tokenizer=... of a larger vocabulary than the weights': an IndexError traceback from the
    embedding ('index out of range in self') instead of an error naming the tokenizer."""
    small = tiny_model("deepseek_v3", vocab_size=128)  # the byte tokenizer's ids go up to 259
    lm = QuantMLALM(pretrained=small, tokenizer=byte_tokenizer(), method="bf16")
    with pytest.raises(ValueError, match="token id .* vocabulary has 128 tokens: the tokenizer does not belong"):
        loglikelihoods(lm)
    with pytest.raises(ValueError, match="the tokenizer does not belong"):
        lm.generate_until([Instance("generate_until", {}, ("\u00e9t\u00e9", {"until": ["\n"], "max_gen_toks": 2}), 0)],
                          disable_tqdm=True)


def test_a_mistral4_checkpoint_runs_through_the_bridge(tmp_path):
    """From its directory (transformers has Mistral4ForCausalLM but no AutoModelForCausalLM entry for it; quantmla
    registers one), with Mistral 4's query factor past position 32 (the second request reaches 246): method bf16
    scores as lm-eval's plain model, an INT2 cache otherwise."""
    path = tmp_path / "m"
    model, tok = tiny_model("mistral4", vocab_size=260), byte_tokenizer()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    args = dict(pretrained=str(path), device="cpu", dtype="float32")
    bf16 = QuantMLALM(method="bf16", **args)
    assert type(bf16.model).__name__ == "Mistral4ForCausalLM"
    plain = loglikelihoods(HFLM(pretrained=model, tokenizer=tok))
    assert loglikelihoods(bf16) == pytest.approx(plain, abs=1e-4)
    int2 = loglikelihoods(QuantMLALM(method="rtn", content="int2", rope="int2", sink=0, recent=8, **args))
    assert max(abs(a - b) for a, b in zip(int2, plain)) > 1e-3


def test_a_multimodal_checkpoint_runs_through_the_bridge_as_its_language_model(tmp_path):
    """Kimi K2.5's layout (kimi_k25 around deepseek_v3, language_model.model.layers...): lm-eval's loader read it
    as a causal LM it is not; the bridge reads its language model, as quantmla's own loader does."""
    from test_multimodal import _multimodal_model, _save

    from quantmla.models import load_model

    path = _save(_multimodal_model("kimi_k25", vocab_size=260), tmp_path / "m")
    tok = byte_tokenizer()
    tok.save_pretrained(path)
    lm = QuantMLALM(pretrained=str(path), method="bf16", device="cpu", dtype="float32")
    assert type(lm.model).__name__ == "DeepseekV3ForCausalLM"
    assert loglikelihoods(lm) == pytest.approx(loglikelihoods(HFLM(pretrained=load_model(path), tokenizer=tok)),
                                               abs=1e-5)
