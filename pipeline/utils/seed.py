"""Seeding and deterministic CPU execution."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    os.environ.setdefault("PYTHONHASHSEED", str(seed))
    # Same config and seed on CPU must give identical outputs.
    torch.use_deterministic_algorithms(True, warn_only=True)


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def set_threads(requested: int = 0) -> int:
    """Torch intra-op threads: the request (e.g. Snakemake's ``{threads}``), capped at the cores this
    process may use, so ``--cores 8`` on a 2-core machine does not oversubscribe it."""
    n = min(requested, available_cores()) if requested > 0 else available_cores()
    torch.set_num_threads(n)
    return n
