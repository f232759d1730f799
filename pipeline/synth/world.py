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


def meta_path(partial: Path, index: int) -> Path:
    return partial / "meta" / ("%06d.json" % index)


def remove_temporaries(data: Path, subdirs) -> None:
    """Temporary files an interrupted run left behind."""
    for sub in subdirs:
        for p in (data / sub).glob(".*.tmp"):
            p.unlink()
    for p in data.glob(".*.tmp"):
        p.unlink()


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
