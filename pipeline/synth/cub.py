"""Stage ``synth-cub``: render a synthetic CUB-200-2011 world (with Reed et al.'s captions) in the release's layout.

    python -m pipeline synth-cub --out resources/raw/cub/synthetic --n-images 1000 --n-species 40 --seed 0

writes ``OUT/data/`` as ``pipeline.datasets.cub`` reads it (reference/datasets.md §6): ``CUB_200_2011/``
(``images/<NNN.Class_Name>/<Class_Name>_<NNNN>_<id>.jpg``, ``images.txt``, ``image_class_labels.txt``,
``classes.txt``, ``train_test_split.txt``, ``bounding_boxes.txt``) and ``cvpr2016_cub/`` (``text_c10/<class
dir>/<image stem>.txt``, ten captions a file, and the class lists ``allclasses.txt``, ``trainvalclasses.txt``,
``testclasses.txt``), plus ``OUT/SYNTHETIC.json``.

``--n-species`` species of ``pipeline.synth.birds``'s taxonomy (drawn from it, all of them at most), class ids
1.. in the order drawn; a quarter of the classes (``TEST_CLASS_FRACTION``, the release's 50 of 200) are
``testclasses`` (L2C's class-disjoint ``val``), the rest ``trainvalclasses``. ``--n-images`` images spread
evenly over the classes, image ids 1.. class by class (as the release's), the official train / test flag drawn
per image (``P_OFFICIAL_TRAIN``, the release's 5,994 of 11,788). A bird of a species with two plumages shows the
second one with probability 0.3. Each image's ten captions state its bird's attributes (``birds.cub_captions``);
the release's text quirks are reproduced: an encoding artefact (U+FFFD U+FFFD) in a caption of ``P_ARTEFACT``
of the files and a blank line in ``P_BLANK`` of them, which the parser removes.

Everything about an image draws from ``default_rng([seed, image id])``, the plan from ``default_rng([seed,
PLAN_STREAM])``: the world is the same for any worker count (``pipeline.synth.world``).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import re
from pathlib import Path

import numpy as np

from pipeline.datasets import cub as release
from pipeline.errors import PipelineError
from pipeline.synth import birds
from pipeline.synth.world import add_image_world_arguments, meta_path, render_world, save_image, write_lines
from pipeline.utils.io import atomic_path, read_json, write_json

GENERATOR = "pipeline.synth.cub"
VERSION = "1.0.0"
PLAN_STREAM, TEXT_STREAM = 1 << 40, 1 << 42
TEST_CLASS_FRACTION = 0.25
P_OFFICIAL_TRAIN = 5994 / 11788
P_ARTEFACT, P_BLANK = 0.05, 0.05


def class_dir(k: int, name: str) -> str:
    return "%03d.%s" % (k, re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_"))


@functools.lru_cache(maxsize=4)
def plan(seed: int, n_images: int, n_species: int) -> dict:
    """``{"classes": [{"dir", "species", "split"}], "images": [{"id", "class", "rel", "female", "official"}]}``."""
    tax = birds.taxonomy(seed)
    rng = np.random.default_rng([int(seed), PLAN_STREAM])
    chosen = [int(s) for s in rng.choice(len(tax["species"]), size=n_species, replace=False)]
    n_test = max(1, int(round(n_species * TEST_CLASS_FRACTION)))
    test = set(int(k) for k in rng.choice(n_species, size=n_test, replace=False))
    classes = [{"dir": class_dir(k + 1, tax["species"][s]["name"]), "species": s,
                "split": "val" if k in test else "train"} for k, s in enumerate(chosen)]
    images = []
    for k, c in enumerate(classes):
        stem = c["dir"].split(".", 1)[1]
        for j in range(n_images // n_species + (k < n_images % n_species)):
            i = len(images) + 1
            female = tax["species"][c["species"]]["female"] is not None and rng.random() < 0.3
            images.append({"id": i, "class": k, "female": bool(female),
                           "rel": f"{c['dir']}/{stem}_{j + 1:04d}_{int(rng.integers(1000, 800000))}.jpg",
                           "official": "train" if rng.random() < P_OFFICIAL_TRAIN else "test"})
    return {"classes": classes, "images": images}


def _subdirs(pl: dict) -> list[str]:
    return [f"{release.CUB}/images/{c['dir']}" for c in pl["classes"]] + \
           [f"{release.REED}/{release.TEXT}/{c['dir']}" for c in pl["classes"]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_image_world_arguments(parser, (1000, "11,788"))
    parser.add_argument("--n-species", type=int, default=40, help="classes (default 40; the release: 200)")


def run(args: argparse.Namespace) -> None:
    generate(args.out, n_images=args.n_images, n_species=args.n_species, seed=args.seed, size=args.size,
             workers=args.workers, progress=not args.no_progress)


def _caption_lines(seed: int, image: dict, attrs: dict) -> str:
    rng = np.random.default_rng([seed, TEXT_STREAM, image["id"]])
    caps = birds.cub_captions(attrs, rng, release.CAPTIONS)
    if rng.random() < P_ARTEFACT:
        k = int(rng.integers(len(caps)))
        words = caps[k].split(" ")
        words.insert(int(rng.integers(1, len(words))), "\ufffd\ufffd")
        caps[k] = " ".join(words)
    if rng.random() < P_BLANK:
        caps.insert(int(rng.integers(1, len(caps))), "")
    return "\n".join(caps) + "\n"


def _work(task) -> int:
    partial, index, params = task
    partial = Path(partial)
    seed, w = params["seed"], params["image_size"]
    pl = plan(seed, params["n_images"], params["n_species"])
    image = pl["images"][index - 1]
    sp = birds.taxonomy(seed)["species"][pl["classes"][image["class"]]["species"]]
    attrs = birds.plumage(sp, image["female"])
    rgb, bbox, sha = birds.photo(seed, index, attrs, w)
    data = partial / "data"
    save_image(data / release.CUB / "images" / image["rel"], rgb)
    with atomic_path(data / release.REED / release.TEXT / Path(image["rel"]).with_suffix(".txt"), sweep=False) as tmp:
        tmp.write_bytes(_caption_lines(seed, image, attrs).encode("utf-8"))
    write_json(meta_path(partial, index), {"index": index, "rel": image["rel"], "bbox": bbox, "pixel_sha256": sha},
               indent=None)
    return index


def _done(partial: Path, index: int) -> bool:
    m = meta_path(partial, index)
    if not m.exists():
        return False
    rel = read_json(m)["rel"]
    data = partial / "data"
    return (data / release.CUB / "images" / rel).exists() and \
        (data / release.REED / release.TEXT / Path(rel).with_suffix(".txt")).exists()


def _finalize(partial: Path, params: dict) -> None:
    pl = plan(params["seed"], params["n_images"], params["n_species"])
    cub, reed = partial / "data" / release.CUB, partial / "data" / release.REED
    metas = [read_json(meta_path(partial, im["id"])) for im in pl["images"]]
    ims = pl["images"]
    write_lines(cub / "images.txt", (f"{im['id']} {im['rel']}" for im in ims))
    write_lines(cub / "image_class_labels.txt", (f"{im['id']} {im['class'] + 1}" for im in ims))
    write_lines(cub / "classes.txt", (f"{k + 1} {c['dir']}" for k, c in enumerate(pl["classes"])))
    write_lines(cub / "train_test_split.txt", (f"{im['id']} {int(im['official'] == 'train')}" for im in ims))
    write_lines(cub / "bounding_boxes.txt", (f"{im['id']} " + " ".join(f"{v:.1f}" for v in m["bbox"])
                                              for im, m in zip(ims, metas)))
    write_lines(reed / "allclasses.txt", (c["dir"] for c in pl["classes"]))
    for split, name in release.CLASS_LISTS.items():
        write_lines(reed / name, (c["dir"] for c in pl["classes"] if c["split"] == split))
    counts = {s: {"images": sum(pl["classes"][im["class"]]["split"] == s for im in ims),
                  "classes": sum(c["split"] == s for c in pl["classes"])} for s in release.CLASS_LISTS}
    write_json(partial / "SYNTHETIC.json", {
        **params, "synthetic": True,
        "note": "synthetic — not the official CUB-200-2011 nor Reed et al.'s captions: procedural birds "
                "(pipeline.synth.birds) in the releases' layout",
        "counts": counts,
        "official_split": {s: sum(im["official"] == s for im in ims) for s in ("train", "test")},
        "pixel_sha256": hashlib.sha256("".join(m["pixel_sha256"] for m in metas).encode()).hexdigest()}, indent=2)


def generate(out, n_images: int = 1000, n_species: int = 40, seed: int = 0, size: int = 224, workers: int = 1,
             progress: bool = True, max_new_indices: int | None = None) -> bool:
    """Render the world into ``out`` (resumable, ``pipeline.synth.world``); True once complete."""
    n_all = len(birds.taxonomy(seed)["species"])
    if not 4 <= n_species <= n_all or n_images < n_species or seed < 0 or workers < 1 or size < 64:
        raise PipelineError(f"synth-cub: bad arguments (4 <= n_species {n_species} <= {n_all}, n_images {n_images} "
                            f">= n_species, seed {seed} >= 0, workers {workers} >= 1, size {size} >= 64)")
    pl = plan(seed, n_images, n_species)
    params = {"generator": GENERATOR, "version": VERSION, "seed": int(seed), "n_images": int(n_images),
              "n_species": int(n_species), "image_size": int(size)}
    return render_world(out, params, params, [im["id"] for im in pl["images"]], _work, _done,
                        lambda p: _finalize(p, params), _subdirs(pl), workers=workers, progress=progress,
                        desc="synth-cub", max_new_indices=max_new_indices)
