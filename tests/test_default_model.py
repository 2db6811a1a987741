"""The shipped default model (src/quantmla/default_model) and the needle tasks (quantmla.eval.needles)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from quantmla.eval.needles import TASKS, NeedleSample, make_sample

PKG = Path(__file__).resolve().parents[1] / "src" / "quantmla"
MODEL_DIR = PKG / "default_model"
HELDOUT = PKG / "data" / "heldout.txt"
CALIBRATION = PKG / "data" / "calibration.txt"


# ----------------------------------------------------------------------------------------------------------
# needles.py
@pytest.mark.parametrize("task", TASKS)
def test_needles_deterministic_and_exact_length(task):
    a = make_sample(task, 700, random.Random(5))
    b = make_sample(task, 700, random.Random(5))
    c = make_sample(task, 700, random.Random(6))
    assert isinstance(a, NeedleSample) and a == b and a != c
    assert a.task == task
    assert len((a.prompt + a.answer).encode()) == 700
    assert a.answer.endswith("\n") and a.answer.count("\n") == 1 and len(a.answer) <= 30
    assert a.prompt.endswith("A: ")
    assert a.prompt.isascii() and a.answer.isascii()


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("seed", range(5))
def test_needles_answer_is_in_prompt(task, seed):
    filler = (Path(__file__).read_text() * 3) if seed % 2 else None
    s = make_sample(task, 300 + 500 * seed, random.Random(seed), filler=filler)
    key = s.prompt.rsplit("Q: ", 1)[1].split(" of ", 1)[1].split("?")[0].split(",")[0]
    values = s.answer.split()
    body = s.prompt.rsplit("Q: ", 1)[0]
    needle_lines = [ln for ln in body.split("\n") if ln.startswith(key + ": ")]
    assert [ln.split(": ", 1)[1] for ln in needle_lines] == values  # every value, in order, and no other
    if task != "multivalue":
        assert len(values) == 1


def test_needles_tasks_differ():
    rng = random.Random(0)
    single = make_sample("single", 1000, rng)
    multikey = make_sample("multikey", 1000, rng)
    multivalue = make_sample("multivalue", 1000, rng)

    def n_needles(s):
        import re
        return len(re.findall(r"^[a-z]{6,7}: \d{6}$", s.prompt, flags=re.M))

    assert n_needles(single) == 1
    assert 3 <= n_needles(multikey) <= 5
    assert len(multivalue.answer.split()) >= 2
    assert "all the values" in multivalue.prompt and "all the values" not in multikey.prompt
    with pytest.raises(ValueError):
        make_sample("nope", 100, rng)


def test_needles_filler_from_text():
    text = "alpha beta gamma\n" * 400
    s = make_sample("single", 2048, random.Random(1), filler=text)
    assert "alpha beta gamma" in s.prompt
    assert len(s.prompt) + len(s.answer) == 2048


# ----------------------------------------------------------------------------------------------------------
# the checkpoint
@pytest.fixture(scope="module")
def model_and_tokenizer():
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True, attn_implementation="sdpa")
    return model.float().eval(), tok


def test_checkpoint_files():
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3"
    assert cfg["kv_lora_rank"] == 512 and cfg["qk_rope_head_dim"] == 64
    assert cfg["rope_interleave"] is True
    assert cfg["first_k_dense_replace"] >= cfg["num_hidden_layers"]  # dense: no MoE layers
    shards = list(MODEL_DIR.glob("*.safetensors"))
    assert shards and all(p.stat().st_size < 15 * 2**20 for p in shards)
    assert sum(p.stat().st_size for p in shards) < 32e6
    for p in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (MODEL_DIR / p).is_file(), p
    assert 100e3 <= HELDOUT.stat().st_size <= 300e3
    assert 80e3 <= CALIBRATION.stat().st_size <= 150e3


def test_checkpoint_loads(model_and_tokenizer):
    model, tok = model_and_tokenizer
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    c = model.config
    assert c.kv_lora_rank == 512 and c.qk_rope_head_dim == 64 and c.rope_interleave
    assert not any("experts" in n for n, _ in model.named_parameters())
    assert 10e6 < sum(p.numel() for p in model.parameters()) < 16e6
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (c.bos_token_id, c.eos_token_id,
                                                                     c.pad_token_id)
    assert model.generation_config.eos_token_id == c.eos_token_id


def test_tokenizer_is_bytes(model_and_tokenizer):
    _, tok = model_and_tokenizer
    text = "def f(x):\n\treturn x  # héllo wörld € 😀 \x00\x7f\r\n"
    raw = list(text.encode())
    assert tok(text, add_special_tokens=False).input_ids == raw  # 1 byte = 1 token, id = byte value
    ids = tok(text).input_ids
    assert ids == [tok.bos_token_id] + raw
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_heldout_loss(model_and_tokenizer):
    import torch

    model, tok = model_and_tokenizer
    text = HELDOUT.read_bytes()[:4000].decode("utf-8", errors="ignore")
    ids = tok(text, return_tensors="pt").input_ids[:, : 2 * 512 + 1]
    x = ids[:, :-1].reshape(2, 512)  # second row starts mid-text: fine for a sanity bound
    y = ids[:, 1:].reshape(2, 512)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).item()
    # uniform over 259 tokens: 5.56 nats, an untrained model is at about that; the shipped one: ~1.09 here
    assert loss < 1.6, loss
    assert math.isfinite(loss)


def test_single_needle_short(model_and_tokenizer):
    import torch

    model, tok = model_and_tokenizer
    filler = HELDOUT.read_text()
    rng = random.Random(2024)
    samples = [make_sample("single", 256, rng, filler=filler[o:o + 4000])
               for o in (rng.randrange(len(filler) - 4000) for _ in range(6))]
    x = torch.tensor([tok(s.prompt).input_ids for s in samples])  # equal lengths: no padding needed
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=7, do_sample=False)
    got = [tok.decode(o[x.shape[1]:], skip_special_tokens=True) for o in out]
    correct = sum(g.startswith(s.answer) for g, s in zip(got, samples))
    assert correct >= 5, list(zip(got, [s.answer for s in samples]))


def test_long_context_config_and_needle_at_4096(model_and_tokenizer):
    """Stage 2 of the card: RoPE base raised, positions to 16 K, and retrieval past the 2 K stage's length
    (the 2 K model was never trained beyond 2048 positions)."""
    import torch

    model, tok = model_and_tokenizer
    c = model.config
    assert c.max_position_embeddings >= 16384 and c.rope_parameters["rope_theta"] >= 1e5
    filler = HELDOUT.read_text()
    rng = random.Random(4096)
    samples = [make_sample("single", 4096, rng, filler=filler[o:o + 20000])
               for o in (rng.randrange(len(filler) - 20000) for _ in range(1))]  # one: CPU time
    x = torch.tensor([tok(s.prompt).input_ids for s in samples])
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=7, do_sample=False)
    got = [tok.decode(o[x.shape[1]:], skip_special_tokens=True) for o in out]
    assert all(g.startswith(s.answer) for g, s in zip(got, samples)), list(zip(got, [s.answer for s in samples]))


def test_encoding_a_prefix_gives_the_same_first_tokens():
    """encode(..., max_tokens=N) tokenizes only a prefix of a long text (a 63 MB --data file took 200 s and
    13 GB in full) and returns the same first N tokens as encoding all of it."""
    import torch

    from quantmla.data import default_model_dir, encode, read_text, tokenizer_for

    tok = tokenizer_for(default_model_dir())
    text = read_text(None, "heldout.txt")
    full = encode(text, tok, 300)
    for n in (1, 100, 1000):
        assert torch.equal(encode(text, tok, 300, max_tokens=n), full[:n])
    assert torch.equal(encode(text, None, 300, max_tokens=50), full.new_tensor(list(text[:50].encode())) % 300)


def test_text_that_is_not_utf8_is_used_with_a_warning(tmp_path):
    """A --data file with bytes that are not UTF-8 is read with those bytes replaced, and the user is told how
    many and where the first one is; valid UTF-8 reads silently and exactly."""
    import warnings

    import pytest

    from quantmla.data import read_text

    good = tmp_path / "good.txt"
    good.write_text("caf\u00e9 \ufffd ok", encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_text(good) == "caf\u00e9 \ufffd ok"
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9 na\u00efve".encode("latin-1"))
    with pytest.warns(UserWarning, match=r"not UTF-8 \(first bad byte at offset 3\): 2 characters"):
        assert read_text(bad) == "caf\ufffd na\ufffdve"
