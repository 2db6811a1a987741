import warnings

import pytest
import torch

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
