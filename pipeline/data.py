"""Batches of features and encoded captions, read from HDF5 one batch at a time (memory stays bounded).

Training items are image pairs, with an optional distractor partner. How a split's pairs are grouped is read
from its manifest records, never from the dataset's name (``pairing``):

- **partner mode**: every before image of the split has exactly one changed pair and one ``no_change`` pair
  (CLEVR-Change: the semantic and the distractor after image of an index). One item per before image: the
  changed pair, partnered with its distractor pair; the batch adds ``distractor`` and ``distractor_labels``,
  and half of the time (``distractor_swap``) the distractor view plays the "before" image (DUDA's
  augmentation).
- **plain-pair mode**: anything else (CLEVR-DC: one pair per before image, changed or ``no_change``;
  Spot-the-Diff and Image Editing Request: changed pairs only). One item per pair; a ``no_change`` pair is an
  ordinary pair whose caption says that nothing changed; no distractor keys, no swap.

A split in which some before images have a changed and a ``no_change`` pair and others do not mixes the two
shapes: ``PipelineError`` naming a before image of each kind.

Training batches are a pure function of (seed, step): the item order of epoch e is a permutation drawn
from ``default_rng([seed, e])`` and each item's caption choice and augmentation from
``default_rng([seed, step, j])``. A resumed run therefore sees exactly the batches an uninterrupted run
would, whatever happened before the interruption.
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.datasets.manifest import NO_CHANGE
from pipeline.errors import PipelineError
from pipeline.text import Labels

PARTNER, PLAIN = "partner", "plain"


@dataclass(frozen=True)
class Item:
    """One training item: a pair (before, after, its id and change type) and, in partner mode, the after image
    and pair id of its distractor partner (the same before image, no semantic change)."""

    before: str
    after: str
    pair_id: str
    change_type: str
    distractor: str | None = None
    distractor_pair: str | None = None


def _partnered(pairs: list[dict]) -> bool:
    """Whether a before image's pairs are one changed pair and one ``no_change`` pair."""
    return len(pairs) == 2 and sorted(r["change_type"] == NO_CHANGE for r in pairs) == [False, True]


def _by_before(records: list[dict]) -> dict[str, list[dict]]:
    by_before: dict[str, list[dict]] = {}
    for r in records:
        by_before.setdefault(r["before"], []).append(r)
    return by_before


def _mode(by_before: dict[str, list[dict]]) -> str:
    shapes = {before: _partnered(pairs) for before, pairs in sorted(by_before.items())}
    if all(shapes.values()) and shapes:
        return PARTNER
    if not any(shapes.values()):
        return PLAIN
    partnered = next(b for b, p in shapes.items() if p)
    plain = next(b for b, p in shapes.items() if not p)
    types = sorted(r["change_type"] for r in by_before[plain])
    raise PipelineError(f"image {plain}: {len(types)} pair(s) of type(s) {types}, while image {partnered} has a "
                        f"changed and a {NO_CHANGE} (distractor) pair: a split is either every before image with "
                        f"one changed and one distractor pair, or plain pairs")


def pairing(records: list[dict]) -> str:
    """``partner`` or ``plain`` for a split's records (see the module docstring); a mixed split raises."""
    return _mode(_by_before(records))


def items(records: list[dict], changed_only: bool = False) -> tuple[str, list[Item]]:
    """The split's training items and its mode, sorted by before image (then pair id) whatever the manifest
    order. ``changed_only`` drops the ``no_change`` pairs of plain-pair mode (in partner mode every item is a
    changed pair already)."""
    by_before = _by_before(records)
    mode = _mode(by_before)
    if mode == PLAIN:
        keep = [r for r in records if not (changed_only and r["change_type"] == NO_CHANGE)]
        return mode, [Item(r["before"], r["after"], r["pair_id"], r["change_type"])
                      for r in sorted(keep, key=lambda r: (r["before"], r["pair_id"]))]
    out = []
    for before, pairs in sorted(by_before.items()):
        pos, neg = sorted(pairs, key=lambda r: r["change_type"] == NO_CHANGE)  # the changed pair first
        out.append(Item(before, pos["after"], pos["pair_id"], pos["change_type"], neg["after"], neg["pair_id"]))
    return mode, out


def type_ids(types) -> dict[str, int]:
    """Change type -> id: the types in sorted order, ``no_change`` last (when present)."""
    types = set(types)
    return {t: i for i, t in enumerate(sorted(types - {NO_CHANGE}) + ([NO_CHANGE] if NO_CHANGE in types else []))}


class TrainBatches:
    """``batch(step)``: the training batch of ``step``, a dict of tensors (``docs/contracts.md``, batches):
    ``before``, ``after`` ``[B, C, H, W]`` float32, ``labels`` ``[B, L]`` int64 (one caption of the pair),
    ``type`` ``[B]`` (``self.type_ids``), ``changed`` ``[B]`` bool (the pair's type is not ``no_change``),
    scalars ``step`` and ``epoch``; in partner mode also ``distractor`` and ``distractor_labels``. From a feature
    file (a store with ``index_of``), also the images' rows in it: ``before_row``, ``after_row`` (and
    ``distractor_row``) ``[B]`` int64."""

    def __init__(self, records: list[dict], labels: Labels, store, batch_size: int, seed: int,
                 distractor_swap: float = 0.5, changed_only: bool = False):
        self.mode, self.items = items(records, changed_only)
        if not self.items:
            raise PipelineError("no training pairs")
        self.type_ids = type_ids(it.change_type for it in self.items)
        self.labels, self.store = labels, store
        self.batch_size, self.seed, self.swap = batch_size, seed, distractor_swap
        self._perms: dict[int, np.ndarray] = {}
        self._pool = cf.ThreadPoolExecutor(1)
        self._next: tuple[int, cf.Future] | None = None

    @property
    def partnered(self) -> bool:
        return self.mode == PARTNER

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

    def _caption(self, pair_id: str, rng: np.random.Generator) -> np.ndarray:
        caps = self.labels.of(pair_id)
        return caps[rng.integers(len(caps))]

    def _load(self, step: int) -> dict:
        n = len(self.items)
        picks = []
        for pos in range(step * self.batch_size, (step + 1) * self.batch_size):
            picks.append(self.items[self._perm(pos // n)[pos % n]])
        befores, afters, dists, labels, dist_labels = [], [], [], [], []
        for j, it in enumerate(picks):
            rng = np.random.default_rng([self.seed, step, j])
            labels.append(self._caption(it.pair_id, rng))
            if self.partnered:
                dist_labels.append(self._caption(it.distractor_pair, rng))
                # DUDA's augmentation: half of the time the distractor view plays the "before" image.
                if rng.random() < self.swap:
                    befores.append(it.distractor), dists.append(it.before)
                else:
                    befores.append(it.before), dists.append(it.distractor)
            else:
                befores.append(it.before)
            afters.append(it.after)
        out = {
            "before": torch.from_numpy(self.store.get_many(befores)),
            "after": torch.from_numpy(self.store.get_many(afters)),
            "labels": torch.from_numpy(np.stack(labels).astype(np.int64)),
            "type": torch.tensor([self.type_ids[it.change_type] for it in picks]),
            "changed": torch.tensor([it.change_type != NO_CHANGE for it in picks]),
            # Schedules inside a model (e.g. a curriculum, alternating stages) read these.
            "step": torch.tensor(step),
            "epoch": torch.tensor(self.epoch_of(step)),
        }
        if self.partnered:
            out["distractor"] = torch.from_numpy(self.store.get_many(dists))
            out["distractor_labels"] = torch.from_numpy(np.stack(dist_labels).astype(np.int64))
        if hasattr(self.store, "index_of"):
            # Each image's row in the feature file: a model may keep per-image work under it (CLIP4IDC's frozen
            # intra pass) instead of hashing the image.
            for name, keys in (("before", befores), ("after", afters), ("distractor", dists)):
                if name in out:
                    out[f"{name}_row"] = torch.tensor([self.store.index_of(k) for k in keys], dtype=torch.int64)
        return out

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
