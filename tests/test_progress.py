"""Progress bars refresh rarely where they are written to a log, as usual on a terminal."""

import io
import sys

import pytest

from pyro_implicit.progress import LOG_INTERVAL, refresh_intervals


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def no_notebook(monkeypatch):
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)


def test_a_log_file_gets_rare_refreshes_and_a_terminal_the_default(no_notebook):
    assert refresh_intervals(io.StringIO()) == {
        "mininterval": LOG_INTERVAL,
        "maxinterval": LOG_INTERVAL,
    }
    assert refresh_intervals(_Terminal()) == {}


def test_a_notebook_stream_counts_as_seen_live(monkeypatch):
    monkeypatch.setitem(sys.modules, "ipykernel", object())
    assert refresh_intervals(io.StringIO()) == {}


def test_the_library_bars_use_it(no_notebook, monkeypatch):
    from pyro_implicit.latent import _with_progress

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a redirected stderr
    _, bar = _with_progress(lambda u, full_data=True: None)
    try:
        assert bar.mininterval == LOG_INTERVAL
    finally:
        bar.close()


def test_nuts_in_a_log_writes_a_line_per_chain(no_notebook, monkeypatch):
    # Pyro's NUTS bar (no refresh setting of ours reaches it) wrote about ten records a
    # second to a log
    import pyro
    import pyro.distributions as dist

    from pyro_implicit.diagnostics.nuts import run_nuts

    def normal():
        pyro.sample("x", dist.Normal(0.0, 1.0))

    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    run_nuts(normal, num_samples=20, warmup_steps=20, num_chains=2, seed=0)
    lines = log.getvalue().splitlines()
    assert lines == [f"NUTS chain {i}/2: 20 warmup + 20 draws" for i in (1, 2)]
