"""Peak memory of a block of code, for the time-and-memory columns of comparisons and
benchmarks.

On CUDA the numbers are the caching allocator's peak of allocated bytes. On the CPU torch
has no allocator statistics, so on Linux we use the process's peak resident set: the block's
peak is ``VmHWM`` (reset through ``/proc/self/clear_refs`` on entry) minus ``VmRSS`` on
entry. Freed heap memory is handed back to the system first (``malloc_trim``), otherwise a
block could reuse memory an earlier block left behind and look free. Elsewhere the peak is
``nan``, never a made-up number::

    with PeakMemory() as mem:
        svi.step(data)
    print(mem.peak_mb)
"""

import ctypes
import ctypes.util
import gc
import math
import re
from pathlib import Path

import torch

__all__ = ["PeakMemory", "resident_set_kb"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def resident_set_kb():
    """The process's current and peak resident set, ``(VmRSS, VmHWM)`` in kB, or ``None``
    where ``/proc/self/status`` does not exist (not Linux)."""
    try:
        text = _STATUS.read_text()
    except OSError:
        return None
    values = [re.search(rf"{key}:\s+(\d+)", text) for key in ("VmRSS", "VmHWM")]
    if not all(values):
        return None
    return tuple(int(v.group(1)) for v in values)


def _malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _reset_peak():
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Context manager measuring how far memory use rises above its level on entry.

    :param device: ``"cpu"`` (default) or a CUDA device; a ``torch.device`` or string.
    :ivar float peak_mb: the rise in MiB after the block (``nan`` if the platform gives no
        measurement).
    """

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.peak_mb = math.nan
        self._base = None

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            _malloc_trim()
            status = resident_set_kb()
            self._base = status[0] if status is not None and _reset_peak() else None
        return self

    def __exit__(self, *exc):
        if self._base is None:
            return False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - self._base
            self.peak_mb = max(peak, 0) / 2**20
        else:
            status = resident_set_kb()
            if status is not None:
                self.peak_mb = max(status[1] - self._base, 0) / 1024
        return False
