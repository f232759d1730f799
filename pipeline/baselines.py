"""Two sanity baselines that any trained captioner must beat.

Stage: ``python -m pipeline baseline --kind most_frequent|nearest_neighbour --manifest M [--features F.h5]
--dataset clevr_change --out-dir results/clevr_change/<kind>/seed0 --seed 0``.

- ``most_frequent``: the single most frequent training caption (exact string count over the reference
  captions of every training pair; ties broken by the lexicographically smallest string), predicted for
  every val/test pair. Needs no features (``--features`` only records the backbone if given).
- ``nearest_neighbour``: each pair is represented by its mean-pooled "before" feature and the mean-pooled
  after-minus-before feature, each L2-normalised, concatenated. Each val/test pair takes the training pair of
  highest cosine similarity (ties: the lowest training index in manifest order) and outputs that pair's
  **most frequent reference caption** (ties: the lexicographically smallest string). Features are pooled
  while streaming through the feature file in chunks (``--chunk-size`` images); the val/test pair vectors
  are held (``2C`` floats each), the training pairs are streamed against them chunk by chunk with a running
  arg-max, so neither the feature file, the training vectors nor a full similarity matrix is held in memory.

Both are deterministic; ``--seed`` is recorded only. Outputs (docs/contracts.md): ``predictions_val.json``,
``predictions_test.json`` (COCO results, one entry per pair in manifest order) and ``run.json`` with
``kind: "sanity"``.
"""

from __future__ import annotations

import argparse
import heapq
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from pipeline.errors import PipelineError
from pipeline.utils.io import read_jsonl, write_json

KINDS = ("most_frequent", "nearest_neighbour")
EVAL_SPLITS = ("val", "test")
_EPS = 1e-12


def _most_frequent(captions: Iterable[str], k: int) -> list[tuple[str, int]]:
    """The ``k`` most frequent strings with their counts; ties go to the lexicographically smallest one."""
    counts = Counter(captions)
    if not counts:
        raise PipelineError("no captions to choose the most frequent one from")
    return heapq.nsmallest(k, counts.items(), key=lambda kv: (-kv[1], kv[0]))


def most_frequent_caption(captions: Iterable[str]) -> str:
    """The most frequent string; ties go to the lexicographically smallest one."""
    return _most_frequent(captions, 1)[0][0]


def _training_captions(records: Sequence[dict]) -> list[str]:
    caps = [c for r in records if r.get("split") == "train" for c in r.get("captions") or []]
    if not caps:
        raise PipelineError("manifest has no training captions")
    return caps


def most_frequent_training_caption(records: Sequence[dict]) -> str:
    """Most frequent caption over the references of every training pair (exact string count)."""
    return most_frequent_caption(_training_captions(records))


def caption_margin(records: Sequence[dict]) -> dict:
    """How clear the most frequent training caption's lead is: its count, the runner-up and its count, and the
    number of training references. Recorded because on CLEVR-Change the nine no-change phrasings are drawn
    equally often, so the winner is a near-tie whose pick sets the row's score (docs/measurements.md)."""
    caps = _training_captions(records)
    (first, n_first), *rest = _most_frequent(caps, 2)
    runner, n_runner = rest[0] if rest else (None, 0)
    return {"caption": first, "count": n_first, "runner_up": runner, "runner_up_count": n_runner,
            "training_references": len(caps)}


def _pool(x: np.ndarray) -> np.ndarray:
    """Mean-pool a batch of features to ``[n, C]``: ``[n, C, H, W]`` over H, W; ``[n, T, D]`` over T."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 4:
        return x.mean(axis=(2, 3))
    if x.ndim == 3:
        return x.mean(axis=1)
    if x.ndim == 2:
        return x
    raise PipelineError(f"unsupported feature shape {x.shape}")


def _l2n(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), _EPS)


def iter_pair_vectors(store, records: Sequence[dict], chunk_size: int = 64, desc: str = "pairs"):
    """Yield ``(start, vectors)`` over consecutive chunks of ``records``; ``vectors`` is ``[m, 2C]`` float32:
    the L2-normalised pooled before feature ++ the L2-normalised pooled (after - before) feature.

    Reads the feature store about ``chunk_size`` images at a time (before and after keys of consecutive
    pairs; a key shared by two pairs of the chunk, e.g. a before image, is read once).
    """
    from tqdm import tqdm

    pairs_per_chunk = max(1, chunk_size // 2)
    for start in tqdm(range(0, len(records), pairs_per_chunk), desc=desc, unit="chunk", leave=False):
        chunk = records[start : start + pairs_per_chunk]
        keys = sorted({k for r in chunk for k in (r["before"], r["after"])})
        pooled = dict(zip(keys, _pool(store.get_many(keys))))
        before = np.stack([pooled[r["before"]] for r in chunk])
        after = np.stack([pooled[r["after"]] for r in chunk])
        yield start, np.concatenate([_l2n(before), _l2n(after - before)], axis=1).astype(np.float32)


def pair_vectors(store, records: Sequence[dict], chunk_size: int = 64, desc: str = "pairs") -> np.ndarray:
    """All pair vectors of ``records`` as one ``[n, 2C]`` array (see ``iter_pair_vectors``)."""
    parts = [v for _, v in iter_pair_vectors(store, records, chunk_size, desc)]
    if not parts:
        raise PipelineError(f"no {desc} to represent")
    return np.concatenate(parts, axis=0)


def nearest_indices(queries: np.ndarray, database_chunks: Iterable[tuple[int, np.ndarray]]) -> np.ndarray:
    """Index of the highest-cosine database row for each query; ties go to the lowest database index.

    ``database_chunks`` yields ``(start, rows)`` in increasing ``start`` order (e.g. ``iter_pair_vectors``),
    so the database is streamed against the queries with a running maximum and never held whole. Rows are
    L2-normalised here, so the dot product is the cosine similarity (rounded to 1e-5 before comparing).
    """
    q = _l2n(np.asarray(queries, dtype=np.float32))
    best = np.full(len(q), -np.inf, dtype=np.float32)
    idx = np.full(len(q), -1, dtype=np.int64)
    for start, rows in database_chunks:
        # rounded so that equal vectors tie exactly whatever BLAS kernel or chunking computed them
        sims = np.round(q @ _l2n(np.asarray(rows, dtype=np.float32)).T, 5)
        j = sims.argmax(axis=1)  # first maximum within the chunk = lowest index
        v = sims[np.arange(len(q)), j]
        better = v > best  # strict: an equal score in a later chunk keeps the earlier index
        best[better] = v[better]
        idx[better] = j[better] + start
    if len(q) and (idx < 0).any():
        raise PipelineError("nearest-neighbour search over an empty training set")
    return idx


def _split(records: Sequence[dict], split: str) -> list[dict]:
    return [r for r in records if r.get("split") == split]


def predict(kind: str, records: Sequence[dict], store=None, chunk_size: int = 64) -> dict[str, list[dict]]:
    """``{split: [{"image_id", "caption"}]}`` for the val and test splits."""
    train = _split(records, "train")
    if not train:
        raise PipelineError("manifest has no training pairs")
    targets = {s: _split(records, s) for s in EVAL_SPLITS}
    if kind == "most_frequent":
        cap = most_frequent_training_caption(records)
        return {s: [{"image_id": r["pair_id"], "caption": cap} for r in rs] for s, rs in targets.items()}
    if kind == "nearest_neighbour":
        if store is None:
            raise PipelineError("nearest_neighbour needs --features")
        queries = [(s, r) for s in EVAL_SPLITS for r in targets[s]]
        out = {s: [] for s in EVAL_SPLITS}
        if not queries:
            return out
        qvec = pair_vectors(store, [r for _, r in queries], chunk_size, desc="val/test pairs")
        nn = nearest_indices(qvec, iter_pair_vectors(store, train, chunk_size, desc="train pairs"))
        for (s, r), j in zip(queries, nn):
            if not train[j].get("captions"):
                raise PipelineError(f"training pair {train[j]['pair_id']!r} has no captions")
            out[s].append({"image_id": r["pair_id"], "caption": most_frequent_caption(train[j]["captions"])})
        return out
    raise PipelineError(f"unknown baseline kind {kind!r}; expected one of {KINDS}")


def _one_source(records: Sequence[dict], manifest: str) -> str:
    sources = sorted({str(r.get("source")) for r in records})
    if len(sources) != 1:
        raise PipelineError(f"{manifest}: records mix data sources {sources}")
    return sources[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", required=True, choices=KINDS)
    parser.add_argument("--manifest", required=True, help="results/<dataset>/manifest.jsonl")
    parser.add_argument("--features", default=None, help="results/<dataset>/features/<backbone>.h5 (required for nearest_neighbour)")
    parser.add_argument("--dataset", required=True, help="dataset id, e.g. clevr_change")
    parser.add_argument("--out-dir", required=True, help="results/<dataset>/<kind>/seed<k>/")
    parser.add_argument("--seed", type=int, default=0, help="recorded only: both baselines are deterministic")
    parser.add_argument("--chunk-size", type=int, default=64, help="images read from the feature file at a time")


def run(args: argparse.Namespace) -> None:
    records = read_jsonl(args.manifest)
    for i, r in enumerate(records):
        for field in ("pair_id", "split", "before", "after", "captions"):
            if field not in r:
                raise PipelineError(f"{args.manifest}: record {i + 1} has no {field!r}")
    source = _one_source(records, args.manifest)
    backbone, weights, feature_attrs = None, None, {}
    if args.kind == "nearest_neighbour" and not args.features:
        raise PipelineError("--kind nearest_neighbour needs --features")
    out_dir = Path(args.out_dir)
    if args.features:
        from pipeline.features.store import FeatureStore

        with FeatureStore(args.features) as store:
            feature_attrs = dict(store.attrs)
            backbone, weights = feature_attrs.get("backbone"), feature_attrs.get("weights")
            if args.kind == "nearest_neighbour" and str(feature_attrs.get("complete", True)).lower() in ("false", "0"):
                raise PipelineError(f"{args.features}: feature file is not complete (attribute complete={feature_attrs.get('complete')})")
            preds = predict(args.kind, records, store, args.chunk_size)
    else:
        preds = predict(args.kind, records)
    for split in EVAL_SPLITS:
        write_json(out_dir / f"predictions_{split}.json", preds[split])
    run_info = {
        "method": args.kind,
        "dataset": args.dataset,
        "seed": args.seed,
        "kind": "sanity",
        "source": source,
        "backbone": str(backbone) if backbone is not None else None,
        "weights": str(weights) if weights is not None else None,
        "selected_step": None,
        "val_CIDEr": None,
        "config": {
            "kind": args.kind,
            "manifest": str(args.manifest),
            "features": str(args.features) if args.features else None,
            "chunk_size": args.chunk_size,
            "representation": "l2n(meanpool(before)) ++ l2n(meanpool(after) - meanpool(before)), cosine" if args.kind == "nearest_neighbour" else None,
            "caption_choice": "most frequent training caption (ties lexicographic)" if args.kind == "most_frequent"
            else "most frequent reference of the nearest training pair (ties lexicographic; NN ties: lowest index)",
            "feature_code_version": str(feature_attrs.get("code_version")) if feature_attrs else None,
        },
    }
    if args.kind == "most_frequent":
        run_info["config"]["caption_margin"] = caption_margin(records)
    write_json(out_dir / "run.json", run_info)
    print(f"{args.kind}: wrote {', '.join(f'{len(preds[s])} {s}' for s in EVAL_SPLITS)} predictions to {out_dir}")
