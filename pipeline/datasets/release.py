"""What the parsers of releases made of one JSON file per split share: reading a split's file (its sha256
checked for ``official``) and handing their warnings to ``inspect`` (or printing them)."""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.utils.download import sha256_file
from pipeline.utils.io import read_json


def check_release_file(path: Path, digest: str, n_bytes: int, repo: str) -> None:
    """A release's annotation file read as ``official``: its sha256 must be the released file's, else one
    PipelineError naming the file, both digests and sizes, and the repository to download it from again."""
    got = sha256_file(path)
    if got != digest:
        raise PipelineError(f"{path}: sha256 {got} is not the released {path.name}'s ({digest}; "
                            f"{path.stat().st_size} bytes, the release's {n_bytes}); re-download it from {repo}")


def read_split_file(path: Path, source: str, release: tuple[str, int, str], what: str, shape: str) -> list:
    """The JSON list in one split's file ``path`` (``what`` names it in the error of a missing file, ``shape``
    its entries in the error of a non-list); for ``official`` first checked against ``release``, the released
    file's (sha256, bytes, repository). Invalid JSON is read_json's error naming the file."""
    if not path.is_file():
        raise PipelineError(f"{what} file missing: {path}")
    if source == "official":
        check_release_file(path, *release)
    entries = read_json(path)
    if not isinstance(entries, list):
        raise PipelineError(f"{path}: expected a JSON list of {shape} objects, got {type(entries).__name__}")
    return entries


def report(local: list[str], warnings: list[str] | None, dataset: str) -> None:
    """A parser's warnings: into ``warnings`` when a list is given (the ``inspect`` stage), else printed."""
    if warnings is not None:
        warnings.extend(local)
    else:
        for w in local:
            print(f"{dataset}: {w}")
