"""What keeps `quantmla eval` practical at long contexts: no full-vocabulary logits for unscored positions,
and an attention that never holds the [batch, heads, L, L] scores (the serving forward for the method, SDPA
rather than eager for the reference)."""

import pytest
import torch

from quantmla.cli import main
from quantmla.config import CacheConfig
from quantmla.eval import retrieval
from quantmla.eval.perplexity import score_window, window_stats
from quantmla.models import load_model
from quantmla.models.tiny import save_tiny_model, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

RTN = CacheConfig("int4", "int4", sink=4, recent=16).fit(32, 16)  # the tiny models' kv_lora_rank / rope dims


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model("deepseek_v3", tmp_path_factory.mktemp("tiny") / "model")


def _lm_head_rows(model):
    """Positions the lm_head is applied to, per call (a forward hook on the output embedding)."""
    rows = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, i, o: rows.append(o.shape[-2]))
    return rows, handle


def test_scoring_applies_lm_head_to_scored_positions_only():
    model = tiny_model("deepseek_v3")
    windows = torch.randint(0, 128, (2, 96), generator=torch.Generator().manual_seed(3))
    rows, handle = _lm_head_rows(model)
    try:
        window_stats(model, windows, 40, RTN, batch=2, progress=False)
    finally:
        handle.remove()
    # serving forward: the 40 scored positions; reference forward: logits_to_keep = 41
    assert rows == [40, 41], rows


def test_sdpa_scores_as_eager(tiny_dir):
    """The scorer replaces the attention either way: the same log-probabilities and needle answers whichever
    implementation the model was loaded with (which then serves the BF16 reference)."""
    eager, sdpa = load_model(tiny_dir, attn="eager"), load_model(tiny_dir, attn="sdpa")
    assert sdpa.config._attn_implementation == "sdpa"
    windows = torch.randint(0, 128, (2, 96), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(score_window(sdpa, windows, 40, RTN), score_window(eager, windows, 40, RTN),
                               atol=1e-4, rtol=1e-4)
    codec, samples = retrieval.Codec(None, 128), retrieval.samples_for("single", 100, 2)
    assert retrieval.accuracy(sdpa, RTN, codec, samples) == retrieval.accuracy(eager, RTN, codec, samples)
    assert sdpa.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"


def _largest_square_softmax(monkeypatch) -> list[int]:
    """Record the largest L such that a softmax ran over [..., L, L] scores (eager attention does)."""
    seen = [0]
    real = torch.nn.functional.softmax

    def softmax(x, *args, **kwargs):
        if x.dim() >= 2 and x.shape[-1] == x.shape[-2]:
            seen[0] = max(seen[0], x.shape[-1])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax)
    return seen


@pytest.mark.parametrize("attn, holds_scores", [(None, False), ("eager", True)])
def test_cli_eval_holds_no_attention_scores(tiny_dir, monkeypatch, attn, holds_scores):
    seen = _largest_square_softmax(monkeypatch)
    argv = ["eval", str(tiny_dir), "--method", "rtn", "--tasks", "ppl,kl,niah", "--lengths", "256",
            "--samples", "1", "--scored", "16"]
    assert main(argv + (["--attn", attn] if attn else [])) == 0
    assert (seen[0] >= 240) == holds_scores, seen  # the prefills are 240 (ppl) and ~256 (niah) tokens long
