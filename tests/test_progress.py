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
