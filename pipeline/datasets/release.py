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


def read_columns(path: Path, n: int, what: str, rest: bool = False) -> list[list[str]]:
    """The lines of a whitespace-separated text file of the CUB / NABirds releases (``<id> <value> ...``), each
    split into ``n`` fields (``rest``: the last field is the rest of the line, a name with spaces); blank lines
    skipped. A missing file or a short line is one PipelineError naming the file (and line)."""
    if not path.is_file():
        raise PipelineError(f"{what} file missing: {path}")
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split(maxsplit=n - 1) if rest else line.split()
        if len(fields) != n:
            raise PipelineError(f"{path}: line {i}: expected {n} fields, got {line.strip()[:120]!r}")
        out.append([f.strip() for f in fields])
    return out


def ids_unique(rows: list[list[str]], path: Path) -> dict[str, list[str]]:
    """``rows`` keyed by their first field; a repeated id is a PipelineError naming the file."""
    out: dict[str, list[str]] = {}
    for r in rows:
        if r[0] in out:
            raise PipelineError(f"{path}: id {r[0]} occurs twice")
        out[r[0]] = r[1:]
    return out
