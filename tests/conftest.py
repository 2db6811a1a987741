import warnings

import pytest
import torch

# transformers 5.2x warns about the deprecated `past_key_values` spelling; older releases only know it.
warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
