"""Model factory: method id → constructor. One file per model."""

from __future__ import annotations

import importlib

# method id -> (module, class name)
REGISTRY: dict[str, tuple[str, str]] = {
    "duda": ("pipeline.models.duda", "DUDA"),
}


def build_model(method: str, vocab_size: int, feat_dim: int, hparams: dict):
    if method not in REGISTRY:
        from pipeline.errors import PipelineError

        raise PipelineError(f"unknown method {method!r}; known: {sorted(REGISTRY)}")
    module, cls = REGISTRY[method]
    return getattr(importlib.import_module(module), cls)(vocab_size=vocab_size, feat_dim=feat_dim, **hparams)
