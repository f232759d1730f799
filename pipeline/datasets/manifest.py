"""Stage ``manifest``: a dataset's on-disk layout → ``results/<dataset>/manifest.jsonl``."""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.utils.io import read_jsonl, write_jsonl

# The change type of a pair whose after image shows no semantic change (a distractor: a viewpoint or lighting
# change, or the same scene). Every parser writes it; the data layer pairs and counts by it (``pipeline.data``).
NO_CHANGE = "no_change"

PARSERS = {"clevr_change": "pipeline.datasets.clevr_change", "clevr_dc": "pipeline.datasets.clevr_dc",
           "spot_the_diff": "pipeline.datasets.spot_the_diff",
           "image_editing_request": "pipeline.datasets.image_editing_request",
           "birds_to_words": "pipeline.datasets.birds_to_words",
           # single-image datasets (docs/contracts.md, "single-image records"): cross-task pre-training data
           "cub": "pipeline.datasets.cub", "nabirds": "pipeline.datasets.nabirds"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", required=True, choices=sorted(PARSERS))
    p.add_argument("--raw-dir", required=True, help="the dataset's data/ folder (official layout)")
    p.add_argument("--source", required=True, choices=["official", "synthetic"])
    p.add_argument("--out", required=True)


def load(path: str | Path, split: str | None = None) -> list[dict]:
    records = read_jsonl(path)
    if split is not None:
        records = [r for r in records if r["split"] == split]
        if not records:
            raise PipelineError(f"{path}: no pairs in split {split!r}")
    return records


def run(args: argparse.Namespace) -> None:
    import importlib

    parser = importlib.import_module(PARSERS[args.dataset])
    raw = Path(args.raw_dir)
    seed = None
    if args.source == "synthetic":
        prov = raw.parent / "SYNTHETIC.json"
        if not prov.is_file():
            raise PipelineError(f"{raw}: source 'synthetic' but no provenance file {prov}")
        seed = json.loads(prov.read_text())["seed"]
    records = parser.parse(raw, source=args.source, generator_seed=seed)
    write_jsonl(args.out, records)
    splits = collections.Counter(r["split"] for r in records)
    what = "pairs" if not records or "before" in records[0] else "images"
    print(f"manifest: {len(records)} {what} -> {args.out}; " + ", ".join(f"{s} {n}" for s, n in sorted(splits.items())))
    if what == "pairs":
        counts = collections.Counter((r["split"], r["change_type"]) for r in records)
        print("by split and type: " + json.dumps({f"{s}/{t}": n for (s, t), n in sorted(counts.items())}))
