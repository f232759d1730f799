"""Stage ``fetch``: obtain an official dataset release, or verify a copy placed by hand.

Order: an extracted ``data/`` folder already in place → verify; else the archive in place → extract;
else download the published archive (resumable) → extract. When nothing works (offline, dead link),
stop with one message that says which file to place where. Writes ``<root>/verified.json`` last.

Spot-the-Diff (reference/datasets.md §3) comes in two parts: the annotation files, each downloaded from the
GitHub repository to ``data/annotations/<split>.json`` and sha256-checked (a file placed by hand is checked
by the parser), and the image archive ``resized_images.zip`` (Drive), extracted to ``data/resized_images/``.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import tarfile
import zipfile
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.utils.download import try_download
from pipeline.utils.io import atomic_path, read_json, write_json

RELEASES = {
    "clevr_change": {
        "archive": "clevr_change.tar.gz",
        "page": "https://drive.google.com/file/d/1HJ3gWjaUJykEckyb2M0MB4HnrJSihjVe/view",
        "url": "https://drive.usercontent.google.com/download?id=1HJ3gWjaUJykEckyb2M0MB4HnrJSihjVe&export=download&confirm=t",
        "archive_sha256": None,  # not published
        "check": "pipeline.datasets.clevr_change",
    },
    "spot_the_diff": {
        "archive": "resized_images.zip",
        "page": "https://drive.google.com/file/d/1OVb4_3Uec_xbyUk90aWC6LFpKsIOtR7v/view",
        "url": "https://drive.usercontent.google.com/download?id=1OVb4_3Uec_xbyUk90aWC6LFpKsIOtR7v&export=download&confirm=t",
        "archive_sha256": None,  # not published
        # the annotation files, from the repository (their sha256: pipeline.datasets.spot_the_diff.OFFICIAL_SHA256)
        "annotations": "https://github.com/harsh19/spot-the-diff/raw/master/data/annotations/{split}.json",
        "check": "pipeline.datasets.spot_the_diff",
    },
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", required=True, choices=sorted(RELEASES))
    p.add_argument("--root", required=True, help="e.g. resources/raw/clevr_change/official")
    p.add_argument("--no-download", action="store_true", help="only use files already in place")


def _placement_message(dataset: str, root: Path) -> str:
    rel = RELEASES[dataset]
    if "annotations" in rel:
        from pipeline.datasets import spot_the_diff as sd

        return (f"cannot obtain the official {dataset} release: download failed or disabled. Place the annotation "
                f"files {', '.join(f'{s}.json' for s in sd.SPLITS)} from {rel['annotations'].format(split='<split>')} "
                f"in {root / 'data' / sd.ANNOTATIONS}, and download {rel['archive']} from {rel['page']} to "
                f"{root / rel['archive']} (or extract it so that {root / 'data' / sd.IMAGES}/<img_id>.png and "
                f"<img_id>_2.png exist), then run again.")
    return (f"cannot obtain the official {dataset} release: download failed or disabled. "
            f"Download {rel['archive']} from {rel['page']} and place it at {root / rel['archive']} "
            f"(or extract it so that {root / 'data' / 'splits.json'} exists), then run again.")


def _extract(archive: Path, target: Path, top_level_required: bool = True) -> None:
    """Extract ``archive`` (tar or zip) to the folder ``target``, atomically: a failed extraction leaves no
    ``target``. The archive holds it as a top-level folder of the same name (required for a tar: CLEVR-Change's
    ``data/``); a zip without that single folder holds its files at its root (``resized_images.zip``)."""
    # The staging folder is named after atomic_path's temporary (".data.<8>.tmp.x"), so one that a killed
    # extraction left is removed by the next try's atomic_path; one that a failed extraction leaves, here.
    staging = None
    try:
        is_zip = zipfile.is_zipfile(archive)
        with (zipfile.ZipFile(archive) if is_zip else tarfile.open(archive)) as arc, atomic_path(target) as tmp:
            staging = tmp.with_name(tmp.name + ".x")
            if is_zip:
                arc.extractall(staging)  # zipfile drops absolute paths and ".." itself
            else:
                arc.extractall(staging, filter="data")
            inner = staging / target.name
            if top_level_required and not inner.is_dir():
                raise PipelineError(f"{archive}: archive has no top-level {target.name}/ folder")
            if not top_level_required and not (inner.is_dir() and len(list(staging.iterdir())) == 1):
                inner = staging
            inner.rename(tmp)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as e:
        raise PipelineError(f"{archive}: cannot extract ({e}); delete it and download again") from None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def verify_clevr_change(data: Path) -> dict:
    from pipeline.datasets import clevr_change as cc

    report = {}
    for name, digest in cc.OFFICIAL_SHA256.items():
        got = hashlib.sha256((data / name).read_bytes()).hexdigest()
        report[name] = {"sha256": got, "matches_official": got == digest}
    splits = read_json(data / "splits.json")
    sizes = {k: len(v) for k, v in splits.items()}
    report["split_sizes"] = sizes
    if sizes != cc.OFFICIAL_SPLIT_SIZES:
        report["warning"] = f"split sizes {sizes} differ from the official {cc.OFFICIAL_SPLIT_SIZES}"
    records = cc.parse(data, source="official")  # raises on a missing image or caption
    report["pairs"] = len(records)
    return report


def verify_spot_the_diff(data: Path) -> dict:
    from pipeline.datasets import spot_the_diff as sd

    records = sd.parse(data, source="official")  # raises on a checksum, a missing file or image
    counts = sd.source_counts(data, "official")
    report = {"annotations_sha256": dict(sd.OFFICIAL_SHA256), "counts": counts, "pairs": len(records)}
    if {s: {k: c[k] for k in sd.OFFICIAL_COUNTS[s]} for s, c in counts.items()} != sd.OFFICIAL_COUNTS:
        report["warning"] = f"counts differ from the release's {sd.OFFICIAL_COUNTS}"
    return report


def fetch_spot_the_diff(root: Path, no_download: bool) -> dict:
    from pipeline.datasets import spot_the_diff as sd

    rel = RELEASES["spot_the_diff"]
    data = root / "data"
    for split in sd.SPLITS:
        target = sd.annotation_path(data, split)
        if target.is_file():
            continue  # placed by hand or downloaded before: the parser checks its sha256
        got = None if no_download else try_download(rel["annotations"].format(split=split), target,
                                                     sha256_prefix=sd.OFFICIAL_SHA256[split], progress=False)
        if got is None:
            raise PipelineError(_placement_message("spot_the_diff", root))
    images = data / sd.IMAGES
    if not images.is_dir():
        _extract(_archive(root, "spot_the_diff", no_download, b"PK"), images, top_level_required=False)
    return verify_spot_the_diff(data)


def _archive(root: Path, dataset: str, no_download: bool, magic: bytes) -> Path:
    """The release's archive at ``root``: placed by hand, or downloaded (resumable); the placement message when
    neither works. A download that does not start with ``magic`` (Drive answers an HTML page when it refuses)
    is kept as ``<archive>.html`` for a look, and is the placement message too."""
    rel = RELEASES[dataset]
    archive = root / rel["archive"]
    if not archive.is_file():
        got = None if no_download else try_download(rel["url"], archive, sha256_prefix=rel["archive_sha256"])
        if got is None:
            raise PipelineError(_placement_message(dataset, root))
        with open(got, "rb") as f:  # the archive may be gigabytes: read its first bytes only
            head = f.read(len(magic))
        if head != magic:
            got.rename(got.with_name(got.name + ".html"))
            raise PipelineError(_placement_message(dataset, root))
    return archive


def fetch_clevr_change(root: Path, no_download: bool) -> dict:
    data = root / "data"
    if not (data / "splits.json").is_file():
        _extract(_archive(root, "clevr_change", no_download, b"\x1f\x8b"), data)
    return verify_clevr_change(data)


FETCHERS = {"clevr_change": fetch_clevr_change, "spot_the_diff": fetch_spot_the_diff}


def run(args: argparse.Namespace) -> None:
    root = Path(args.root)
    report = FETCHERS[args.dataset](root, args.no_download)
    write_json(root / "verified.json", {"dataset": args.dataset, **report})
    print(f"fetch: {args.dataset} verified at {root / 'data'}: {report}")
