"""The resumable rendering loop every synthetic world shares.

A world renders its indices into ``OUT.partial/``: each index's images under temporary names then renamed,
the index finished once its small ``meta/%06d.json`` exists, so an interrupted run resumes where it stopped
(and a run with other parameters starts afresh). ``finalize`` then writes the dataset's JSON files and
``SYNTHETIC.json`` into ``OUT.partial`` and removes its bookkeeping, and ``OUT.partial`` is renamed to ``OUT``.
Each index draws only from its own ``default_rng([seed, index])``, so the result is the same for any
worker count.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from pipeline.errors import PipelineError
from pipeline.utils.io import atomic_path, read_json, write_json


def save_png(path: Path, rgb: np.ndarray) -> None:
    from PIL import Image

    with atomic_path(path, sweep=False) as tmp:  # render_world sweeps each folder once, at the end
        Image.fromarray(np.ascontiguousarray(rgb, dtype=np.uint8)).save(tmp, format="PNG")


IMAGE_FORMATS = {".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".gif": "GIF"}


def save_image(path: Path, rgb: np.ndarray, quality: int = 92) -> None:
    """An RGB image in the format its suffix names (``IMAGE_FORMATS``, JPEG at ``quality``), atomically; PIL's
    encoders are deterministic, so the same pixels give the same bytes."""
    from PIL import Image

    fmt = IMAGE_FORMATS[path.suffix.lower()]
    img = Image.fromarray(np.ascontiguousarray(rgb, dtype=np.uint8))
    with atomic_path(path, sweep=False) as tmp:  # render_world sweeps each folder once, at the end
        img.save(tmp, format=fmt, **({"quality": quality} if fmt == "JPEG" else {}))


def write_lines(path: Path, lines) -> None:
    """A text file of one line per item (the CUB / NABirds tables), atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text("".join(f"{line}\n" for line in lines))


def meta_path(partial: Path, index: int) -> Path:
    return partial / "meta" / ("%06d.json" % index)


def remove_temporaries(data: Path, subdirs) -> None:
    """Temporary files an interrupted run left behind."""
    for sub in subdirs:
        for p in (data / sub).glob(".*.tmp"):
            p.unlink()
    for p in data.glob(".*.tmp"):
        p.unlink()


def add_pair_world_arguments(parser, n_pairs: tuple[int, str], fractions, split_names, size_help: str) -> None:
    """The options of a pair world's stage: ``--out``, ``--n-pairs`` (``n_pairs``: default, what it counts),
    ``--seed``, ``--split-fractions`` (default ``fractions``, metavars ``split_names``), ``--size``,
    ``--workers``, ``--no-progress``."""
    parser.add_argument("--out", required=True, help="output directory; data/ is created inside it")
    parser.add_argument("--n-pairs", type=int, default=n_pairs[0], help=f"{n_pairs[1]} (default {n_pairs[0]})")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    parser.add_argument("--split-fractions", type=float, nargs=3, metavar=tuple(split_names), default=list(fractions),
                        help=f"split fractions (default {' '.join(map(str, fractions))})")
    parser.add_argument("--size", type=int, default=224, help=f"{size_help} (default 224)")
    parser.add_argument("--workers", type=int, default=1, help="rendering processes (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def add_image_world_arguments(parser, n_images: tuple[int, str]) -> None:
    """The options of a single-image world's stage (CUB, NABirds): ``--out``, ``--n-images`` (``n_images``:
    default, the release's count), ``--seed``, ``--size`` (width; height 3/4 of it), ``--workers``,
    ``--no-progress``."""
    parser.add_argument("--out", required=True, help="output directory; data/ is created inside it")
    parser.add_argument("--n-images", type=int, default=n_images[0], help=f"images (default {n_images[0]}; "
                                                                          f"the release: {n_images[1]})")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    parser.add_argument("--size", type=int, default=224, help="image width in pixels, height 3/4 of it (default 224)")
    parser.add_argument("--workers", type=int, default=1, help="rendering processes (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def check_arguments(name: str, split_fractions, n_pairs: int, seed: int, workers: int, size: int) -> list[float]:
    """The common arguments of a pair world's ``generate`` (three split fractions > 0 summing to 1, at least
    10 pairs, images of at least 64 pixels); the fractions as floats. A bad one is a PipelineError."""
    fr = [float(f) for f in split_fractions]
    if len(fr) != 3 or any(f <= 0 for f in fr) or abs(sum(fr) - 1.0) > 1e-6:
        raise PipelineError(f"--split-fractions {fr}: need three fractions > 0 that sum to 1")
    if n_pairs < 10 or seed < 0 or workers < 1 or size < 64:
        raise PipelineError(f"{name}: bad arguments (n_pairs {n_pairs} >= 10, seed {seed} >= 0, "
                            f"workers {workers} >= 1, size {size} >= 64)")
    return fr


def render_world(out, params: dict, identity: dict, indices, work: Callable, done: Callable,
                 finalize: Callable, subdirs, workers: int = 1, progress: bool = True, desc: str = "synth",
                 max_new_indices: int | None = None) -> bool:
    """Render ``indices`` (ints) into ``out`` (see the module docstring); True once complete.

    ``params`` identify a partial run (``.params.json``), ``identity`` a complete one (compared with its
    ``SYNTHETIC.json``); ``work((partial, index, params))`` renders one index, ``done(partial, index)`` says
    whether it is finished (both top-level functions: worker processes receive them by pickling), ``finalize(partial)`` writes the JSON files. ``max_new_indices`` stops after
    that many new indices, leaving ``out.partial`` to resume (returns False): for tests of resumption."""
    from tqdm import tqdm

    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    if out.exists() and (out / "SYNTHETIC.json").exists() and (out / "data").is_dir():
        have = read_json(out / "SYNTHETIC.json")
        if {k: have.get(k) for k in identity} == identity:
            print(f"{out}: already complete (seed {params.get('seed')}, {len(indices)} indices)")
            return True
        raise PipelineError(f"{out} already holds a synthetic world with different parameters "
                            f"({ {k: have.get(k) for k in params} }); remove it first")
    if partial.exists():
        pfile = partial / ".params.json"
        if (json.loads(pfile.read_text()) if pfile.exists() else None) != params:
            shutil.rmtree(partial)
    partial.mkdir(parents=True, exist_ok=True)
    write_json(partial / ".params.json", params)
    for sub in subdirs:
        (partial / "data" / sub).mkdir(parents=True, exist_ok=True)
    (partial / "meta").mkdir(exist_ok=True)

    todo = [i for i in indices if not done(partial, i)]
    if max_new_indices is not None:
        todo = todo[:max_new_indices]
    tasks = [(str(partial), i, params) for i in todo]
    if tasks:
        bar = tqdm(total=len(tasks), desc=desc, unit="idx", disable=not progress)
        if workers == 1 or len(tasks) == 1:
            for t in tasks:
                work(t)
                bar.update(1)
        else:
            methods = multiprocessing.get_all_start_methods()
            ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
            with ctx.Pool(processes=min(workers, len(tasks))) as pool:
                for _ in pool.imap_unordered(work, tasks, chunksize=1):
                    bar.update(1)
        bar.close()
    if any(not done(partial, i) for i in indices):
        return False

    finalize(partial)
    remove_temporaries(partial / "data", subdirs)
    shutil.rmtree(partial / "meta")
    (partial / ".params.json").unlink(missing_ok=True)
    if out.exists():  # an incomplete earlier output (a complete one was handled above)
        shutil.rmtree(out)
    os.replace(partial, out)
    return True
