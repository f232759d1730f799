"""Batches of features and encoded captions, read from HDF5 one batch at a time (memory stays bounded).

Training batches are a pure function of (seed, step): the sample order of epoch e is a permutation drawn
from ``default_rng([seed, e])`` and each sample's caption choice and augmentation from
``default_rng([seed, step, j])``. A resumed run therefore sees exactly the batches an uninterrupted run
would, whatever happened before the interruption.
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.datasets.clevr_change import CHANGE_TYPES, NO_CHANGE
from pipeline.errors import PipelineError
from pipeline.text import Labels

TYPE_IDS = {t: i for i, t in enumerate(CHANGE_TYPES + (NO_CHANGE,))}


@dataclass(frozen=True)
class Triplet:
    """One index of a change dataset: before, semantic after, distractor after, and their pairs' ids."""

    before: str
    sc: str
    nsc: str
    pos_pair: str
    neg_pair: str
    change_type: str


def triplets(records: list[dict]) -> list[Triplet]:
    """Group a split's pairs by their before image: each semantic pair with its distractor pair."""
    by_before: dict[str, dict[str, dict]] = {}
    for r in records:
        slot = "neg" if r["change_type"] == NO_CHANGE else "pos"
        by_before.setdefault(r["before"], {})[slot] = r
    out = []
    for before in sorted(by_before):
        g = by_before[before]
        if "pos" not in g or "neg" not in g:
            raise PipelineError(f"image {before}: needs both a changed and a distractor pair for training")
        out.append(Triplet(before, g["pos"]["after"], g["neg"]["after"], g["pos"]["pair_id"],
                           g["neg"]["pair_id"], g["pos"]["change_type"]))
    return out


class TrainBatches:
    def __init__(self, records: list[dict], labels: Labels, store, batch_size: int, seed: int,
                 distractor_swap: float = 0.5):
        self.items = triplets(records)
        if not self.items:
            raise PipelineError("no training triplets")
        self.labels, self.store = labels, store
        self.batch_size, self.seed, self.swap = batch_size, seed, distractor_swap
        self._perms: dict[int, np.ndarray] = {}
        self._pool = cf.ThreadPoolExecutor(1)
        self._next: tuple[int, cf.Future] | None = None

    def __len__(self) -> int:
        return len(self.items)

    def epoch_of(self, step: int) -> int:
        return step * self.batch_size // len(self.items)

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:  # keep only the current epoch's; the reader thread may race here harmlessly
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.items))
            self._perms = {epoch: perm}
        return perm

    def _load(self, step: int) -> dict:
        n = len(self.items)
        picks = []
        for pos in range(step * self.batch_size, (step + 1) * self.batch_size):
            picks.append(self.items[self._perm(pos // n)[pos % n]])
        befores, scs, nscs, pos_l, neg_l, types = [], [], [], [], [], []
        for j, it in enumerate(picks):
            rng = np.random.default_rng([self.seed, step, j])
            pos_caps, neg_caps = self.labels.of(it.pos_pair), self.labels.of(it.neg_pair)
            pos_l.append(pos_caps[rng.integers(len(pos_caps))])
            neg_l.append(neg_caps[rng.integers(len(neg_caps))])
            # DUDA's augmentation: half of the time the distractor view plays the "before" image.
            if rng.random() < self.swap:
                befores.append(it.nsc), nscs.append(it.before)
            else:
                befores.append(it.before), nscs.append(it.nsc)
            scs.append(it.sc)
            types.append(TYPE_IDS[it.change_type])
        return {
            "before": torch.from_numpy(self.store.get_many(befores)),
            "sc": torch.from_numpy(self.store.get_many(scs)),
            "nsc": torch.from_numpy(self.store.get_many(nscs)),
            "pos_labels": torch.from_numpy(np.stack(pos_l).astype(np.int64)),
            "neg_labels": torch.from_numpy(np.stack(neg_l).astype(np.int64)),
            "type": torch.tensor(types),
            # Schedules inside a model (e.g. a curriculum, alternating stages) read these.
            "step": torch.tensor(step),
            "epoch": torch.tensor(self.epoch_of(step)),
        }

    def batch(self, step: int) -> dict:
        """The batch of ``step``; the next one is read in the background meanwhile."""
        if self._next is not None and self._next[0] == step:
            out = self._next[1].result()
        else:
            out = self._load(step)
        self._next = (step + 1, self._pool.submit(self._load, step + 1))
        return out


def eval_batches(records: list[dict], store, batch_size: int):
    """Yield (pair_ids, before, after) over a split's pairs in manifest order."""
    for i in range(0, len(records), batch_size):
        chunk = records[i:i + batch_size]
        yield ([r["pair_id"] for r in chunk],
               torch.from_numpy(store.get_many([r["before"] for r in chunk])),
               torch.from_numpy(store.get_many([r["after"] for r in chunk])))
