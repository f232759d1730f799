"""Stage ``synth-clevr-dc``: render a synthetic CLEVR-DC world in the release's layout.

    python -m pipeline synth-clevr-dc --out resources/raw/clevr_dc/synthetic --per-block 200 --seed 0

writes ``OUT/data/`` as the release extracts (reference/datasets.md §2; parsed by
``pipeline.datasets.clevr_dc``): ``images/<n>.png`` (before) and ``sc_images/<n>.png`` (after), unpadded,
``captions.json`` (``{"<n>": [caption, ...]}``) and ``split.json``, plus ``OUT/SYNTHETIC.json`` and
``OUT/scenes.jsonl``. Indices keep the release's blocks: block k (colour, material, add, drop, move, none)
holds indices ``8000k .. 8000k + per_block - 1``, and each block is split as the release splits it (its first
85 % train, the next 5 % val, the last 10 % test).

Each pair is the CLEVR-Change scene model (``pipeline.synth.scene``) with CLEVR-DC's two differences: the
after camera moves drastically (``CAMERA_MOVE``: 30-90° of azimuth either way, elevation and distance
changed too; the lights are jittered), and the captions name objects without any viewpoint word, by their
attributes or by comparison with another object (``captions.dc_change_captions``). The "none" block is the
distractor: the same objects seen from the moved camera, with no-change captions.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import numpy as np

from pipeline.datasets.clevr_dc import BLOCK, BLOCK_TYPES, NO_CHANGE
from pipeline.errors import PipelineError
from pipeline.synth import captions as cap
from pipeline.synth.render import render
from pipeline.synth.scene import (
    LIGHT_JITTER,
    View,
    all_visible,
    apply_change,
    check_size,
    default_view,
    jitter_view,
    object_count_range,
    sample_scene,
)
from pipeline.synth.world import meta_path, render_world, save_png
from pipeline.utils.io import read_json, write_json, write_jsonl

GENERATOR = "pipeline.synth.clevr_dc"
VERSION = "1.0.0"
SUBDIRS = ("images", "sc_images")
SPLIT_FRACTIONS = (0.85, 0.05, 0.10)  # the release's, per block
CAPTIONS_PER_PAIR = 6
# The after camera's move from the before view: |Δazimuth| uniform in [30, 90] degrees (either side),
# Δelevation uniform in [-8, 12] degrees, distance scaled by 1 + uniform[-0.1, 0.25].
CAMERA_MOVE = {"azimuth_deg": (30.0, 90.0), "elevation_deg": (-8.0, 12.0), "distance_rel": (-0.1, 0.25)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output directory; data/ is created inside it")
    parser.add_argument("--per-block", type=int, default=200,
                        help="pairs per action block (6 blocks; the release has 8000; default 200)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    parser.add_argument("--workers", type=int, default=1, help="rendering processes (default 1)")
    parser.add_argument("--width", type=int, default=480, help="image width in pixels (default 480)")
    parser.add_argument("--height", type=int, default=320, help="image height in pixels (default 320)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> None:
    generate(args.out, per_block=args.per_block, seed=args.seed, workers=args.workers, width=args.width,
             height=args.height, progress=not args.no_progress)


def indices(per_block: int) -> list[int]:
    return [BLOCK * k + j for k in range(len(BLOCK_TYPES)) for j in range(per_block)]


def make_split(per_block: int) -> dict[str, list[int]]:
    n_train = int(round(per_block * SPLIT_FRACTIONS[0]))
    n_val = max(1, int(round(per_block * SPLIT_FRACTIONS[1])))
    out: dict[str, list[int]] = {"train": [], "val": [], "test": []}
    for k in range(len(BLOCK_TYPES)):
        b = BLOCK * k
        out["train"] += range(b, b + n_train)
        out["val"] += range(b + n_train, b + n_train + n_val)
        out["test"] += range(b + n_train + n_val, b + per_block)
    return out


def moved_view(rng: np.random.Generator, base: View | None = None) -> View:
    """The base view seen from a drastically moved camera (``CAMERA_MOVE``), under jittered lights."""
    base = base or default_view()
    az, el, dist = base.orbit
    m = CAMERA_MOVE
    d_az = float(rng.uniform(*m["azimuth_deg"])) * (1.0 if rng.random() < 0.5 else -1.0)
    orbit = (az + d_az, el + float(rng.uniform(*m["elevation_deg"])),
             dist * (1.0 + float(rng.uniform(*m["distance_rel"]))))
    lights = jitter_view(rng, View(orbit, base.light_rig))  # the lights' jitter; its camera jitter is dropped
    return View(orbit, lights.light_rig)


def make_pair(seed: int, index: int, width: int, height: int, n_captions: int = CAPTIONS_PER_PAIR) -> dict:
    """The complete, deterministic content of one pair: scenes, views, change and captions."""
    rng = np.random.default_rng([int(seed), int(index)])
    ctype = BLOCK_TYPES[index // BLOCK]
    size = check_size(width, height)
    view_before = default_view()
    lo, hi = object_count_range(ctype if ctype != NO_CHANGE else "move")
    for _ in range(200):
        before = sample_scene(rng, int(rng.integers(lo, hi + 1)), view_before, size)
        view_after = moved_view(rng)
        if ctype == NO_CHANGE:
            if all_visible(before, view_after, size):
                return {"index": index, "change_type": ctype, "before": before, "after": before, "change": None,
                        "views": (view_before, view_after), "captions": cap.no_change_captions(rng, n_captions)}
            continue
        res = apply_change(rng, before, ctype, view_after, size, view_before.camera)
        if res is None:
            continue
        after, change = res
        scene, target = (after, change.after_index) if ctype == "add" else (before, change.before_index)
        new_value = change.new if ctype in ("color", "material") else None
        try:
            caps = cap.dc_change_captions(rng, ctype, scene, target, new_value, n=n_captions)
        except ValueError:  # not nameable without a viewpoint word: draw another scene
            continue
        return {"index": index, "change_type": ctype, "before": before, "after": after, "change": change,
                "views": (view_before, view_after), "captions": caps}
    raise RuntimeError(f"index {index}: no valid {ctype} pair found")


def _work(task) -> int:
    partial, index, params = task
    partial = Path(partial)
    width, height = params["image_size"]
    pair = make_pair(params["seed"], index, width, height)
    digest = hashlib.sha256()
    for sub, objs, view in zip(SUBDIRS, (pair["before"], pair["after"]), pair["views"]):
        rgb, _ = render([o.primitive() for o in objs], view.camera, view.lights, width, height)
        save_png(partial / "data" / sub / f"{index}.png", rgb)
        digest.update(np.ascontiguousarray(rgb).tobytes())
    scene = {"index": index, "change_type": pair["change_type"],
             "change": pair["change"].to_dict() if pair["change"] else None,
             "before": [o.to_dict() for o in pair["before"]], "after": [o.to_dict() for o in pair["after"]],
             "views": {"before": pair["views"][0].to_dict(), "after": pair["views"][1].to_dict()}}
    write_json(meta_path(partial, index), {"captions": pair["captions"], "pixel_sha256": digest.hexdigest(),
                                           "scene": scene}, indent=None)
    return index


def _finalize(partial: Path, per_block: int, params: dict) -> None:
    idx = indices(per_block)
    metas = {i: read_json(meta_path(partial, i)) for i in idx}
    split = make_split(per_block)
    write_json(partial / "data" / "captions.json", {str(i): metas[i]["captions"] for i in idx}, indent=None)
    write_json(partial / "data" / "split.json", split, indent=None)
    write_jsonl(partial / "scenes.jsonl", [metas[i]["scene"] for i in idx])
    write_json(partial / "SYNTHETIC.json", {
        **params, "synthetic": True,
        "note": "synthetic — not the official CLEVR-DC: a procedural miniature rendered by idc-pipeline in the "
                "release's on-disk layout",
        "camera_move": {k: list(v) for k, v in CAMERA_MOVE.items()}, "light_jitter": LIGHT_JITTER,
        "counts": {"pairs": len(idx), "splits": {s: len(v) for s, v in split.items()},
                   "per_block": {t: per_block for t in BLOCK_TYPES},
                   "captions": sum(len(m["captions"]) for m in metas.values())},
        "pixel_sha256": hashlib.sha256("".join(metas[i]["pixel_sha256"] for i in idx).encode()).hexdigest(),
        "scenes": "scenes.jsonl"}, indent=2)


def _done(partial: Path, index: int) -> bool:
    return meta_path(partial, index).exists() and all(
        (partial / "data" / sub / f"{index}.png").exists() for sub in SUBDIRS)


def generate(out, per_block: int = 200, seed: int = 0, workers: int = 1, width: int = 480, height: int = 320,
             progress: bool = True, max_new_indices: int | None = None) -> bool:
    """Render the world into ``out`` (resumable, ``pipeline.synth.world``); True once complete."""
    if not 20 <= per_block <= BLOCK:
        raise PipelineError(f"--per-block {per_block}: need 20..{BLOCK} (every split must hold every block)")
    if seed < 0 or workers < 1 or width < 16 or height < 16:
        raise PipelineError(f"synth-clevr-dc: bad arguments (seed {seed} >= 0, workers {workers} >= 1, "
                            f"image {width}x{height} >= 16x16)")
    params = {"generator": GENERATOR, "version": VERSION, "seed": int(seed), "per_block": int(per_block),
              "image_size": [int(width), int(height)]}
    return render_world(out, params, params, indices(per_block), _work, _done,
                        lambda p: _finalize(p, per_block, params), SUBDIRS, workers=workers, progress=progress,
                        desc="synth-clevr-dc", max_new_indices=max_new_indices)
