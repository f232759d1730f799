"""Feature-extraction throughput: the plain fp32 loop against this project's extractor path.

    python benchmarks/bench_features.py                       # compute only, batch 32, about a minute on 2 cores
    python benchmarks/bench_features.py --e2e-synthetic 64    # + the whole extract stage on 64 generated PNGs
    python benchmarks/bench_features.py --e2e-dir resources/raw/clevr_change/synthetic/data --e2e-limit 128

(a) plain: the transformers ResNet-101 trunk as built (BatchNorm separate, contiguous NCHW, fp32), one
    forward per batch under ``inference_mode``;
(b) ours: :class:`pipeline.features.backbones.Extractor` (BatchNorm folded into the convolutions,
    channels_last, CPU micro-batches; bf16 autocast on CUDA).
Both on the same random inputs, steps interleaved a, b, a, b, ... after warm-up so that load from other
processes hits both alike; the figures are medians. Weights are random with every residual branch live, as
in a trained trunk (``weights: random`` starts the branches at zero and the extractor then skips them: that
default path is timed separately as ``ours_zero_residuals``).
The end-to-end option times :func:`pipeline.features.extract.extract_to_hdf5`: PNG decoding (background
thread), the CNN and HDF5 writing, model building excluded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# performance-anchors.md: ResNet-101 to layer3, 224², batch 32, 2-core CPU, torch 2.13, random weights
ANCHORS = {"plain fp32": 3.86, "BN folded + channels_last": 8.55, "channels_last only": 6.46, "bf16 autocast": 2.65}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backbone", default="resnet101_layer3")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--steps", type=int, default=5, help="timed batches per variant (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores this process may use)")
    p.add_argument("--skip-compute", action="store_true", help="only the end-to-end run")
    p.add_argument("--e2e-dir", help="time the extract stage on the PNGs under this directory")
    p.add_argument("--e2e-synthetic", type=int, default=0, metavar="N",
                   help="time the extract stage on N generated 480×320 PNGs (CLEVR's size)")
    p.add_argument("--e2e-limit", type=int, default=0, help="at most this many PNGs from --e2e-dir")
    p.add_argument("--workers", type=int, default=1, help="decoding threads for the end-to-end run")
    p.add_argument("--json", help="also write the figures to this JSON file")
    return p.parse_args(argv)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def trained_like(model):
    """Random weights with every residual branch live (γ = 1 in their last BatchNorm), so that no block is
    skipped: the cost of a trained (ImageNet) trunk."""
    import torch

    from pipeline.features import backbones

    backbones.init_random_(model, 0)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "ResNetBottleNeckLayer":
                m.layer[-1].normalization.weight.fill_(1.0)
    backbones.calibrate_batchnorm_(model, torch.randn((4, 3, 128, 128), generator=torch.Generator().manual_seed(0)))
    return model


def bench_compute(args, device) -> dict:
    import torch

    from pipeline.features import backbones

    model = trained_like(backbones.build_backbone(args.backbone)).to(device).eval()
    ours = backbones.Extractor.from_model(model, device)
    default = backbones.Extractor.from_model(backbones.init_random_(backbones.build_backbone(args.backbone), 0),
                                             device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((args.batch_size, 3, args.image_size, args.image_size), generator=gen)
    x_dev = x.to(device)

    def plain():
        with torch.inference_mode():
            backbones.forward_features(model, x_dev).float().cpu()

    def mine():
        ours(x)

    def mine_default():
        default(x)

    variants = {"plain": plain, "ours": mine, "ours_zero_residuals": mine_default}
    times = {k: [] for k in variants}
    cpu = {k: [] for k in variants}
    for _ in range(args.warmup):
        for fn in variants.values():
            fn()
    for step in range(args.steps):
        for name, fn in variants.items():
            _sync(device)
            t, c = time.perf_counter(), time.process_time()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
        print(f"  step {step + 1}/{args.steps}: plain {args.batch_size / times['plain'][-1]:.2f} img/s, "
              f"ours {args.batch_size / times['ours'][-1]:.2f} img/s, ours with weights: random "
              f"{args.batch_size / times['ours_zero_residuals'][-1]:.2f} img/s", flush=True)
    res = {}
    for name in variants:
        res[name] = {"images_per_s": args.batch_size / statistics.median(times[name]),
                     "best_images_per_s": args.batch_size / min(times[name]),
                     "cpu_s_per_image": statistics.median(cpu[name]) / args.batch_size}
    res["ratio"] = res["ours"]["images_per_s"] / res["plain"]["images_per_s"]
    res["ratio_best"] = res["ours"]["best_images_per_s"] / res["plain"]["best_images_per_s"]
    # the check that the fast path computes the same thing
    with torch.inference_mode():
        ref = backbones.forward_features(model, x_dev[:2]).float().cpu()
    got = ours(x[:2])
    res["max_rel_diff"] = float((got - ref).abs().max() / ref.abs().max())
    return res


def _make_pngs(root: Path, n: int) -> list[str]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    keys = []
    (root / "images").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        # smooth-ish content (compresses like a rendered scene, unlike pure noise)
        base = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)
        img = Image.fromarray(base).resize((480, 320), Image.Resampling.BILINEAR)
        key = f"images/CLEVR_default_{i:06d}.png"
        img.save(root / key)
        keys.append(key)
    return keys


def bench_e2e(args, device) -> dict:
    from pipeline.features import backbones
    from pipeline.features.extract import FeatureSettings, extract_to_hdf5

    with tempfile.TemporaryDirectory(prefix="bench_features_") as tmp:
        tmp = Path(tmp)
        if args.e2e_dir:
            raw = Path(args.e2e_dir)
            keys = sorted(str(p.relative_to(raw)) for p in raw.rglob("*.png"))
            if args.e2e_limit:
                keys = keys[: args.e2e_limit]
        else:
            raw = tmp / "data"
            keys = sorted(_make_pngs(raw, args.e2e_synthetic))
        if not keys:
            raise SystemExit(f"no PNGs under {args.e2e_dir}")
        spec = backbones.get_spec(args.backbone)
        model = trained_like(backbones.build_backbone(args.backbone))
        extractor = backbones.Extractor.from_model(model, device)
        settings = FeatureSettings(backbone=spec.id, layer=spec.layer, weights="random(seed=0)",
                                   input_size=args.image_size, mean=(0.485, 0.456, 0.406),
                                   std=(0.229, 0.224, 0.225), dtype="float16",
                                   shape=spec.output_shape(args.image_size), weights_name="random")
        out = tmp / "out" / f"{spec.id}.h5"
        t = time.perf_counter()
        extract_to_hdf5(keys, raw, out, extractor, settings, batch_size=args.batch_size, workers=args.workers,
                        progress=False)
        dt = time.perf_counter() - t
        return {"images": len(keys), "seconds": dt, "images_per_s": len(keys) / dt,
                "file_mb": out.stat().st_size / 1e6}


def main(argv=None) -> int:
    import torch

    from pipeline.utils.seed import pick_device

    args = parse_args(argv)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    device = pick_device(args.device)
    print(f"torch {torch.__version__}, device {device}, {threads} threads, {args.backbone}, batch "
          f"{args.batch_size}, {args.image_size}²", flush=True)
    report: dict = {"device": str(device), "threads": threads, "backbone": args.backbone,
                    "batch_size": args.batch_size, "anchors_images_per_s": ANCHORS}
    if not args.skip_compute:
        res = bench_compute(args, device)
        report["compute"] = res
        print(f"(a) plain fp32 loop (NCHW, BN separate): {res['plain']['images_per_s']:.2f} images/s "
              f"(best {res['plain']['best_images_per_s']:.2f}, {res['plain']['cpu_s_per_image']:.3f} CPU-s/image)")
        print(f"(b) ours (BN folded, channels_last{', bf16' if device.type == 'cuda' else ''}): "
              f"{res['ours']['images_per_s']:.2f} images/s (best {res['ours']['best_images_per_s']:.2f}, "
              f"{res['ours']['cpu_s_per_image']:.3f} CPU-s/image)")
        print(f"(c) ours with the default `weights: random` (zero residual branches skipped, exact): "
              f"{res['ours_zero_residuals']['images_per_s']:.2f} images/s")
        print(f"ratio b/a: {res['ratio']:.2f}x median, {res['ratio_best']:.2f}x best (target >= 2x); "
              f"max |b - a| / max |a| = {res['max_rel_diff']:.1e}")
        print("anchors (performance-anchors.md, same machine kind): plain fp32 3.86, BN folded + channels_last "
              "8.55 (2.21x), channels_last only 6.46, bf16 autocast 2.65 images/s")
    if args.e2e_dir or args.e2e_synthetic:
        res = bench_e2e(args, device)
        report["end_to_end"] = res
        print(f"end to end (decode + CNN + HDF5 float16): {res['images']} images in {res['seconds']:.1f} s = "
              f"{res['images_per_s']:.2f} images/s, file {res['file_mb']:.1f} MB")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
