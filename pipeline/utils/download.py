"""Resumable, checksummed downloads (stdlib only), shared by datasets and weights.

Bytes go to ``<target>.part``; an interrupted download resumes with an HTTP Range request (file:// URLs
by seeking); the file is renamed onto the target only after its checksum (when one is known) matches.
"""

from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from pipeline.errors import PipelineError

CHUNK = 1 << 20


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


# -------------------------------------------------------------------------------------------- download
def download(url: str, dest: str | os.PathLike, sha256_prefix: str | None = None, timeout: float = 30.0,
             progress: bool = True) -> Path:
    """Fetch ``url`` (http, https or file) to ``dest``.

    Bytes go to ``<dest>.part``; an existing ``.part`` is resumed with ``Range: bytes=N-`` (a server that
    answers 200 instead of 206 restarts it; file:// URLs resume by seeking). The digest must start with
    ``sha256_prefix`` (when given) before the ``.part`` is renamed onto ``dest``; on a mismatch the ``.part``
    is deleted and PipelineError is raised. Network failures raise ``urllib.error.URLError`` / ``OSError``.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    scheme = urllib.parse.urlparse(url).scheme
    if scheme == "file":
        _copy_local(urllib.request.url2pathname(urllib.parse.urlparse(url).path), part, have, progress)
    elif scheme in ("http", "https"):
        _fetch_http(url, part, have, timeout, progress)
    else:
        raise PipelineError(f"unsupported URL scheme in {url!r} (http, https or file)")
    if sha256_prefix:
        digest = sha256_file(part)
        if not digest.startswith(sha256_prefix.lower()):
            part.unlink()
            raise PipelineError(f"checksum mismatch for {url}: sha256 {digest} does not start with "
                                f"{sha256_prefix} (partial download deleted; try again)")
    os.replace(part, dest)
    return dest


def _bar(total: int | None, initial: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="B", unit_scale=True, desc=desc, disable=not enabled)


def _copy_local(src: str, part: Path, have: int, progress: bool) -> None:
    size = os.path.getsize(src)
    if have > size:
        have = 0
    with open(src, "rb") as fin, open(part, "ab" if have else "wb") as fout, \
            _bar(size, have, part.name, progress) as bar:
        fin.seek(have)
        for block in iter(lambda: fin.read(CHUNK), b""):
            fout.write(block)
            bar.update(len(block))


def _fetch_http(url: str, part: Path, have: int, timeout: float, progress: bool) -> None:
    req = urllib.request.Request(url, headers={"User-Agent": "idc-pipeline"})
    if have:
        req.add_header("Range", f"bytes={have}-")
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # the .part already holds the whole file: let the checksum decide
            return
        raise
    with resp:
        status = getattr(resp, "status", None)
        if have and status != 206:
            have = 0  # the server ignored the range: start over
        length = resp.headers.get("Content-Length")
        total = int(length) + have if length is not None else None
        with open(part, "ab" if have else "wb") as f, _bar(total, have, part.name, progress) as bar:
            for block in iter(lambda: resp.read(CHUNK), b""):
                f.write(block)
                bar.update(len(block))


def try_download(url: str, target: str | os.PathLike, sha256_prefix: str | None = None, **kw) -> Path | None:
    """``download`` that returns None instead of raising when the network is unreachable."""
    try:
        return download(url, target, sha256_prefix=sha256_prefix, **kw)
    except (urllib.error.URLError, OSError, TimeoutError):
        return None
