"""Stage ``synth-clevr-change``: render the synthetic CLEVR-Change world in the official on-disk layout.

    python -m pipeline synth-clevr-change --out resources/raw/clevr_change/synthetic \\
        --n-indices 600 --seed 0 --workers 2

writes ``OUT/data/`` exactly like the extracted official archive (``images/``, ``sc_images/``,
``nsc_images/``, ``change_captions.json``, ``no_change_captions.json``, ``splits.json``,
``type_mapping.json``, ``change_captions_with_bbox.json``), plus ``OUT/SYNTHETIC.json`` (provenance and
counts; the data is synthetic, not the official CLEVR-Change) and ``OUT/scenes.jsonl`` (the ground-truth
scene, change and views of every index).

Each index draws only from ``numpy.random.default_rng([seed, index])``, so the output is the same for
any worker count; rendering resumes after an interruption (``pipeline.synth.world``).
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import numpy as np

from pipeline.errors import PipelineError
from pipeline.synth.render import bbox_from_ids, render
from pipeline.synth.scene import CHANGE_TYPES, make_example
from pipeline.synth.world import meta_path, render_world, save_png
from pipeline.utils.io import read_json, write_json, write_jsonl

GENERATOR = "pipeline.synth.clevr_change"
VERSION = "1.0.0"
SPLITS = ("train", "val", "test")
DEFAULT_SPLIT_FRACTIONS = (0.8, 0.07, 0.13)
IMAGE_DIRS = {
    "default": ("images", "CLEVR_default_%06d.png"),
    "semantic": ("sc_images", "CLEVR_semantic_%06d.png"),
    "nonsemantic": ("nsc_images", "CLEVR_nonsemantic_%06d.png"),
}
CAPTIONS_PER_INDEX = 6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output directory; data/ is created inside it")
    parser.add_argument("--n-indices", type=int, default=600, help="number of image triplets (default 600)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    parser.add_argument("--split-fractions", type=float, nargs=3, metavar=("TRAIN", "VAL", "TEST"),
                        default=list(DEFAULT_SPLIT_FRACTIONS), help="split fractions (default 0.8 0.07 0.13)")
    parser.add_argument("--workers", type=int, default=1, help="rendering processes (default 1)")
    parser.add_argument("--width", type=int, default=480, help="image width in pixels (default 480)")
    parser.add_argument("--height", type=int, default=320, help="image height in pixels (default 320)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> None:
    generate(
        args.out,
        n_indices=args.n_indices,
        seed=args.seed,
        split_fractions=tuple(args.split_fractions),
        workers=args.workers,
        width=args.width,
        height=args.height,
        progress=not getattr(args, "no_progress", False),
    )


# ----------------------------------------------------------------------------------------------------
# one index
# ----------------------------------------------------------------------------------------------------


def image_path(data_dir: Path, kind: str, index: int) -> Path:
    sub, pattern = IMAGE_DIRS[kind]
    return data_dir / sub / (pattern % index)


def render_index(seed: int, index: int, n_indices: int, width: int, height: int):
    """Render one index: (example, {kind: (rgb, ids)})."""
    ex = make_example(seed, index, n_indices, width, height, n_captions=CAPTIONS_PER_INDEX)
    before = [o.primitive() for o in ex.before]
    after = [o.primitive() for o in ex.after]
    images = {
        "default": render(before, ex.view_before.camera, ex.view_before.lights, width, height),
        "semantic": render(after, ex.view_after.camera, ex.view_after.lights, width, height),
        "nonsemantic": render(before, ex.view_distractor.camera, ex.view_distractor.lights, width, height),
    }
    return ex, images


def _index_record(ex, images) -> dict:
    ids_b = images["default"][1]
    ids_a = images["semantic"][1]
    ch = ex.change
    digest = hashlib.sha256()
    for kind in IMAGE_DIRS:
        digest.update(np.ascontiguousarray(images[kind][0]).tobytes())
    return {
        "index": ex.index,
        "change_type": ex.change_type,
        "change_captions": ex.change_captions,
        "no_change_captions": ex.no_change_captions,
        "bbox_before": bbox_from_ids(ids_b, ch.before_index) if ch.before_index is not None else None,
        "bbox_after": bbox_from_ids(ids_a, ch.after_index) if ch.after_index is not None else None,
        "pixel_sha256": digest.hexdigest(),
        "scene": ex.to_dict(),
    }


def _work(task) -> int:
    partial, index, params = task
    partial = Path(partial)
    width, height = params["image_size"]
    ex, images = render_index(params["seed"], index, params["n_indices"], width, height)
    data = partial / "data"
    for kind, (rgb, _) in images.items():
        save_png(image_path(data, kind, index), rgb)
    write_json(meta_path(partial, index), _index_record(ex, images), indent=None)
    return index


def _index_done(partial: Path, index: int) -> bool:
    if not meta_path(partial, index).exists():
        return False
    return all(image_path(partial / "data", kind, index).exists() for kind in IMAGE_DIRS)


# ----------------------------------------------------------------------------------------------------
# the whole world
# ----------------------------------------------------------------------------------------------------


def _check_arguments(n_indices, seed, split_fractions, workers, width, height) -> None:
    if n_indices < 5 * len(SPLITS):
        raise PipelineError(f"--n-indices {n_indices}: need at least {5 * len(SPLITS)} "
                            "(every split must hold every change type)")
    if n_indices > 1_000_000:
        raise PipelineError(f"--n-indices {n_indices}: at most 1000000 (6-digit file names)")
    if seed < 0:
        raise PipelineError(f"--seed {seed}: must be >= 0")
    if workers < 1:
        raise PipelineError(f"--workers {workers}: must be >= 1")
    if width < 16 or height < 16:
        raise PipelineError(f"--width {width} --height {height}: images must be at least 16x16")
    if len(split_fractions) != 3 or any(not (f > 0) for f in split_fractions):
        raise PipelineError(f"--split-fractions {list(split_fractions)}: need three fractions > 0")
    if abs(sum(split_fractions) - 1.0) > 1e-6:
        raise PipelineError(f"--split-fractions {list(split_fractions)}: must sum to 1 (sum {sum(split_fractions)})")


def _split_sizes(n: int, fractions) -> tuple[int, int, int]:
    n_val = max(1, int(round(n * fractions[1])))
    n_test = max(1, int(round(n * fractions[2])))
    n_train = n - n_val - n_test
    if n_train < 1:
        raise PipelineError(f"{n} indices per change type cannot be split {list(fractions)}; raise --n-indices")
    return n_train, n_val, n_test


def make_splits(types: dict[int, str], seed: int, n_indices: int, fractions) -> dict[str, list[int]]:
    """Stratified by change type, shuffled within each split, disjoint."""
    rng = np.random.default_rng([int(seed), int(n_indices), 0x5917])
    out = {s: [] for s in SPLITS}
    for t in CHANGE_TYPES:
        idx = np.array(sorted(i for i, ti in types.items() if ti == t), dtype=np.int64)
        idx = idx[rng.permutation(idx.size)]
        n_train, n_val, _ = _split_sizes(idx.size, fractions)
        out["train"].extend(int(i) for i in idx[:n_train])
        out["val"].extend(int(i) for i in idx[n_train:n_train + n_val])
        out["test"].extend(int(i) for i in idx[n_train + n_val:])
    for s in SPLITS:
        out[s] = [out[s][k] for k in rng.permutation(len(out[s]))]
    return out


def _params(n_indices, seed, width, height) -> dict:
    return {"generator": GENERATOR, "version": VERSION, "seed": int(seed), "n_indices": int(n_indices),
            "image_size": [int(width), int(height)]}


def _finalize(partial: Path, n_indices: int, seed: int, fractions, width: int, height: int) -> None:
    data = partial / "data"
    records = [read_json(meta_path(partial, i)) for i in range(n_indices)]
    key = "CLEVR_default_%06d.png"
    change_caps = {key % r["index"]: r["change_captions"] for r in records}
    no_change_caps = {key % r["index"]: r["no_change_captions"] for r in records}
    type_mapping = {t: ["%06d.png" % r["index"] for r in records if r["change_type"] == t] for t in CHANGE_TYPES}
    bboxes = {str(r["index"]): {"bbox_before": r["bbox_before"], "bbox_after": r["bbox_after"]} for r in records}
    types = {r["index"]: r["change_type"] for r in records}
    splits = make_splits(types, seed, n_indices, fractions)

    write_json(data / "change_captions.json", change_caps, indent=None)
    write_json(data / "no_change_captions.json", no_change_caps, indent=None)
    write_json(data / "type_mapping.json", type_mapping, indent=None)
    write_json(data / "change_captions_with_bbox.json", bboxes, indent=None)
    write_json(data / "splits.json", splits, indent=None)
    write_jsonl(partial / "scenes.jsonl", [r["scene"] for r in records])

    pix = hashlib.sha256("".join(r["pixel_sha256"] for r in records).encode()).hexdigest()
    by_split_type = {s: {t: sum(1 for i in splits[s] if types[i] == t) for t in CHANGE_TYPES} for s in SPLITS}
    meta = {
        **_params(n_indices, seed, width, height),
        "synthetic": True,
        "note": "synthetic — not the official CLEVR-Change: a procedural miniature rendered by idc-pipeline "
                "in the official on-disk layout",
        "split_fractions": [float(f) for f in fractions],
        "counts": {
            "indices": n_indices,
            "pairs": 2 * n_indices,
            "splits": {s: len(splits[s]) for s in SPLITS},
            "types": {t: len(type_mapping[t]) for t in CHANGE_TYPES},
            "splits_by_type": by_split_type,
            "change_captions": sum(len(v) for v in change_caps.values()),
            "no_change_captions": sum(len(v) for v in no_change_caps.values()),
        },
        "pixel_sha256": pix,
        "pixel_sha256_note": "sha256 over the per-index sha256 of the raw RGB pixels (default, semantic, "
                             "nonsemantic), independent of the PNG encoder",
        "scenes": "scenes.jsonl",
    }
    write_json(partial / "SYNTHETIC.json", meta, indent=2)


def generate(
    out,
    n_indices: int = 600,
    seed: int = 0,
    split_fractions=DEFAULT_SPLIT_FRACTIONS,
    workers: int = 1,
    width: int = 480,
    height: int = 320,
    progress: bool = True,
    max_new_indices: int | None = None,
) -> bool:
    """Render the world into ``out`` (``pipeline.synth.world.render_world``). Returns True when ``out`` is
    complete; ``max_new_indices`` stops early, leaving ``out.partial`` to resume (for tests)."""
    _check_arguments(n_indices, seed, split_fractions, workers, width, height)
    params = _params(n_indices, seed, width, height)
    identity = {**params, "split_fractions": [float(f) for f in split_fractions]}
    return render_world(out, params, identity, range(n_indices), _work, _index_done,
                        lambda partial: _finalize(partial, n_indices, seed, split_fractions, width, height),
                        [sub for sub, _ in IMAGE_DIRS.values()], workers=workers, progress=progress,
                        desc="synth-clevr-change", max_new_indices=max_new_indices)
