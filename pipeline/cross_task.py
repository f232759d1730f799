"""IDC-PCL's expansion of cross-task data (§2.4, appendix A.3, Figure 6): pre-training batches that add
single-image datasets to the image-pair one.

- **GIC** (general image captioning, CUB): each image with one of its captions becomes a pseudo triplet
  (image, *empty image*, caption). The empty image is an all-zero feature grid of the backbone's shape (key
  ``EMPTY_IMAGE``); its cells are left out of every attention (``IDCPCL.visual_keys``; its [IMG2] token
  stays), MVCL masks the real image only, and FDA uses Retrieve and Replace negatives only (no difference
  description to Confuse): ``gic_settings`` gives the Confuse share to them. The paper uses CUB "in the first
  stage to initialize the model parameters": here the first ``gic_steps`` steps of the run are GIC batches
  with the run's task ratio (MLM:MVCL:FDA), then the pair dataset's (one optimiser and warm-up for both
  stages: a deviation, the paper does not say whether the second stage restarts them).
- **FGVC** (fine-grained classification, NABirds): batches of image pairs, half of the same class and half
  not (``FGVCBatches``), trained by ``pipeline.models.idc_pcl_fgvc``. After the GIC stage the pair dataset's
  batches and FGVC batches alternate at ``mix`` (the paper: NABirds : Birds-to-Words = 1:4), spread evenly
  over each period as ``task_cycle`` spreads tasks.
GIC captions are encoded with the pair dataset's vocabulary (the model's embedding is the fine-tuning one):
their words outside it become <UNK> (counted in ``pretrain.json``). Every batch is a pure function of
(seed, step).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from pipeline.errors import PipelineError

EMPTY_IMAGE = "<empty image>"  # the feature key of the pseudo pairs' second image: all zeros


def is_single_image(record: dict) -> bool:
    """A single-image record (CUB, NABirds; docs/contracts.md) is told from a pair by its ``image`` key."""
    return "image" in record


def pseudo_pairs(records: list[dict]) -> list[dict]:
    """Single-image records as (image, empty image) pairs keyed by ``image_id``: the shape pair stages read."""
    return [{**r, "pair_id": r["image_id"], "before": r["image"], "after": EMPTY_IMAGE, "change_type": "change"}
            for r in records]


def gic_settings(s):
    """FDA negatives of GIC captions: Retrieve and Replace only (appendix A.3), the Confuse share split
    between them (the count per caption is kept: 2:2:2 becomes 3:3:0)."""
    c = s.n_confuse
    return dataclasses.replace(s, n_retrieve=s.n_retrieve + (c + 1) // 2, n_replace=s.n_replace + c // 2, n_confuse=0)


class EmptyPadded:
    """A feature store in which ``EMPTY_IMAGE`` reads as zeros of the store's shape."""

    def __init__(self, store):
        self.store, self.shape = store, store.shape

    def get_many(self, keys):
        real = [k for k in keys if k != EMPTY_IMAGE]
        got = dict(zip(real, self.store.get_many(real))) if real else {}
        zero = np.zeros(self.shape, dtype=np.float32)
        return np.stack([got[k] if k != EMPTY_IMAGE else zero for k in keys])


class EncodedCaptions:
    """``Labels``-like: a record's captions encoded with the pair dataset's vocabulary (``.of(pair_id)``)."""

    def __init__(self, records: list[dict], vocab, max_words: int):
        from pipeline.text import UNK

        self.ids, n_unk, n_words = {}, 0, 0
        for r in records:
            enc = np.stack([vocab.encode(c, max_words)[0] for c in r["captions"]]).astype(np.int64)
            self.ids[r["pair_id"]] = enc
            words = enc[:, 1:]
            n_unk += int((words == UNK).sum())
            n_words += int(((words > 3) | (words == UNK)).sum())
        self.unknown_fraction = n_unk / max(n_words, 1)

    def of(self, pair_id: str) -> np.ndarray:
        return self.ids[pair_id]


class FGVCBatches:
    """Image pairs of a classification dataset: the first half of each batch of the same class (two different
    images where the class has two), the second half of different classes."""

    def __init__(self, records: list[dict], store, batch_size: int, seed: int):
        self.keys = [r["image"] for r in records]
        self.labels = np.array([int(r["labels"]["label"]) for r in records])
        if len(set(self.labels.tolist())) < 2:
            raise PipelineError("FGVC pre-training needs images of at least two classes")
        self.by_class = {c: np.flatnonzero(self.labels == c) for c in sorted(set(self.labels.tolist()))}
        self.store, self.batch_size, self.seed = store, batch_size, seed

    def batch(self, step: int, stream: int = 0) -> dict:
        from pipeline.models.idc_pcl import TASKS

        rng = np.random.default_rng([self.seed, stream, step, 7])
        n_same = self.batch_size // 2
        first = rng.integers(len(self.keys), size=self.batch_size)
        second = np.empty_like(first)
        for j, i in enumerate(first):
            c = self.labels[i]
            if j < n_same:
                pool = self.by_class[c]
                others = pool[pool != i]
                second[j] = rng.choice(others) if len(others) else i
            else:
                pool = np.flatnonzero(self.labels != c)
                second[j] = rng.choice(pool)
        return {"task": torch.tensor(TASKS.index("fgvc")),
                "img1": torch.from_numpy(self.store.get_many([self.keys[i] for i in first])),
                "img2": torch.from_numpy(self.store.get_many([self.keys[i] for i in second])),
                "label1": torch.from_numpy(self.labels[first]), "label2": torch.from_numpy(self.labels[second]),
                "same": torch.from_numpy(self.labels[first] == self.labels[second])}


def spread(ratios: dict[str, int]) -> list[str]:
    """One period with each name ``r`` times, spread evenly (the k-th of name n at (k + ½) / r_n)."""
    slots = [((k + 0.5) / r, i, n) for i, (n, r) in enumerate(ratios.items()) if r > 0 for k in range(r)]
    return [n for _, _, n in sorted(slots)]


def source_of(step: int, gic_steps: int, period: list[str]) -> tuple[str, int]:
    """(source, index of this batch among that source's batches) of a step: ``gic`` for the first
    ``gic_steps`` steps, then the mix period repeated."""
    if step < gic_steps:
        return "gic", step
    s = step - gic_steps
    n, r = divmod(s, len(period))
    src = period[r]
    return src, n * period.count(src) + period[:r].count(src)


class ExpansionBatches:
    """Pre-training batches of the pair dataset (``pair``: ``PretrainBatches``), GIC pseudo pairs (``gic``:
    ``PretrainBatches`` over ``pseudo_pairs``, or None) and FGVC pairs (``fgvc``: ``FGVCBatches``, or None)."""

    def __init__(self, pair, gic=None, fgvc=None, gic_steps: int = 0, mix: dict[str, int] | None = None):
        self.pair, self.gic, self.fgvc = pair, gic, fgvc
        self.gic_steps = gic_steps if gic is not None else 0
        mix = dict(mix or {"pair": 1})
        if fgvc is None:
            mix.pop("fgvc", None)
        elif mix.get("fgvc", 0) <= 0:
            raise PipelineError("cross_task: FGVC data given but its mix ratio is 0")
        self.period = spread({k: int(v) for k, v in mix.items()})
        self.pairs, self.fda_pairs = pair.pairs, getattr(pair, "fda_pairs", None)
        self.cycle = list(pair.cycle) + (["fgvc"] if fgvc is not None else [])

    def source(self, step: int) -> tuple[str, int]:
        return source_of(step, self.gic_steps, self.period)

    def task(self, step: int) -> str:
        src, k = self.source(step)
        return "fgvc" if src == "fgvc" else (self.gic if src == "gic" else self.pair).task(k)

    def batch(self, step: int, stream: int = 0) -> dict:
        src, k = self.source(step)
        if src == "fgvc":
            return self.fgvc.batch(k, stream)
        if src == "gic":
            b = self.gic.batch(k, stream)
            b["img2_empty"] = torch.ones(b["img1"].size(0), dtype=torch.bool)
            return b
        return self.pair.batch(k, stream)


def open_expansion(spec: dict, inputs: dict, vocab, max_words: int, batch_size: int, seed: int, ratios: dict,
                   negatives_for_split):
    """The GIC and FGVC batch sources of a run's ``cross_task`` block (``spec``: ``gic_steps``, ``mix``) from
    the input files (``inputs``: ``{"gic": {"manifest", "features", "negatives"}, "fgvc": {"manifest",
    "features"}}``). Returns (make(pair_batches, split) -> ExpansionBatches, model hparams to add, summary, the
    feature stores it opened, for the caller to close)."""
    from pipeline.datasets.manifest import load as load_manifest
    from pipeline.features.store import FeatureStore
    from pipeline.idc_pcl_pretrain import PretrainBatches

    gic_in, fgvc_in = inputs.get("gic"), inputs.get("fgvc")
    summary, hp, opened = {"gic_steps": 0, "mix": spec.get("mix")}, {}, []
    gic_parts, fgvc_parts = {}, {}
    if gic_in:
        recs = pseudo_pairs(load_manifest(gic_in["manifest"]))
        store = EmptyPadded(FeatureStore(gic_in["features"]))
        opened.append(store.store)
        negs = negatives_for_split(gic_in.get("negatives"))
        for split in ("train", "val"):
            sr = [r for r in recs if r["split"] == split]
            caps = EncodedCaptions(sr, vocab, max_words)
            gic_parts[split] = PretrainBatches(sr, caps, store, vocab, max_words, negs.get(split), batch_size, seed,
                                               ratios)
            summary[f"gic_{split}_images"] = len(sr)
            summary[f"gic_{split}_unknown_word_fraction"] = round(caps.unknown_fraction, 4)
        summary["gic_steps"] = int(spec.get("gic_steps", 0))
    if fgvc_in:
        recs = load_manifest(fgvc_in["manifest"])
        store = FeatureStore(fgvc_in["features"])
        opened.append(store)
        # NABirds has train / test only: its test images give the logged validation diagnostics (nothing is
        # selected on them; pre-training keeps its last step)
        for split, names in (("train", ("train",)), ("val", ("val", "test"))):
            sr = [r for r in recs if r["split"] in names]
            fgvc_parts[split] = FGVCBatches(sr, store, batch_size, seed)
        hp["fgvc_classes"] = int(max(int(r["labels"]["label"]) for r in recs)) + 1
        summary["fgvc_train_images"] = len(fgvc_parts["train"].keys)
        summary["fgvc_classes"] = hp["fgvc_classes"]

    def make(pair_batches, split: str) -> ExpansionBatches:
        # validation: the pair dataset's (and FGVC's) batches only, as after the GIC stage
        return ExpansionBatches(pair_batches, gic_parts.get(split), fgvc_parts.get(split),
                                summary["gic_steps"] if split == "train" else 0, spec.get("mix"))

    return make, hp, summary, opened


def negatives_by_split(path, needed: bool) -> dict:
    """The GIC negatives file by split (empty when the run has no FDA task)."""
    from pipeline import negatives as ng

    if not needed:
        return {}
    if not path:
        raise PipelineError("pre-training task fda needs the cross-task negatives file (none given)")
    recs = ng.load(path)
    return {s: [r for r in recs if r.get("split") == s] for s in ("train", "val")}


def input_paths(arg: str | None) -> dict:
    """``--cross-task`` as the rule writes it: JSON of the input files (or none)."""
    import json

    if not arg:
        return {}
    spec = json.loads(arg)
    for part in spec.values():
        for k, p in part.items():
            if not Path(p).exists():
                raise PipelineError(f"--cross-task: {k} {p} does not exist")
    return spec
