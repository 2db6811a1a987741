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
