"""Stage ``fetch``: obtain an official dataset release, or verify a copy placed by hand.

Order: an extracted ``data/`` folder already in place → verify; else the archive in place → extract;
else download the published archive (resumable) → extract. When nothing works (offline, dead link),
stop with one message that says which file to place where. Writes ``<root>/verified.json`` last.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import tarfile
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
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", required=True, choices=sorted(RELEASES))
    p.add_argument("--root", required=True, help="e.g. resources/raw/clevr_change/official")
    p.add_argument("--no-download", action="store_true", help="only use files already in place")


def _placement_message(dataset: str, root: Path) -> str:
    rel = RELEASES[dataset]
    return (f"cannot obtain the official {dataset} release: download failed or disabled. "
            f"Download {rel['archive']} from {rel['page']} and place it at {root / rel['archive']} "
            f"(or extract it so that {root / 'data' / 'splits.json'} exists), then run again.")


def _extract(archive: Path, root: Path) -> None:
    # The staging folder is named after atomic_path's temporary (".data.<8>.tmp.x"), so one that a killed
    # extraction left is removed by the next try's atomic_path; one that a failed extraction leaves, here.
    staging = None
    try:
        with tarfile.open(archive) as tar, atomic_path(root / "data") as tmp:
            staging = tmp.with_name(tmp.name + ".x")
            tar.extractall(staging, filter="data")
            inner = staging / "data"
            if not inner.is_dir():
                raise PipelineError(f"{archive}: archive has no top-level data/ folder")
            inner.rename(tmp)
    except (tarfile.TarError, EOFError, OSError) as e:
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


def run(args: argparse.Namespace) -> None:
    root = Path(args.root)
    rel = RELEASES[args.dataset]
    data = root / "data"
    if not (data / "splits.json").is_file():
        archive = root / rel["archive"]
        if not archive.is_file():
            got = None if args.no_download else try_download(rel["url"], archive, sha256_prefix=rel["archive_sha256"])
            if got is None:
                raise PipelineError(_placement_message(args.dataset, root))
            if got.read_bytes()[:2] != b"\x1f\x8b":  # Drive answers an HTML page when it refuses
                got.rename(got.with_name(got.name + ".html"))
                raise PipelineError(_placement_message(args.dataset, root))
        _extract(archive, root)
    report = verify_clevr_change(data)
    write_json(root / "verified.json", {"dataset": args.dataset, **report})
    print(f"fetch: {args.dataset} verified at {data}: {report}")
