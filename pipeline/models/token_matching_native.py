"""The C kernels of token-wise matching (``token_matching.c``), compiled on first use and loaded with ctypes.

Compiled with the machine's C compiler (``$CC`` or ``cc``) at ``-O3 -march=native`` into a per-user cache
(``$IDC_CACHE_DIR``, else ``$XDG_CACHE_HOME/idc-pipeline``, else ``~/.cache/idc-pipeline``), under a name
that hashes the source, the flags and the CPU's feature flags: a cluster's shared home directory then holds
one build per CPU kind, and a build is never run on a CPU that lacks its instructions. The build is written
to a temporary name and renamed, so concurrent jobs never load a half-written library.

Where no compiler works, or ``IDC_NATIVE_KERNELS=0``, ``load()`` returns None (with one warning) and the
caller keeps its pure-torch path, which gives the same values and gradients, more slowly. ctypes releases
the GIL during each call, so the worker threads of ``token_matching`` run the kernels in parallel.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("token_matching.c")
FLAG_SETS = (["-O3", "-march=native", "-Wno-psabi"], ["-O3", "-Wno-psabi"])  # the second where -march=native is not understood
_lib: ctypes.CDLL | None = None
_tried = False


def cache_dir() -> Path:
    if os.environ.get("IDC_CACHE_DIR"):
        return Path(os.environ["IDC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "idc-pipeline"


def _cpu_identity() -> str:
    """The CPU's feature flags (Linux) or, elsewhere, what platform says of it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def _compile(cc: str, flags: list[str], out: Path) -> str | None:
    """Build the shared library at ``out``; None on success, else the compiler's complaint."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", tmp, str(SOURCE)], capture_output=True, text=True)
        if r.returncode:
            return (r.stderr or r.stdout).strip()[-500:]
        os.replace(tmp, out)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i64p = ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)
    lib.tm_reduce_chunk.argtypes = [p, i64, i64, i64, i64, i64, p, p, i64p, p, i64p, p, i64p]
    lib.tm_reduce_chunk.restype = ctypes.c_int
    for name in ("tm_backward_dq", "tm_backward_dk"):
        getattr(lib, name).argtypes = [p, p, i64, i64, i64, i64, i64, i64, p, p, p, p, p, i64, i64]
        getattr(lib, name).restype = None
    return lib


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def build(cc: str, flags: list[str], directory: Path) -> ctypes.CDLL:
    """Compile (unless this source, compiler, flags and CPU were built before) and load; OSError on failure."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *flags]).encode() + _cpu_identity().encode())
    out = Path(directory) / f"token_matching-{key.hexdigest()[:16]}.so"
    if not out.exists():
        err = _compile(cc, flags, out)
        if err:
            raise OSError(f"{cc} {' '.join(flags)}: {err}")
    return _declare(ctypes.CDLL(str(out)))


def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built (the caller falls back to torch)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("IDC_NATIVE_KERNELS", "1") == "0":
        return None
    cc = compiler()
    if not cc:
        warnings.warn("token matching: no C compiler found (cc, gcc, clang or $CC); using the slower pure-torch path")
        return None
    errors = []
    for flags in FLAG_SETS:
        try:
            _lib = build(cc, flags, cache_dir())
            return _lib
        except OSError as e:
            errors.append(str(e))
    warnings.warn("token matching: the C kernels could not be built; using the slower pure-torch path.\n"
                  + "\n".join(errors))
    return None


def strides(*values: int):
    return (ctypes.c_int64 * len(values))(*values)
