"""Stage ``inspect``: check a dataset tree before spending hours on features.

Reads an official or synthetic tree with the same parser the ``manifest`` stage uses and prints JSON: per
split the pairs, distinct images, captions, empty captions (no word character), duplicate captions (a repeat
of an earlier caption of the same pair, case and spacing ignored) and pairs per change type; then the parser's
warnings (the first 20, and how many). A structural fault is the parser's one error message, exit status 2.

A parser whose release holds more than its records say (entries merged into one pair, sentences dropped:
Spot-the-Diff) may define ``source_counts(data_dir, source) -> {split: {name: int}}``: those counts are added
to each split's summary (``pairs`` stays the number of manifest records).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import re
from pathlib import Path

from pipeline.datasets.manifest import PARSERS
from pipeline.errors import PipelineError
from pipeline.text import has_word

SHOWN_WARNINGS = 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dataset", choices=sorted(PARSERS))
    p.add_argument("--root", required=True, help="the dataset's data/ folder (or the folder holding data/)")
    p.add_argument("--source", choices=["official", "synthetic", "auto"], default="auto",
                   help="auto: synthetic when the renderer's SYNTHETIC.json lies beside data/, else official "
                        "(official trees get the release's checksums checked)")
    p.add_argument("--no-images", action="store_true", help="do not check that every image file exists")


def summarise(records: list[dict]) -> dict:
    """Per split (train, val, test, and any other a parser writes, e.g. NABirds' ``test`` only) the counts of
    the module docstring; single-image records (docs/contracts.md: CUB, NABirds) give ``images`` and ``classes``
    (distinct ``labels.class``) in place of ``pairs``, ``distinct_images`` and ``types``."""
    out: dict[str, dict] = {}
    single = bool(records) and "image" in records[0]
    for split in ("train", "val", "test", *sorted({r["split"] for r in records} - {"train", "val", "test"})):
        rs = [r for r in records if r["split"] == split]
        norm = [[re.sub(r"\s+", " ", c.strip().lower()) if isinstance(c, str) else "" for c in r["captions"]]
                for r in rs]
        if single:
            counts = {"images": len(rs), "classes": len({r["labels"].get("class") for r in rs})}
        else:
            counts = {"pairs": len(rs), "distinct_images": len({r["before"] for r in rs} | {r["after"] for r in rs})}
        out[split] = {
            **counts,
            "captions": sum(len(c) for c in norm),
            "empty_captions": sum(1 for c in norm for x in c if not has_word(x)),
            "duplicate_captions": sum(len(c) - len(set(c)) for c in norm),
        }
        if "pairs" in counts:
            out[split]["types"] = dict(sorted(collections.Counter(r["change_type"] for r in rs).items()))
    return out


def inspect_tree(dataset: str, root: str | Path, source: str = "auto", check_images: bool = True) -> dict:
    root = Path(root)
    if not root.is_dir():
        raise PipelineError(f"{dataset}: folder not found: {root}")
    if (root / "data").is_dir():
        root = root / "data"
    prov = root.parent / "SYNTHETIC.json"
    if source == "auto":
        source = "synthetic" if prov.is_file() else "official"
    seed = json.loads(prov.read_text())["seed"] if source == "synthetic" and prov.is_file() else None
    parser = importlib.import_module(PARSERS[dataset])
    warnings: list[str] = []
    records = parser.parse(root, source=source, generator_seed=seed, check_images=check_images, warnings=warnings)
    splits = summarise(records)
    if hasattr(parser, "source_counts"):
        for split, counts in parser.source_counts(root, source).items():
            splits.setdefault(split, {}).update(counts)
    return {"dataset": dataset, "root": str(root), "source": source, "splits": splits,
            "n_warnings": len(warnings), "warnings": warnings[:SHOWN_WARNINGS]}


def run(args: argparse.Namespace) -> None:
    print(json.dumps(inspect_tree(args.dataset, args.root, args.source, not args.no_images), indent=1))
