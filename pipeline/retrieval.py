"""Retrieval metrics (CLIP4IDC image-pair↔text, TIRG composed-query image retrieval).

Ties are never counted in the model's favour: a ground truth tied with k other candidates ranks behind
all of them. (The official CLIP4IDC ``metrics.py`` ranks by argsort, which breaks ties by position.)
"""

from __future__ import annotations

import numpy as np


def ranks(sim: np.ndarray, gt: np.ndarray | None = None) -> np.ndarray:
    """1-based rank of each query's ground-truth candidate. ``sim`` [queries, candidates]; ``gt[q]`` the
    ground-truth column of query q (default: the diagonal)."""
    sim = np.asarray(sim, dtype=np.float64)
    gt = np.arange(sim.shape[0]) if gt is None else np.asarray(gt)
    target = sim[np.arange(sim.shape[0]), gt][:, None]
    better = (sim > target).sum(1)
    ties = (sim == target).sum(1) - 1  # the other candidates with exactly the same score
    return better + ties + 1


def retrieval_metrics(sim: np.ndarray, gt: np.ndarray | None = None, ks=(1, 5, 10)) -> dict:
    r = ranks(sim, gt)
    out = {f"R@{k}": float((r <= k).mean()) for k in ks}
    out.update({"MedianR": float(np.median(r)), "MeanR": float(r.mean()), "n": int(len(r))})
    return out


def both_directions(sim: np.ndarray) -> dict:
    """Text→pair and pair→text metrics for a square similarity matrix [texts, pairs] matched on the diagonal."""
    return {"text_to_pair": retrieval_metrics(sim), "pair_to_text": retrieval_metrics(np.asarray(sim).T)}
