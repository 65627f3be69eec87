"""How often a progress bar refreshes, by where it is written.

On a terminal or in a notebook a ``tqdm`` bar redraws itself in place, several times a
second. Written to a log file (stderr redirected, a batch job) each redraw is one more
carriage-return record: a 10-minute fit at tqdm's default leaves thousands of them. There
the library's bars refresh at most every :data:`LOG_INTERVAL` seconds: a long run still
shows that it is alive and how far it is, in a few records.
"""

import sys

__all__ = ["LOG_INTERVAL", "refresh_intervals"]

#: seconds between a bar's refreshes where its stream is not a terminal
LOG_INTERVAL = 30.0


def _interactive(stream):
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return True
    # a notebook's streams are no terminals, but their output is seen as it comes
    return "ipykernel" in sys.modules


def refresh_intervals(file=None):
    """``tqdm`` keyword arguments for a bar written to ``file`` (``sys.stderr``, tqdm's
    default, if omitted): none where it is a terminal or a notebook's stream, else
    ``mininterval`` and ``maxinterval`` of :data:`LOG_INTERVAL` seconds."""
    if _interactive(sys.stderr if file is None else file):
        return {}
    return {"mininterval": LOG_INTERVAL, "maxinterval": LOG_INTERVAL}
