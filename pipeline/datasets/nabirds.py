"""NABirds (Van Horn et al., CVPR 2015): single images with a class label in a hierarchy (a fine-grained
classification dataset; IDC-PCL's second pre-training stage builds same / different-class image pairs from it,
reference/datasets.md §7).

The layout this parser reads (``data_dir``, the ``data/`` folder of ``resources/raw/nabirds/<source>``: the
content of the archive's ``nabirds/`` folder): ``images.txt`` (``<image_id> <class dir>/<file>.jpg``, image ids
are UUID strings), ``image_class_labels.txt`` (``<image_id> <class_id>``), ``classes.txt`` (``<class_id> <name
with spaces>``, hierarchy nodes included), ``hierarchy.txt`` (``<child class_id> <parent class_id>``),
``train_test_split.txt`` (``<image_id> <1 train | 0 test>``) and ``images/<class dir>/<file>.jpg``.

Class ids are non-contiguous and only leaf classes (no one's parent) hold images: every image's class must be a
leaf (else an error naming the file), and the leaves that hold images are remapped to contiguous labels
``0 .. K-1`` in ascending class id (``leaf_labels``). A class's ``ancestors`` are its parents up to the root (a
cycle, or a parent missing from ``classes.txt``, is an error naming ``hierarchy.txt``).

``source == "official"`` asserts the release's counts (``OFFICIAL``: 48,562 images, 555 leaf labels); the
archive's md5 is the fetcher's check. The official split reported elsewhere (23,929 / 24,633) is unverified
(datasets.md §7) and only recorded by ``fetch``.

Records are single images (docs/contracts.md, "single-image records"): ``image_id``, ``index`` its line in
``images.txt`` (from 0), ``split`` ``train`` / ``test``, ``image`` its path under ``data/``, ``captions`` ``[]``
(the release has none), ``labels`` ``{"class_id", "label", "class", "ancestors"}``, ``source``,
``generator_seed``.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.datasets.release import ids_unique, read_columns, report

FILES = ("images.txt", "image_class_labels.txt", "classes.txt", "hierarchy.txt", "train_test_split.txt")
IMAGES = "images"
OFFICIAL = {"images": 48562, "labels": 555}


def _int(value: str, path: Path, what: str) -> int:
    if not value.isdigit():
        raise PipelineError(f"{path}: {what} {value!r} is not a class id (a non-negative integer)")
    return int(value)


def read_hierarchy(data_dir: Path) -> tuple[dict[int, str], dict[int, int]]:
    """``classes`` {id: name} and ``parent`` {child: parent}, checked (ids known, no cycle)."""
    cpath, hpath = data_dir / "classes.txt", data_dir / "hierarchy.txt"
    classes = {_int(k, cpath, "class"): v[0] for k, v in ids_unique(read_columns(cpath, 2, "NABirds", rest=True),
                                                                   cpath).items()}
    parent: dict[int, int] = {}
    for child, par in read_columns(hpath, 2, "NABirds"):
        c, p = _int(child, hpath, "child"), _int(par, hpath, "parent")
        for x in (c, p):
            if x not in classes:
                raise PipelineError(f"{hpath}: class {x} is not in {cpath}")
        if parent.setdefault(c, p) != p:
            raise PipelineError(f"{hpath}: class {c} has two parents ({parent[c]}, {p})")
    for c in parent:
        seen = {c}
        while c in parent:
            c = parent[c]
            if c in seen:
                raise PipelineError(f"{hpath}: the hierarchy has a cycle through class {c}")
            seen.add(c)
    return classes, parent


def ancestors(cls: int, parent: dict[int, int]) -> list[int]:
    out = []
    while cls in parent:
        cls = parent[cls]
        out.append(cls)
    return out


def leaf_labels(image_classes) -> dict[int, int]:
    """The contiguous label of each leaf class holding images: 0 .. K-1 in ascending class id."""
    return {c: k for k, c in enumerate(sorted(set(image_classes)))}


def parse(data_dir: str | Path, source: str, generator_seed: int | None = None, check_images: bool = True,
          warnings: list[str] | None = None) -> list[dict]:
    """Read ``data_dir`` (see the module docstring): one single-image record per line of ``images.txt``."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise PipelineError(f"NABirds data directory not found: {data_dir}")
    classes, parent = read_hierarchy(data_dir)
    ipath, lpath, spath = (data_dir / n for n in ("images.txt", "image_class_labels.txt", "train_test_split.txt"))
    images = read_columns(ipath, 2, "NABirds")
    ids_unique(images, ipath)
    labels = {k: _int(v[0], lpath, "class") for k, v in ids_unique(read_columns(lpath, 2, "NABirds"), lpath).items()}
    split = {k: v[0] for k, v in ids_unique(read_columns(spath, 2, "NABirds"), spath).items()}
    parents = set(parent.values())
    for image_id, _ in images:
        for table, p in ((labels, lpath), (split, spath)):
            if image_id not in table:
                raise PipelineError(f"{p}: no entry for image {image_id} of {ipath}")
        c = labels[image_id]
        if c not in classes:
            raise PipelineError(f"{lpath}: image {image_id}: class {c} is not in {data_dir / 'classes.txt'}")
        if c in parents:
            raise PipelineError(f"{lpath}: image {image_id}: class {c} ({classes[c]}) is not a leaf of "
                                f"{data_dir / 'hierarchy.txt'}")
        if split[image_id] not in ("0", "1"):
            raise PipelineError(f"{spath}: image {image_id}: {split[image_id]!r} is neither 1 (train) nor 0 (test)")
    label_of = leaf_labels(labels[i] for i, _ in images)
    records = []
    for n, (image_id, rel) in enumerate(images):
        img = data_dir / IMAGES / rel
        if check_images and not img.is_file():
            raise PipelineError(f"NABirds image missing: {img} (image {image_id} of {ipath})")
        c = labels[image_id]
        records.append({"image_id": image_id, "index": n, "split": "train" if split[image_id] == "1" else "test",
                        "image": f"{IMAGES}/{rel}", "captions": [],
                        "labels": {"class_id": c, "label": label_of[c], "class": classes[c],
                                   "ancestors": ancestors(c, parent)},
                        "source": source, "generator_seed": generator_seed})
    if source == "official":
        got = {"images": len(records), "labels": len(label_of)}
        if got != OFFICIAL:
            raise PipelineError(f"{data_dir}: not the NABirds release: {got}, expected {OFFICIAL}")
    report([], warnings, "NABirds")
    return records
