"""The CPU cores this process may use (torch-free: the Snakefile reads it too)."""

import os


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
