"""How long this process has existed: the start-up logs of the server and of each engine rank count from it, so
that Python's start and the imports before any of our code runs are in the figures.

Linux: the process's start time (/proc/self/stat, in clock ticks since boot) against the boot time (/proc/stat);
elsewhere None (the logs then leave that figure out).
"""

from __future__ import annotations

import os
import time
from typing import Optional


def process_age_s() -> Optional[float]:
    """Seconds since this process started (10 ms resolution), or None where /proc does not say."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: starttime
    return max(0.0, time.time() - started)
