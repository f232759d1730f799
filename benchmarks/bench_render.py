"""Throughput of the synthetic CLEVR-Change renderer (a script, not a test).

    python benchmarks/bench_render.py [--n 20] [--workers 2] [--width 480 --height 320]

Renders ``--n`` index triplets (before, semantic after, distractor) and prints images/s and ms per image
for one process (split into scene sampling + captions, rendering, PNG encoding), then for a pool of
``--workers`` processes (sampling + rendering + PNG encoding, nothing written to disk).
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from PIL import Image  # noqa: E402

from pipeline.synth.render import render  # noqa: E402
from pipeline.synth.scene import make_example  # noqa: E402

SEED = 12345


def _png_bytes(rgb) -> int:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.tell()


def _one_index(task) -> int:
    index, n, width, height = task
    ex = make_example(SEED, index, n, width, height)
    size = 0
    for objs, view in ((ex.before, ex.view_before), (ex.after, ex.view_after), (ex.before, ex.view_distractor)):
        rgb, _ = render([o.primitive() for o in objs], view.camera, view.lights, width, height)
        size += _png_bytes(rgb)
    return size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20, help="index triplets (default 20)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--width", type=int, default=480)
    ap.add_argument("--height", type=int, default=320)
    args = ap.parse_args()
    n, w, h = args.n, args.width, args.height
    n_img = 3 * n

    # warm-up (imports, first-call overheads)
    _one_index((0, n, w, h))

    t_scene = t_render = t_png = 0.0
    for i in range(n):
        t0 = time.perf_counter()
        ex = make_example(SEED, i, n, w, h)
        t1 = time.perf_counter()
        imgs = []
        for objs, view in ((ex.before, ex.view_before), (ex.after, ex.view_after), (ex.before, ex.view_distractor)):
            imgs.append(render([o.primitive() for o in objs], view.camera, view.lights, w, h)[0])
        t2 = time.perf_counter()
        for rgb in imgs:
            _png_bytes(rgb)
        t3 = time.perf_counter()
        t_scene += t1 - t0
        t_render += t2 - t1
        t_png += t3 - t2
    total = t_scene + t_render + t_png
    print(f"image size {w}x{h}, {n} index triplets = {n_img} images")
    print(f"1 process : {n_img / total:6.1f} images/s  {1000 * total / n_img:6.1f} ms/image  "
          f"(scene+captions {1000 * t_scene / n_img:.1f}, render {1000 * t_render / n_img:.1f}, "
          f"png {1000 * t_png / n_img:.1f} ms/image; render only {n_img / t_render:.1f} images/s)")

    rate, used = n_img / total, 1
    if args.workers > 1:
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
        tasks = [(i, n, w, h) for i in range(n)]
        with ctx.Pool(args.workers) as pool:
            pool.map(_one_index, tasks[: args.workers])  # warm-up
            t0 = time.perf_counter()
            pool.map(_one_index, tasks, chunksize=1)
            dt = time.perf_counter() - t0
        print(f"{args.workers} workers : {n_img / dt:6.1f} images/s  {1000 * dt / n_img:6.1f} ms/image (wall)")
        rate, used = n_img / dt, args.workers
    print(f"estimated default world (600 indices x 3 images) with {used} process(es): ~{1800 / rate:.0f} s "
          "(plus file writing)")


if __name__ == "__main__":
    main()
