import os

import pyro
import pytest
import torch

# Small models run many times faster on one thread on a shared 2-core machine.
torch.set_num_threads(int(os.environ.get("PYRO_IMPLICIT_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _pyro_state():
    """Fresh parameter store, validation on, float64 and a fixed seed for every test."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    pyro.clear_param_store()
    pyro.enable_validation(True)
    pyro.set_rng_seed(int(os.environ.get("PYRO_IMPLICIT_TEST_SEED", "0")))
    yield
    torch.set_default_dtype(dtype)
