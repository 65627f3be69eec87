import math
import sys

import pytest
import torch

from pyro_implicit.diagnostics.memory import PeakMemory, resident_set_kb

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="peak resident set needs /proc"
)


@linux_only
def test_peak_memory_sees_a_temporary_allocation():
    # 200 MiB allocated, touched and freed inside the block: the peak must show it even
    # though the memory is gone when the block ends.
    with PeakMemory() as mem:
        t = torch.ones(200 * 2**20 // 8, dtype=torch.float64)
        del t
    assert 190 < mem.peak_mb < 260
    rss, hwm = resident_set_kb()
    assert hwm >= rss


@linux_only
def test_peak_memory_of_a_small_block_is_small():
    # freed memory of an earlier block is trimmed, so it does not count for or against the next
    with PeakMemory():
        t = torch.ones(100 * 2**20 // 8, dtype=torch.float64)
        del t
    with PeakMemory() as mem:
        torch.ones(1000).sum()
    assert 0 <= mem.peak_mb < 20


def test_peak_memory_is_nan_without_a_measurement(monkeypatch):
    import pyro_implicit.diagnostics.memory as memory

    monkeypatch.setattr(memory, "resident_set_kb", lambda: None)
    with PeakMemory() as mem:
        pass
    assert math.isnan(mem.peak_mb)
