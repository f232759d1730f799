"""Seeding and deterministic CPU execution."""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import torch

from pipeline.utils.cores import available_cores  # noqa: F401  (re-exported: callers import it from here)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    os.environ.setdefault("PYTHONHASHSEED", str(seed))
    # Same config and seed on CPU must give identical outputs. The flag is set as torch.use_deterministic_algorithms
    # sets it, without the import of torch._inductor.config that function does for compiled code (~3 s of CPU in
    # every job with torch 2.13; nothing here compiles): inductor's flag too where something loaded it.
    torch._C._set_deterministic_algorithms(True, warn_only=True)
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:
        inductor.deterministic = True


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def set_threads(requested: int = 0) -> int:
    """Torch intra-op threads: the request (e.g. Snakemake's ``{threads}``), capped at the cores this
    process may use, so ``--cores 8`` on a 2-core machine does not oversubscribe it."""
    n = min(requested, available_cores()) if requested > 0 else available_cores()
    torch.set_num_threads(n)
    return n
