"""Stage ``extract-features``: backbone features of every image of a manifest, to one HDF5 file.

Image keys are the unique non-empty ``before``/``after`` values of the manifest, sorted; each is a path
relative to ``--raw-dir``. Every image is read with PIL as RGB, resized to S×S with bicubic interpolation
(no crop, as DUDA's extractor), scaled to [0, 1] and normalised with ``--mean``/``--std``, then run through
the backbone (BatchNorm folded, channels_last; bf16 autocast on CUDA). ``--pool N`` average-pools the grid to
N×N before it is stored (a CPU-sized configuration's models read a pooled grid: pooling once here, not at every
training step, and reading a quarter of the bytes; the mean of each 2×2 block, as the models' own pooling).

Output (docs/contracts.md "Features"): ``features`` [N, C, H, W] chunked one item per chunk, ``keys``
(UTF-8), attributes ``backbone, layer, weights, input_size, mean, std, code_version, dtype, complete``.

Resumable and atomic: rows are written into ``<out>.partial`` together with a per-row ``done`` flag,
flushed after every batch. A re-run with the same settings (backbone, weights identity, preprocessing, dtype,
code version, key list and the images' sizes and mtimes) continues with the rows not yet done; with any
other settings it starts over. At the end the flags are dropped, ``complete=True`` is set and the file is
renamed onto ``<out>``. Bad input (PipelineError) removes the partial file: a failed extraction leaves nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import collections
import concurrent.futures
import functools
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

import pipeline
from pipeline.errors import PipelineError

FEATURE_CODE_VERSION = "features-1"  # bump when the bytes an unchanged config produces would change
CODE_VERSION = f"idc-pipeline {pipeline.__version__} ({FEATURE_CODE_VERSION})"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
FLOAT16_MAX = 65504.0


# ------------------------------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--manifest", required=True, help="manifest JSON lines (results/<dataset>/manifest.jsonl)")
    parser.add_argument("--raw-dir", required=True,
                        help="the raw data/ directory the manifest's image keys are relative to")
    parser.add_argument("--backbone", default="resnet101_layer3",
                        help="resnet101_layer3 (1024×14×14 at 224) or resnet101_layer4 (2048×7×7)")
    parser.add_argument("--weights", default="imagenet",
                        help="'imagenet' (torchvision IMAGENET1K_V1, from --weights-dir or downloaded), "
                             "'random' (seeded random init, explicit), or a path to a torchvision-layout "
                             "ResNet-101 state dict")
    parser.add_argument("--weights-dir", default="resources/weights",
                        help="where resnet101-63fe2227.pth is looked up / downloaded to")
    parser.add_argument("--no-download", action="store_true", help="never download weights")
    parser.add_argument("--shortcut", choices=("strided", "avg_down"), default="strided",
                        help="strided shortcuts (ResNet-101 as released), or avg_down: ResNet-D's 2x2 average pool "
                             "before each strided 1x1 shortcut (weights random only; backbones.avg_down_)")
    parser.add_argument("--pool", type=int, default=0,
                        help="average-pool the grid to N×N before storing (0: the backbone's grid as it is; only a "
                             "larger grid that N divides is pooled)")
    parser.add_argument("--out", required=True, help="output .h5 (results/<dataset>/features/<backbone>.h5)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--dtype", choices=("float16", "float32"), default="float16", help="stored dtype")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    parser.add_argument("--seed", type=int, default=0, help="seed (random weights init)")
    parser.add_argument("--image-size", type=int, default=224, help="images are resized to S×S (bicubic)")
    parser.add_argument("--mean", type=float, nargs=3, default=list(IMAGENET_MEAN), metavar=("R", "G", "B"),
                        help="normalisation mean (default ImageNet %(default)s)")
    parser.add_argument("--std", type=float, nargs=3, default=list(IMAGENET_STD), metavar=("R", "G", "B"),
                        help="normalisation std (default ImageNet %(default)s; the official DUDA extractor used "
                             "0.229 0.224 0.224, a typo for the third value: pass that to match it exactly)")
    parser.add_argument("--workers", type=int, default=-1,
                        help="image-decoding threads running ahead of the CNN (-1: 1 on CPU, up to 8 on CUDA; "
                             "0: decode in the main thread)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: the cores this process may use)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> None:
    import torch

    from pipeline.features import backbones, weights as weights_mod
    from pipeline.utils.seed import available_cores, pick_device, seed_everything, set_threads

    spec = backbones.get_spec(args.backbone)
    if args.batch_size < 1:
        raise PipelineError(f"--batch-size must be ≥ 1, got {args.batch_size}")
    if args.image_size < 32:
        raise PipelineError(f"--image-size must be ≥ 32, got {args.image_size}")
    if any(s <= 0 for s in args.std):
        raise PipelineError(f"--std values must be positive, got {args.std}")
    raw_dir = Path(args.raw_dir)
    if not raw_dir.is_dir():
        raise PipelineError(f"raw data directory {raw_dir} does not exist")
    keys = image_keys_from_manifest(args.manifest)
    check_images_exist(keys, raw_dir)  # before the (slow) model build and any download

    seed_everything(args.seed)
    threads = set_threads(args.threads)
    device = pick_device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PipelineError(f"--device {args.device}: CUDA is not available")
    workers = args.workers if args.workers >= 0 else (min(8, available_cores()) if device.type == "cuda" else 1)

    if args.shortcut == "avg_down" and args.weights != "random":
        raise PipelineError(f"--shortcut avg_down needs --weights random: the {args.weights} weights were trained "
                            "with strided shortcuts (set `shortcut: strided` for this backbone in the config)")
    resolved = weights_mod.resolve_weights(args.weights, args.weights_dir, seed=args.seed,
                                           download_ok=not args.no_download)
    model = backbones.build_backbone(args.backbone)
    if args.shortcut == "avg_down":
        backbones.avg_down_(model)
    calibration, scale = None, 1.0
    if resolved.kind == "random":
        # A random backbone stands in for the ImageNet one: its BatchNorm statistics come from a fixed sample
        # of this dataset's images, and its output is scaled so that the sample's mean activation is that of
        # an ImageNet ResNet (RANDOM_FEATURE_MEAN), so that every method sees inputs of the scale its
        # hyper-parameters were tuned for (DUDA sums its features over the 14x14 grid).
        picks = sorted({keys[int(i)] for i in np.linspace(0, len(keys) - 1, min(CALIBRATION_IMAGES, len(keys)))})
        calibration = torch.from_numpy(np.stack([load_image(raw_dir / k, args.image_size, args.mean, args.std)
                                                 for k in picks]))
        weights_mod.apply_weights(model, resolved, calibration)
        scale = RANDOM_FEATURE_MEAN / float(backbones.Extractor.from_model(model, device)(calibration).mean())
        resolved = dataclasses.replace(resolved, identity=f"{resolved.identity[:-1]}, zero-init residuals, "
                                       f"{'avg-down shortcuts, ' if args.shortcut == 'avg_down' else ''}BN calibrated on "
                                       f"{len(picks)} dataset images, mean scaled to {RANDOM_FEATURE_MEAN})")
    else:
        weights_mod.apply_weights(model, resolved)
    shape = spec.output_shape(args.image_size)
    pool = pooled_grid(shape, args.pool)
    extractor = backbones.Extractor.from_model(model, device, output_scale=scale, output_pool=pool)
    del model

    settings = FeatureSettings(
        backbone=spec.id, layer=spec.layer, weights=resolved.identity, weights_name=_weights_name(args.weights),
        input_size=args.image_size, mean=tuple(float(v) for v in args.mean),
        std=tuple(float(v) for v in args.std), dtype=args.dtype,
        shape=(shape[0], pool, pool) if pool else shape, pool=pool)
    print(f"extract-features: {len(keys)} images, {spec.id} {settings.shape}, weights {resolved.identity}, "
          f"device {device}, batch {args.batch_size}, {threads} threads, {workers} decode workers", flush=True)
    t0 = time.perf_counter()
    extract_to_hdf5(keys, raw_dir, args.out, extractor, settings, batch_size=args.batch_size, workers=workers,
                    progress=not args.no_progress)
    dt = time.perf_counter() - t0
    print(f"wrote {args.out} ({len(keys)} images, {dt:.1f} s)", flush=True)


def pooled_grid(shape: Sequence[int], pool: int) -> int:
    """The grid side ``--pool`` gives for a backbone output of ``shape`` (C, H, W): 0 (store as it is) when
    ``pool`` is 0 or not smaller than the grid; an error when it does not divide the grid."""
    if pool < 0:
        raise PipelineError(f"--pool must be ≥ 0, got {pool}")
    h, w = shape[1], shape[2]
    if not pool or (pool >= h and pool >= w):
        return 0
    if h != w or h % pool:
        raise PipelineError(f"--pool {pool} does not divide the {h}x{w} grid into equal blocks")
    return pool


CALIBRATION_IMAGES = 16
RANDOM_FEATURE_MEAN = 0.5  # typical mean activation of an ImageNet ResNet-101 after layer3/layer4


def _weights_name(spec: str) -> str:
    from pipeline.features.weights import IMAGENET_RESNET101

    if spec == "random":
        return "random"
    if spec == "imagenet":
        return f"torchvision ResNet-101 IMAGENET1K_V1 ({IMAGENET_RESNET101.name})"
    return Path(spec).name


# ------------------------------------------------------------------------------------------ inputs
def image_keys_from_manifest(manifest: str | os.PathLike) -> list[str]:
    """The sorted unique non-empty ``before``/``after`` values of a manifest (``image`` of single-image records,
    docs/contracts.md: CUB, NABirds)."""
    from pipeline.utils.io import read_jsonl

    records = read_jsonl(manifest)
    keys: set[str] = set()
    for n, rec in enumerate(records, 1):
        if not isinstance(rec, dict):
            raise PipelineError(f"{manifest}: record {n} is not a JSON object")
        for field_ in ("image",) if "image" in rec else ("before", "after"):
            value = rec.get(field_)
            if value in (None, ""):
                if field_ != "after":
                    raise PipelineError(f"{manifest}: record {n} (pair_id {rec.get('pair_id')!r}) has no "
                                        f"{field_!r} image key")
                continue
            if not isinstance(value, str):
                raise PipelineError(f"{manifest}: record {n}: {field_!r} must be a string, got {value!r}")
            keys.add(value)
    if not keys:
        raise PipelineError(f"{manifest}: no image keys (empty manifest?)")
    return sorted(keys)


def load_image(path: str | os.PathLike, size: int, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """float32 [3, size, size]: RGB, bicubic resize (no crop), /255, (x − mean) / std. A missing, truncated or
    undecodable file raises PipelineError naming it."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            img = img.convert("RGB")  # forces a full decode: a truncated file fails here
            if img.size != (size, size):
                img = img.resize((size, size), Image.Resampling.BICUBIC)
            arr = np.asarray(img, dtype=np.float32)
    except FileNotFoundError:
        raise PipelineError(f"image file {path} does not exist") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise PipelineError(f"cannot decode image {path}: {e}") from None
    arr = arr * (1.0 / 255.0)
    arr -= np.asarray(mean, dtype=np.float32)
    arr /= np.asarray(std, dtype=np.float32)
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


# ------------------------------------------------------------------------------------------ output
@dataclass(frozen=True)
class FeatureSettings:
    backbone: str
    layer: str
    weights: str              # identity: random(seed=S) | sha256:<hex>
    input_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    dtype: str                # float16 | float32
    shape: tuple[int, int, int]
    weights_name: str = ""
    code_version: str = field(default=CODE_VERSION)
    pool: int = 0             # the grid average-pooled to pool×pool before storing (0: not pooled)

    def attrs(self) -> dict:
        out = {"backbone": self.backbone, "layer": self.layer, "weights": self.weights,
               "weights_name": self.weights_name, "input_size": self.input_size,
               "resize": "PIL bicubic to input_size x input_size, no crop", "mean": list(self.mean),
               "std": list(self.std), "code_version": self.code_version, "dtype": self.dtype}
        if self.pool:  # only then: an unpooled file's attributes (and resume fingerprint) stay as they were
            out["grid_pool"] = f"average-pooled to {self.pool}x{self.pool}"
        return out


def check_images_exist(keys: Sequence[str], raw_dir: Path) -> None:
    missing = [k for k in keys if not (raw_dir / k).is_file()]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise PipelineError(f"image file {raw_dir / missing[0]} does not exist "
                            f"({len(missing)} missing: {', '.join(missing[:5])}{more})")


def _fingerprint(settings: FeatureSettings, keys: Sequence[str], raw_dir: Path) -> str:
    """What a partial file must match to be resumed: settings, key list, and each image's size and mtime."""
    check_images_exist(keys, raw_dir)
    h = hashlib.sha256()
    h.update(json.dumps(settings.attrs(), sort_keys=True).encode())
    h.update(json.dumps(list(settings.shape)).encode())
    for k in keys:
        st = os.stat(raw_dir / k)
        h.update(f"{k}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _open_partial(partial: Path, keys: Sequence[str], settings: FeatureSettings, fingerprint: str):
    """Open ``partial`` for resuming if it matches, else create it afresh. Returns (h5py.File, done mask)."""
    import h5py

    if partial.exists():
        f = None
        try:
            f = h5py.File(partial, "r+")
            ok = (f.attrs.get("resume_fingerprint") == fingerprint and "done" in f and "features" in f
                  and f["features"].shape == (len(keys),) + tuple(settings.shape)
                  and f["done"].shape == (len(keys),))
            if ok:
                done = f["done"][()].astype(bool)
                print(f"resuming {partial}: {int(done.sum())}/{len(keys)} images already done", flush=True)
                return f, done
            print(f"{partial} was written with other settings or images: starting over", flush=True)
        except Exception:  # noqa: BLE001 - an unreadable partial (killed mid-write) is simply redone
            print(f"{partial} is unreadable: starting over", flush=True)
        if f is not None:
            try:
                f.close()
            except Exception:  # noqa: BLE001
                pass
        partial.unlink()
    partial.parent.mkdir(parents=True, exist_ok=True)
    f = h5py.File(partial, "w")
    c, hh, ww = settings.shape
    f.create_dataset("features", shape=(len(keys), c, hh, ww), dtype=settings.dtype, chunks=(1, c, hh, ww))
    f.create_dataset("keys", data=list(keys), dtype=h5py.string_dtype("utf-8"))
    f.create_dataset("done", shape=(len(keys),), dtype="u1", fillvalue=0)
    for k, v in settings.attrs().items():
        f.attrs[k] = v
    f.attrs["resume_fingerprint"] = fingerprint
    f.attrs["complete"] = False
    f.flush()
    return f, np.zeros(len(keys), dtype=bool)


def _load_batch(rows: list[int], keys: Sequence[str], raw_dir: Path, size: int, mean, std
                ) -> tuple[list[int], np.ndarray]:
    arr = np.empty((len(rows), 3, size, size), dtype=np.float32)
    for i, r in enumerate(rows):
        arr[i] = load_image(raw_dir / keys[r], size, mean, std)
    return rows, arr


def extract_to_hdf5(keys: Sequence[str], raw_dir: str | os.PathLike, out: str | os.PathLike,
                    extractor: Callable, settings: FeatureSettings, batch_size: int = 32, workers: int = 1,
                    progress: bool = True, on_batch: Callable[[int], None] | None = None) -> Path:
    """Run ``extractor`` (float32 [B,3,S,S] tensor → float32 [B,C,H,W] tensor) over every image and write
    ``out`` (see the module docstring). ``keys`` must be sorted and unique. ``workers`` decoding threads run
    ahead of the CNN (0: decode in the calling thread). ``on_batch(n_done)`` is called after each batch is
    flushed (tests use it to simulate an interruption)."""
    import torch
    from tqdm import tqdm

    keys = list(keys)
    if keys != sorted(set(keys)):
        raise PipelineError("feature keys must be sorted and unique")
    raw_dir, out = Path(raw_dir), Path(out)
    partial = out.with_name(out.name + ".partial")
    fingerprint = _fingerprint(settings, keys, raw_dir)
    f, done = _open_partial(partial, keys, settings, fingerprint)
    try:
        pending = np.flatnonzero(~done).tolist()
        batches = [pending[i:i + batch_size] for i in range(0, len(pending), batch_size)]
        feats_ds, done_ds = f["features"], f["done"]
        n_done = int(done.sum())
        load = functools.partial(_load_batch, keys=keys, raw_dir=raw_dir, size=settings.input_size,
                                 mean=settings.mean, std=settings.std)
        bar = tqdm(total=len(keys), initial=n_done, unit="img", desc=f"features {settings.backbone}",
                   disable=not progress, dynamic_ncols=True)
        with bar, concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            ahead: collections.deque = collections.deque()
            todo = iter(batches)

            def submit_next() -> None:
                rows = next(todo, None)
                if rows is not None:
                    ahead.append(pool.submit(load, rows) if workers > 0 else rows)

            for _ in range(max(1, workers) + 1):  # bounded read-ahead: memory is a few batches
                submit_next()
            try:
                while ahead:
                    item = ahead.popleft()
                    rows, pixels = item.result() if workers > 0 else load(item)
                    submit_next()
                    feats = extractor(torch.from_numpy(pixels)).numpy()
                    if feats.shape != (len(rows),) + tuple(settings.shape):
                        raise PipelineError(f"extractor returned {feats.shape[1:]}, expected {settings.shape} "
                                            f"for {settings.backbone} at {settings.input_size}px")
                    _check_values(feats, rows, keys, settings.dtype)
                    feats = feats.astype(settings.dtype, copy=False)
                    _write_rows(feats_ds, rows, feats)
                    _write_flags(done_ds, rows)
                    f.flush()
                    n_done += len(rows)
                    bar.update(len(rows))
                    if on_batch is not None:
                        on_batch(n_done)
            finally:
                for fut in ahead:
                    if isinstance(fut, concurrent.futures.Future):
                        fut.cancel()
        if not bool(done_ds[()].all()):  # cannot happen unless the file was changed under us
            raise PipelineError(f"{partial}: not every row was written; re-run to resume")
        del f["done"]
        del f.attrs["resume_fingerprint"]
        f.attrs["complete"] = True
        f.close()
        f = None
        os.replace(partial, out)
    except PipelineError:
        # Bad input (an undecodable image, features out of the dtype's range): its fix changes the resume
        # fingerprint, so the rows done are of no use to the next run; leave nothing behind.
        _close(f)
        f = None
        partial.unlink(missing_ok=True)
        raise
    finally:
        _close(f)
    return out


def _close(f) -> None:
    if f is not None:
        try:
            f.close()
        except Exception:  # noqa: BLE001
            pass


def _check_values(feats: np.ndarray, rows: list[int], keys: Sequence[str], dtype: str) -> None:
    if not np.isfinite(feats).all():
        bad = [keys[r] for r, ok in zip(rows, np.isfinite(feats).reshape(len(rows), -1).all(1)) if not ok]
        raise PipelineError(f"non-finite features for image {bad[0]} ({len(bad)} in this batch)")
    if dtype == "float16":
        peak = float(np.abs(feats).max(initial=0.0))
        if peak > FLOAT16_MAX:
            raise PipelineError(f"features reach |x| = {peak:.4g}, beyond float16 (images {keys[rows[0]]} ...): "
                                f"use --dtype float32")


def _runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """(position in batch, first row, row count) for each run of consecutive rows."""
    out, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            out.append((start, rows[start], i - start))
            start = i
    return out


def _write_rows(ds, rows: list[int], values: np.ndarray) -> None:
    for pos, first, n in _runs(rows):
        ds[first:first + n] = values[pos:pos + n]


def _write_flags(ds, rows: list[int]) -> None:
    for _, first, n in _runs(rows):
        ds[first:first + n] = 1
