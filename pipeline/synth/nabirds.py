"""Stage ``synth-nabirds``: render a synthetic NABirds world in the release's layout.

    python -m pipeline synth-nabirds --out resources/raw/nabirds/synthetic --n-images 1000 --seed 0

writes ``OUT/data/`` as the release's ``nabirds/`` folder (reference/datasets.md §7; parsed by
``pipeline.datasets.nabirds``): ``images/<4-digit class id>/<32 hex>.jpg``, ``images.txt`` (``<image uuid>
<class dir>/<file>``, sorted by uuid), ``image_class_labels.txt``, ``classes.txt`` (every node of the hierarchy,
``<id> <name with spaces>``), ``hierarchy.txt`` (``<child> <parent>``), ``train_test_split.txt``,
``bounding_boxes.txt``, ``sizes.txt`` and ``photographers.txt``, plus ``OUT/SYNTHETIC.json``.

The hierarchy is ``pipeline.synth.birds``'s taxonomy under a root ``Birds`` (id 0): orders, families, genera,
species, and for a species with two plumages two visual categories below it (``<name> (Adult male)``,
``<name> (Female/juvenile)``), as NABirds' 555 categories are species x plumage. Only leaves hold images; class
ids are a random sample of ``1 .. ID_SPACE - 1`` (non-contiguous, leaves and inner nodes mixed, as the
release's), so that the parser's leaf remapping is exercised. ``--n-images`` images: every leaf once, then
leaves at random; the official train / test flag drawn per image (``P_TRAIN``); image ids random UUIDs.

Everything about an image draws from ``default_rng([seed, index])`` (index: its position in the plan), the plan
from ``default_rng([seed, PLAN_STREAM])``: the world is the same for any worker count (``pipeline.synth.world``).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
from pathlib import Path

import numpy as np

from pipeline.datasets import nabirds as release
from pipeline.errors import PipelineError
from pipeline.synth import birds
from pipeline.synth.world import add_image_world_arguments, meta_path, render_world, save_image, write_lines
from pipeline.utils.io import read_json, write_json

GENERATOR = "pipeline.synth.nabirds"
VERSION = "1.0.0"
PLAN_STREAM = 1 << 40
ID_SPACE = 1000
P_TRAIN = 0.49  # the release: 23,929 of 48,562 (unverified, datasets.md §7)
PHOTOGRAPHERS = ("A. Birder", "J. Smith", "M. Garcia", "K. Tanaka", "L. Okafor", "S. Nielsen")


@functools.lru_cache(maxsize=4)
def plan(seed: int, n_images: int) -> dict:
    """``{"classes": {id: name}, "parent": {child: parent}, "leaves": [{"id", "species", "female"}],
    "images": [{"uuid", "leaf", "rel", "train"}]}`` (images in plan order; ``images.txt`` sorts them)."""
    tax = birds.taxonomy(seed)
    rng = np.random.default_rng([int(seed), PLAN_STREAM])
    n_nodes = (len(tax["orders"]) + len(tax["families"]) + len(tax["genera"]) + len(tax["species"])
               + 2 * sum(s["female"] is not None for s in tax["species"]))
    ids = iter(int(i) for i in rng.choice(np.arange(1, ID_SPACE), size=n_nodes, replace=False))
    classes, parent = {0: "Birds"}, {}

    def node(name: str, par: int) -> int:
        i = next(ids)
        classes[i], parent[i] = name, par
        return i

    orders = [node(o["name"], 0) for o in tax["orders"]]
    fams = [node(f["name"], orders[f["order"]]) for f in tax["families"]]
    gens = [node(g["name"], fams[g["family"]]) for g in tax["genera"]]
    leaves = []
    for k, s in enumerate(tax["species"]):
        sid = node(s["name"], gens[s["genus"]])
        if s["female"] is None:
            leaves.append({"id": sid, "species": k, "female": False})
        else:
            leaves.append({"id": node(f"{s['name']} (Adult male)", sid), "species": k, "female": False})
            leaves.append({"id": node(f"{s['name']} (Female/juvenile)", sid), "species": k, "female": True})
    which = list(range(len(leaves)))[:n_images] + [int(x) for x in rng.integers(len(leaves),
                                                                                size=max(0, n_images - len(leaves)))]
    images = []
    for li in which:
        u = bytes(int(b) for b in rng.integers(256, size=16)).hex()
        images.append({"uuid": f"{u[:8]}-{u[8:12]}-{u[12:16]}-{u[16:20]}-{u[20:]}", "leaf": li,
                       "rel": f"{leaves[li]['id']:04d}/{u}.jpg", "train": bool(rng.random() < P_TRAIN)})
    return {"classes": classes, "parent": parent, "leaves": leaves, "images": images}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_image_world_arguments(parser, (1000, "48,562"))


def run(args: argparse.Namespace) -> None:
    generate(args.out, n_images=args.n_images, seed=args.seed, size=args.size, workers=args.workers,
             progress=not args.no_progress)


def _work(task) -> int:
    partial, index, params = task
    partial = Path(partial)
    seed, w = params["seed"], params["image_size"]
    pl = plan(seed, params["n_images"])
    image = pl["images"][index]
    leaf = pl["leaves"][image["leaf"]]
    sp = birds.taxonomy(seed)["species"][leaf["species"]]
    rgb, bbox, sha = birds.photo(seed, index, birds.plumage(sp, leaf["female"]), w)
    save_image(partial / "data" / release.IMAGES / image["rel"], rgb)
    write_json(meta_path(partial, index), {"index": index, "rel": image["rel"], "bbox": bbox,
                                           "size": [w, w * 3 // 4], "pixel_sha256": sha}, indent=None)
    return index


def _done(partial: Path, index: int) -> bool:
    m = meta_path(partial, index)
    return m.exists() and (partial / "data" / release.IMAGES / read_json(m)["rel"]).exists()


def _finalize(partial: Path, params: dict) -> None:
    pl = plan(params["seed"], params["n_images"])
    data = partial / "data"
    metas = [read_json(meta_path(partial, i)) for i in range(len(pl["images"]))]
    order = sorted(range(len(pl["images"])), key=lambda i: pl["images"][i]["uuid"])
    ims = [pl["images"][i] for i in order]
    ms = [metas[i] for i in order]
    rng = np.random.default_rng([params["seed"], PLAN_STREAM, 1])
    write_lines(data / "images.txt", (f"{im['uuid']} {im['rel']}" for im in ims))
    write_lines(data / "image_class_labels.txt", (f"{im['uuid']} {pl['leaves'][im['leaf']]['id']}" for im in ims))
    write_lines(data / "classes.txt", (f"{i} {name}" for i, name in sorted(pl["classes"].items())))
    write_lines(data / "hierarchy.txt", (f"{c} {p}" for c, p in sorted(pl["parent"].items())))
    write_lines(data / "train_test_split.txt", (f"{im['uuid']} {int(im['train'])}" for im in ims))
    write_lines(data / "bounding_boxes.txt", (f"{im['uuid']} " + " ".join(map(str, m["bbox"])) for im, m in zip(ims, ms)))
    write_lines(data / "sizes.txt", (f"{im['uuid']} {m['size'][0]} {m['size'][1]}" for im, m in zip(ims, ms)))
    write_lines(data / "photographers.txt", (f"{im['uuid']} {PHOTOGRAPHERS[int(rng.integers(len(PHOTOGRAPHERS)))]}"
                                              for im in ims))
    used = {im["leaf"] for im in ims}
    write_json(partial / "SYNTHETIC.json", {
        **params, "synthetic": True,
        "note": "synthetic — not the official NABirds: procedural birds (pipeline.synth.birds) in the release's "
                "layout, class ids non-contiguous as released",
        "counts": {"images": len(ims), "train": sum(im["train"] for im in ims),
                   "test": sum(not im["train"] for im in ims), "classes": len(pl["classes"]),
                   "leaves": len(pl["leaves"]), "leaves_with_images": len(used)},
        "pixel_sha256": hashlib.sha256("".join(m["pixel_sha256"] for m in metas).encode()).hexdigest()}, indent=2)


def generate(out, n_images: int = 1000, seed: int = 0, size: int = 224, workers: int = 1, progress: bool = True,
             max_new_indices: int | None = None) -> bool:
    """Render the world into ``out`` (resumable, ``pipeline.synth.world``); True once complete."""
    if n_images < 10 or seed < 0 or workers < 1 or size < 64:
        raise PipelineError(f"synth-nabirds: bad arguments (n_images {n_images} >= 10, seed {seed} >= 0, "
                            f"workers {workers} >= 1, size {size} >= 64)")
    pl = plan(seed, n_images)
    params = {"generator": GENERATOR, "version": VERSION, "seed": int(seed), "n_images": int(n_images),
              "image_size": int(size)}
    subdirs = sorted({f"{release.IMAGES}/{im['rel'].split('/')[0]}" for im in pl["images"]})
    return render_world(out, params, params, list(range(len(pl["images"]))), _work, _done,
                        lambda p: _finalize(p, params), subdirs, workers=workers, progress=progress,
                        desc="synth-nabirds", max_new_indices=max_new_indices)
