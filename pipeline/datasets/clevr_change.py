"""CLEVR-Change (Park et al., ICCV 2019): the official on-disk layout, parsed into manifest records.

One parser serves both sources: the published archive (``official``) and the procedural miniature
(``synthetic``), which is written in exactly the same layout. Pairs are matched by file name, never by
directory position (the official code pairs by ``sorted(os.listdir())`` and breaks on a stray file).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.datasets.manifest import NO_CHANGE
from pipeline.errors import PipelineError
from pipeline.text import caption_fault
from pipeline.utils.io import read_json

CHANGE_TYPES = ("color", "material", "add", "drop", "move")
REQUIRED_FILES = ("change_captions.json", "no_change_captions.json", "splits.json", "type_mapping.json")

# Integrity anchors of the official JSONs (no official checksum exists; see reference/datasets.md §1.2).
OFFICIAL_SHA256 = {
    "splits.json": "9cb87e7da5425ced3ca0e2644459de372be0ee56fd4ce37c7812082305033168",
    "type_mapping.json": "3ea50ff8c5362bdbc77ff1b7934ac664441cb68e9b0638a1fa69944399a8bb2f",
}
OFFICIAL_SPLIT_SIZES = {"train": 33830, "val": 1988, "test": 3985}


def image_names(index: int) -> tuple[str, str, str]:
    """Keys (relative to ``data/``) of the before, semantic-after and distractor-after images."""
    return (
        f"images/CLEVR_default_{index:06d}.png",
        f"sc_images/CLEVR_semantic_{index:06d}.png",
        f"nsc_images/CLEVR_nonsemantic_{index:06d}.png",
    )


def _caption_key(index: int) -> str:
    return f"CLEVR_default_{index:06d}.png"


def parse(data_dir: str | Path, source: str, generator_seed: int | None = None,
          check_images: bool = True, warnings: list[str] | None = None) -> list[dict]:
    """Read ``data_dir`` (the official ``data/`` folder) and return one manifest record per image pair.

    Every index of ``splits.json`` yields a semantic pair (``%06d.png``) and a distractor pair
    (``%06d.png_n``), as in the DUDA evaluation convention.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise PipelineError(f"CLEVR-Change data directory not found: {data_dir}")
    for name in REQUIRED_FILES:
        if not (data_dir / name).is_file():
            raise PipelineError(f"CLEVR-Change file missing: {data_dir / name}")
    change = read_json(data_dir / "change_captions.json")
    no_change = read_json(data_dir / "no_change_captions.json")
    splits = read_json(data_dir / "splits.json")
    type_mapping = read_json(data_dir / "type_mapping.json")

    missing = [s for s in ("train", "val", "test") if s not in splits]
    if missing:
        raise PipelineError(f"{data_dir / 'splits.json'}: missing split(s) {missing}")
    unknown = set(type_mapping) - set(CHANGE_TYPES)
    if unknown:
        raise PipelineError(f"{data_dir / 'type_mapping.json'}: unknown change type(s) {sorted(unknown)}")
    type_of: dict[int, str] = {}
    for ctype, names in type_mapping.items():
        for name in names:
            try:
                idx = int(Path(name).stem)
            except ValueError:
                raise PipelineError(f"{data_dir / 'type_mapping.json'}: bad entry {name!r} under {ctype!r}") from None
            type_of[idx] = ctype

    seen: dict[int, str] = {}
    records: list[dict] = []
    for split in ("train", "val", "test"):
        for idx in splits[split]:
            if not isinstance(idx, int):
                raise PipelineError(f"{data_dir / 'splits.json'}: non-integer index {idx!r} in {split!r}")
            if idx in seen:
                raise PipelineError(f"{data_dir / 'splits.json'}: index {idx} is in both {seen[idx]!r} and {split!r}")
            seen[idx] = split
            key = _caption_key(idx)
            if key not in change:
                raise PipelineError(f"{data_dir / 'change_captions.json'}: no captions for {key!r} (index {idx}, {split})")
            if key not in no_change:
                raise PipelineError(f"{data_dir / 'no_change_captions.json'}: no captions for {key!r} (index {idx}, {split})")
            if idx not in type_of:
                raise PipelineError(f"{data_dir / 'type_mapping.json'}: index {idx:06d} has no change type")
            before, sc, nsc = image_names(idx)
            if check_images:
                for rel in (before, sc, nsc):
                    if not (data_dir / rel).is_file():
                        raise PipelineError(f"CLEVR-Change image missing: {data_dir / rel}")
            common = {"index": idx, "split": split, "before": before, "labels": {},
                      "source": source, "generator_seed": generator_seed}
            records.append({"pair_id": f"{idx:06d}.png", **common, "after": sc, "change_type": type_of[idx],
                            "captions": _captions(change[key], data_dir / "change_captions.json", key, warnings)})
            records.append({"pair_id": f"{idx:06d}.png_n", **common, "after": nsc, "change_type": NO_CHANGE,
                            "captions": _captions(no_change[key], data_dir / "no_change_captions.json", key, warnings)})
    return records


def _captions(caps, path: Path, key: str, warnings: list[str] | None) -> list[str]:
    """The captions of one image; a fault (``pipeline.text.caption_fault``) raises, or goes to ``warnings``."""
    fault = caption_fault(caps)
    if fault is not None:
        if warnings is None:
            raise PipelineError(f"{path}: {key!r}: {fault}")
        warnings.append(f"{path}: {key!r}: {fault}")
    return list(caps) if isinstance(caps, list) else []
