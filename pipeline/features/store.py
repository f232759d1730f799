"""Read access to a feature file written by ``extract-features`` (docs/contracts.md "Features").

``FeatureStore(path)`` reads the key index and attributes once (opening and closing the file), and opens the
HDF5 file for row reads lazily, once per process: a store built in the parent is safe to hand to forked (or
spawned) DataLoader workers, each of which opens its own handle on first access. Rows are read on demand and
returned as float32; nothing loads the whole feature array.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from pipeline.errors import PipelineError


def _plain(value):
    """HDF5 attribute value → plain Python (lists, str, bool, int, float)."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _float32(a: np.ndarray) -> np.ndarray:
    """``a`` as float32, converted by torch: numpy's float16 → float32 cast is scalar code (a training batch's 96
    rows of layer4, 2048x7x7, half of them zeros: 86 ms read and cast, against 24 ms; one core, 2026-12-03,
    benchmarks/bench_store.py), and it ran on every training batch. The values are the same (the cast is exact)."""
    if a.dtype == np.float32:
        return a
    import torch

    return torch.from_numpy(np.ascontiguousarray(a)).to(torch.float32).numpy()


class FeatureStore:
    def __init__(self, path: str | os.PathLike):
        import h5py

        self.path = Path(path)
        if not self.path.is_file():
            raise PipelineError(f"feature file {self.path} does not exist (run extract-features)")
        try:
            with h5py.File(self.path, "r") as f:
                attrs = {k: _plain(v) for k, v in f.attrs.items()}
                if not attrs.get("complete", False):
                    raise PipelineError(f"feature file {self.path} is incomplete (no complete=True attribute): "
                                        f"re-run extract-features")
                if "features" not in f or "keys" not in f:
                    raise PipelineError(f"feature file {self.path} lacks the 'features' or 'keys' dataset")
                keys = [k.decode("utf-8") if isinstance(k, bytes) else str(k) for k in f["keys"][()]]
                ds = f["features"]
                shape, dtype = tuple(ds.shape), ds.dtype
        except PipelineError:
            raise
        except OSError as e:
            raise PipelineError(f"cannot read feature file {self.path}: {e}") from None
        if len(shape) < 2 or shape[0] != len(keys):
            raise PipelineError(f"feature file {self.path}: 'features' has shape {shape} but there are "
                                f"{len(keys)} keys")
        self._keys = keys
        self._index = {k: i for i, k in enumerate(keys)}
        if len(self._index) != len(keys):
            raise PipelineError(f"feature file {self.path}: duplicate keys")
        self._attrs = attrs
        self._shape = shape[1:]
        self.dtype = dtype
        self._file = None
        self._pid = None

    # ------------------------------------------------------------------------------------ metadata
    @property
    def keys(self) -> list[str]:
        return list(self._keys)

    @property
    def attrs(self) -> dict:
        return dict(self._attrs)

    @property
    def shape(self) -> tuple[int, ...]:
        """Per-item shape, (C, H, W) (or (T, D))."""
        return self._shape

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def index_of(self, key: str) -> int:
        try:
            return self._index[key]
        except KeyError:
            raise PipelineError(f"image key {key!r} missing from feature file {self.path}") from None

    # ---------------------------------------------------------------------------------- row access
    def _dataset(self):
        import h5py

        if self._file is None or self._pid != os.getpid():
            # A handle inherited through fork must not be used (nor closed) in the child: open a fresh one.
            self._file = h5py.File(self.path, "r")
            self._pid = os.getpid()
        return self._file["features"]

    def get(self, key: str) -> np.ndarray:
        i = self.index_of(key)
        return _float32(self._dataset()[i])

    def get_many(self, keys: Sequence[str] | Iterable[str]) -> np.ndarray:
        """float32 [n, *shape] in the order of ``keys`` (duplicates allowed)."""
        return _float32(self.read_rows(keys))

    def read_rows(self, keys: Sequence[str] | Iterable[str]) -> np.ndarray:
        """[n, *shape] in the file's dtype, in the order of ``keys`` (duplicates allowed). Rows are read in
        ascending index order, consecutive rows as one slice, then put back in the requested order."""
        keys = list(keys)
        idx = np.array([self.index_of(k) for k in keys], dtype=np.int64)
        if not len(keys):
            return np.empty((0,) + self._shape, dtype=self.dtype)
        uniq, inverse = np.unique(idx, return_inverse=True)
        ds = self._dataset()
        rows = np.empty((len(uniq),) + self._shape, dtype=ds.dtype)
        # runs of consecutive indices → one hyperslab read each
        breaks = np.flatnonzero(np.diff(uniq) != 1) + 1
        start = 0
        for stop in list(breaks) + [len(uniq)]:
            a, b = int(uniq[start]), int(uniq[stop - 1]) + 1
            rows[start:stop] = ds[a:b]
            start = stop
        return rows[inverse.reshape(-1)]

    # ---------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        if getattr(self, "_file", None) is not None and self._pid == os.getpid():
            try:
                self._file.close()
            except Exception:  # noqa: BLE001 - closing at interpreter exit may fail harmlessly
                pass
        self._file = None
        self._pid = None

    def __enter__(self) -> "FeatureStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_file"] = None
        state["_pid"] = None
        return state

    def __repr__(self) -> str:
        return f"FeatureStore({str(self.path)!r}, n={len(self)}, shape={self._shape})"
