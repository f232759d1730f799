"""Feature reads of a training batch: ``FeatureStore.get_many`` (the rows as float32, cast by torch) against the
same read cast by numpy (the store before 2026-12-03), in the same run.

Every training step of a feature-based method reads its batch's before, after and distractor rows (96 rows at
batch 32): numpy's float16 → float32 cast is scalar code, ~60 of the 86 ms such a batch of the 2048×7×7 layer4
grid took on one core (~10 % of an IDC-PCL step), on a background thread sharing the two cores with the training jobs.

    python benchmarks/bench_store.py                      # a synthetic float16 file like layer4 (2048x7x7)
    python benchmarks/bench_store.py --features results/clevr_change/features/resnet101_layer4.h5
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch

from pipeline.features.store import FeatureStore


def numpy_reference(store: FeatureStore, keys: list[str]) -> np.ndarray:
    """The earlier read: the same hyperslab reads, cast to float32 by numpy."""
    return store.read_rows(keys).astype(np.float32)


def synthetic(path: Path, n: int, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        # post-ReLU like the real grids (half of the stored layer4 values are exact zeros): numpy's scalar cast
        # branches on the exponent, so the value mix matters to the reference's speed
        x = np.maximum(rng.standard_normal((n, *shape), dtype=np.float32), 0).astype(np.float16)
        f.create_dataset("features", data=x, chunks=(1, *shape))
        f.create_dataset("keys", data=np.array([f"img{i:05d}.png" for i in range(n)], dtype=h5py.string_dtype()))
        f.attrs["complete"] = True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--features", default=None, help="a feature file (default: a synthetic float16 2048x7x7 one)")
    p.add_argument("--rows", type=int, default=96, help="rows per read (batch 32: before, after, distractor)")
    p.add_argument("--reads", type=int, default=30)
    a = p.parse_args()
    torch.set_num_threads(1)  # as a training job's loader: one thread
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(a.features) if a.features else Path(tmp) / "layer4.h5"
        if not a.features:
            synthetic(path, 600, (2048, 7, 7))
        with FeatureStore(path) as store:
            rng = np.random.default_rng(0)
            batches = [[store.keys[i] for i in rng.choice(len(store), a.rows, replace=False)] for _ in range(a.reads)]
            np.testing.assert_array_equal(store.get_many(batches[0]), numpy_reference(store, batches[0]))
            times = {}
            for name, read in (("numpy cast (reference)", lambda k: numpy_reference(store, k)),
                               ("FeatureStore.get_many", store.get_many)):
                read(batches[0])  # page cache and file handle warm for both
                t = time.perf_counter()
                for keys in batches:
                    read(keys)
                times[name] = (time.perf_counter() - t) / a.reads
                print(f"{name:24s} {1000 * times[name]:7.1f} ms per {a.rows} rows "
                      f"({a.rows / times[name]:,.0f} rows/s), {store.dtype} {store.shape}")
            print(f"ratio: {times['numpy cast (reference)'] / times['FeatureStore.get_many']:.2f}x faster than the reference")


if __name__ == "__main__":
    main()
