import pathlib
import sys

import pytest
import torch

# The examples are documentation that tests import.
sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def dtype(request):
    return request.param


@pytest.fixture
def fresh_dynamo():
    """For tests that compile new models of the same classes: start with no cache."""
    torch._dynamo.reset()
    yield
