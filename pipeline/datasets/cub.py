"""CUB-200-2011 (Wah et al. 2011) with the Reed et al. (CVPR 2016) captions, in the L2C split: single images with
10 captions each (a general image-captioning dataset; IDC-PCL pre-trains on it, reference/datasets.md §6).

The layout this parser reads (``data_dir``, the ``data/`` folder of ``resources/raw/cub/<source>``):
- ``CUB_200_2011/`` (``CUB_200_2011.tgz`` extracted): ``images.txt`` (``<image_id> <class dir>/<file>.jpg``),
  ``image_class_labels.txt`` (``<image_id> <class_id>``), ``classes.txt`` (``<class_id> <NNN.Class_Name>``),
  ``train_test_split.txt`` (``<image_id> <1 train | 0 test>``, the official 5,994 / 5,794 split, kept in the
  records' labels) and ``images/<class dir>/<file>.jpg``;
- ``cvpr2016_cub/`` (Reed et al.'s ``cvpr2016_cub.tar.gz``): ``text_c10/<class dir>/<image stem>.txt`` (one
  caption a line), ``trainvalclasses.txt`` and ``testclasses.txt`` (class dirs, one a line).

The split is L2C's (Yan et al. 2021; IDC-PCL follows it): the 150 ``trainvalclasses`` are ``train``, the 50
``testclasses`` are ``val`` (class-disjoint; the StackGAN / AttnGAN split). Every class of ``classes.txt`` must be
in exactly one list. ``source == "official"`` asserts the release's counts (``OFFICIAL``): 11,788 images, 200
classes, 8,855 / 2,933 images in 150 / 50 classes, 5,994 / 5,794 in the official split; ``CUB_200_2011.tgz``'s
md5 is the fetcher's check (``pipeline.datasets.fetch``).

Captions (AttnGAN's reading): the file's bytes decoded as UTF-8 with the release's encoding artefacts (U+FFFD)
removed, white space collapsed, blank lines and lines without a word skipped, the first ``CAPTIONS`` (10) kept.
An image without a caption file, or with no caption, is an error naming the file; fewer than 10 is a warning
when a list is given, else an error.

Records are single images, not pairs (docs/contracts.md, "single-image records"): ``image_id`` the image's file
stem, ``index`` its CUB image id, ``split``, ``image`` its path under ``data/``, ``captions``, ``labels``
``{"class_id", "class", "official_split"}``, ``source``, ``generator_seed``.
"""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.datasets.release import ids_unique, read_columns, report
from pipeline.text import has_word

CUB = "CUB_200_2011"
REED = "cvpr2016_cub"
TEXT = "text_c10"
CAPTIONS = 10
CLASS_LISTS = {"train": "trainvalclasses.txt", "val": "testclasses.txt"}  # L2C split -> Reed's class list
OFFICIAL = {"images": 11788, "classes": 200, "split_images": {"train": 8855, "val": 2933},
            "split_classes": {"train": 150, "val": 50}, "official_split": {"train": 5994, "test": 5794}}


def read_captions(path: Path) -> list[str]:
    text = path.read_bytes().decode("utf-8", errors="replace").replace("\ufffd", "")
    lines = (re.sub(r"\s+", " ", line).strip() for line in text.splitlines())
    return [line for line in lines if has_word(line)][:CAPTIONS]


def read_tables(data_dir: Path) -> dict:
    """The release's tables, cross-checked: ``images`` {id: rel path}, ``labels`` {id: class id}, ``classes``
    {class id: dir}, ``official`` {id: "train" | "test"}, ``split_of_class`` {dir: "train" | "val"}."""
    cub = data_dir / CUB
    if not data_dir.is_dir():
        raise PipelineError(f"CUB data directory not found: {data_dir}")
    if not cub.is_dir():
        raise PipelineError(f"CUB folder missing: {cub} (extract CUB_200_2011.tgz there)")
    images = {k: v[0] for k, v in ids_unique(read_columns(cub / "images.txt", 2, "CUB"), cub / "images.txt").items()}
    classes = {k: v[0] for k, v in ids_unique(read_columns(cub / "classes.txt", 2, "CUB"), cub / "classes.txt").items()}
    path = cub / "image_class_labels.txt"
    labels = {k: v[0] for k, v in ids_unique(read_columns(path, 2, "CUB"), path).items()}
    split_path = cub / "train_test_split.txt"
    split = ids_unique(read_columns(split_path, 2, "CUB"), split_path)
    for what, table, p in (("class", labels, path), ("official split", split, split_path)):
        absent = sorted(set(images) - set(table), key=lambda s: (len(s), s))
        if absent:
            raise PipelineError(f"{p}: no {what} for image id(s) {', '.join(absent[:5])} of {cub / 'images.txt'}")
    for i, c in labels.items():
        if c not in classes:
            raise PipelineError(f"{path}: image {i}: class {c} is not in {cub / 'classes.txt'}")
    official = {}
    for i, (flag,) in split.items():
        if flag not in ("0", "1"):
            raise PipelineError(f"{split_path}: image {i}: {flag!r} is neither 1 (train) nor 0 (test)")
        official[i] = "train" if flag == "1" else "test"
    split_of_class: dict[str, str] = {}
    for split_name, name in CLASS_LISTS.items():
        lpath = data_dir / REED / name
        if not lpath.is_file():
            raise PipelineError(f"CUB class list missing: {lpath} (from Reed et al.'s cvpr2016_cub.tar.gz)")
        for line in lpath.read_text().split():
            if line not in classes.values():
                raise PipelineError(f"{lpath}: class {line!r} is not in {cub / 'classes.txt'}")
            if split_of_class.setdefault(line, split_name) != split_name:
                raise PipelineError(f"{lpath}: class {line} is also in {data_dir / REED / CLASS_LISTS['train']}: the "
                                    f"L2C split is class-disjoint")
    unlisted = sorted(set(classes.values()) - set(split_of_class))
    if unlisted:
        raise PipelineError(f"{data_dir / REED}: class(es) {', '.join(unlisted[:5])} in neither "
                            f"{' nor '.join(CLASS_LISTS.values())}")
    return {"images": images, "labels": labels, "classes": classes, "official": official,
            "split_of_class": split_of_class}


def check_official(records: list[dict], tables: dict, data_dir: Path) -> None:
    """The release's counts (``OFFICIAL``), or one PipelineError saying which differ."""
    got = {"images": len(records), "classes": len(tables["classes"]),
           "split_images": {s: sum(r["split"] == s for r in records) for s in CLASS_LISTS},
           "split_classes": {s: sum(v == s for v in tables["split_of_class"].values()) for s in CLASS_LISTS},
           "official_split": {s: sum(r["labels"]["official_split"] == s for r in records) for s in ("train", "test")}}
    if got != OFFICIAL:
        raise PipelineError(f"{data_dir}: not the CUB release in the L2C split: counts {got}, expected {OFFICIAL}")


def parse(data_dir: str | Path, source: str, generator_seed: int | None = None, check_images: bool = True,
          warnings: list[str] | None = None) -> list[dict]:
    """Read ``data_dir`` (see the module docstring): one single-image record per CUB image, in image id order."""
    data_dir = Path(data_dir)
    t = read_tables(data_dir)
    local: list[str] = []
    records = []
    for i in sorted(t["images"], key=lambda s: (len(s), s)):
        rel = t["images"][i]
        cls = t["classes"][t["labels"][i]]
        img = data_dir / CUB / "images" / rel
        if check_images and not img.is_file():
            raise PipelineError(f"CUB image missing: {img} (image {i} of {data_dir / CUB / 'images.txt'})")
        cap_path = data_dir / REED / TEXT / Path(rel).with_suffix(".txt")
        if not cap_path.is_file():
            raise PipelineError(f"CUB caption file missing: {cap_path} (image {i}, {rel})")
        caps = read_captions(cap_path)
        if not caps:
            raise PipelineError(f"{cap_path}: no caption with a word")
        if len(caps) < CAPTIONS:
            msg = f"{cap_path}: {len(caps)} caption(s), the release has {CAPTIONS} per image"
            if warnings is None:
                raise PipelineError(msg)
            local.append(msg)
        records.append({"image_id": Path(rel).stem, "index": int(i) if i.isdigit() else len(records),
                        "split": t["split_of_class"][cls], "image": f"{CUB}/images/{rel}", "captions": caps,
                        "labels": {"class_id": int(t["labels"][i]) if t["labels"][i].isdigit() else t["labels"][i],
                                   "class": cls, "official_split": t["official"][i]},
                        "source": source, "generator_seed": generator_seed})
    if source == "official":
        check_official(records, t, data_dir)
    report(local, warnings, "CUB")
    return records
