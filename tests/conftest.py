import os
import warnings

import pytest
import torch

# Without a GPU the Triton kernels run in the interpreter. It must be chosen before anything imports triton
# (lm-eval and the kernels module do, from other test files), so it is set here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# transformers 5.2x warns about the deprecated `past_key_values` spelling; older releases only know it.
warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine spinning OpenMP workers
    make them up to 100x slower. Opt in per module: pytestmark = pytest.mark.usefixtures("one_thread")."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def default_prompts() -> list[list[int]]:
    """Six short held-out windows (8-30 tokens) of the shipped default model's text, as token ids."""
    from quantmla.data import default_model_dir, encode, read_text, tokenizer_for

    ids = encode(read_text(None, "heldout.txt"), tokenizer_for(default_model_dir()), 259)
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(ids) - 200, (6,), generator=g).tolist()
    return [ids[s : s + n].tolist() for s, n in zip(starts, (12, 20, 8, 30, 16, 24))]
