"""The random streams left as a caller had them.

Checks, structure reads and searches run the model, which draws from Pyro's global
streams (torch, Python's ``random``, NumPy). Inside :func:`random_streams_kept` they
leave those streams as they found them, so a fit draws the same with them as without.
"""

import contextlib

import pyro

__all__ = ["random_streams_kept"]


@contextlib.contextmanager
def random_streams_kept(seed=None):
    """Run the block and put Pyro's random streams back as they were (``seed``: seed
    them first with :func:`pyro.set_rng_seed`, for a block whose draws must not depend on
    what ran before)."""
    state = pyro.util.get_rng_state()
    try:
        if seed is not None:
            pyro.set_rng_seed(seed)
        yield
    finally:
        pyro.util.set_rng_state(state)
