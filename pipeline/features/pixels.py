"""Stage ``cache-pixels``: every image of a manifest, resized once, as uint8 pixels in a feature file.

CLIP4IDC fine-tunes CLIP on raw pixels (seed paper §1, appendix B); the official code decodes and resizes
every PNG again at every epoch. Here each image is decoded once and every epoch reads a contiguous uint8
row from HDF5 instead.

Preprocessing is the official CLIP4IDC transform without its normalisation: PIL RGB, bicubic resize to
224×224, no crop (``dataloaders/rawimage_util.py``). The values are stored as uint8 0-255; the model
applies the CLIP mean/std itself (``pipeline.models.clip4idc``), so the file stays exact and 4× smaller
than float32.

The file follows the feature-file contract (docs/contracts.md "Features"): datasets ``features``
[N, 3, 224, 224] uint8 (one item per chunk) and ``keys``, attributes ``backbone = clip_pixels224``,
``weights = none``, ``complete = True``, read with ``pipeline.features.store.FeatureStore`` (which returns
float32 0-255). Writing reuses ``pipeline.features.extract``: its image loader, its resumable ``.partial``
file with per-row ``done`` flags, and its atomic rename. The "extractor" is the identity with rounding:
``load_image`` with mean 0 and std 1/255 returns the resized pixels in 0-255 (up to float rounding, which
``round`` removes exactly), so the stored bytes are PIL's resized uint8 values.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pipeline.errors import PipelineError

BACKBONE = "clip_pixels224"
SIZE = 224
LAYER = "pixels: uint8 RGB 0-255 (CLIP mean/std are applied by the model)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--manifest", required=True, help="manifest JSON lines (results/<dataset>/manifest.jsonl)")
    parser.add_argument("--raw-dir", required=True, help="the raw data/ directory the image keys are relative to")
    parser.add_argument("--out", required=True, help=f"output .h5 (results/<dataset>/features/{BACKBONE}.h5)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="image-decoding threads (0: main thread)")
    parser.add_argument("--no-progress", action="store_true")


def settings():
    from pipeline.features.extract import FeatureSettings

    return FeatureSettings(backbone=BACKBONE, layer=LAYER, weights="none", weights_name="none (raw pixels)",
                           input_size=SIZE, mean=(0.0, 0.0, 0.0), std=(1 / 255,) * 3, dtype="uint8",
                           shape=(3, SIZE, SIZE))


def to_uint8_range(pixels):
    """The identity "extractor": undo float rounding of load_image's (x/255 - 0) / (1/255)."""
    return pixels.round_().clamp_(0, 255)


def cache_pixels(keys, raw_dir, out, batch_size: int = 64, workers: int = 2, progress: bool = True,
                 on_batch=None) -> Path:
    from pipeline.features.extract import extract_to_hdf5

    return extract_to_hdf5(keys, raw_dir, out, to_uint8_range, settings(), batch_size=batch_size,
                           workers=workers, progress=progress, on_batch=on_batch)


def run(args: argparse.Namespace) -> None:
    from pipeline.features.extract import check_images_exist, image_keys_from_manifest

    if args.batch_size < 1:
        raise PipelineError(f"--batch-size must be ≥ 1, got {args.batch_size}")
    raw_dir = Path(args.raw_dir)
    if not raw_dir.is_dir():
        raise PipelineError(f"raw data directory {raw_dir} does not exist")
    keys = image_keys_from_manifest(args.manifest)
    check_images_exist(keys, raw_dir)
    t0 = time.perf_counter()
    cache_pixels(keys, raw_dir, args.out, args.batch_size, args.workers, not args.no_progress)
    print(f"cache-pixels: {len(keys)} images -> {args.out} ({time.perf_counter() - t0:.1f} s)", flush=True)
