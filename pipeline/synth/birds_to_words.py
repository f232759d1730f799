"""Stage ``synth-birds-to-words``: render a synthetic Birds-to-Words world in the release's layout.

    python -m pipeline synth-birds-to-words --out resources/raw/birds_to_words/synthetic --n-pairs 600 --seed 0

writes ``OUT/data/`` as ``pipeline.datasets.birds_to_words`` reads it (reference/datasets.md §5):
``birds-to-words-v1.0.tsv`` (the release's eleven columns, a header row, one row per description) and
``images/<photo id>.<ext>`` (each photo under the local name of its URL, ``birds_to_words.local_name``, as the
fetcher stores the downloaded photos), plus ``OUT/SYNTHETIC.json`` (provenance, counts) and ``OUT/pairs.jsonl``
(every pair's two birds, their attributes and differences).

The birds are ``pipeline.synth.birds``'s. As in the release, a pair sets a ``base`` photo (``img1Selection``)
beside a photo of a similar bird, its ``img2Selection`` one of ``SELECTION_P``: the same species (another photo,
maybe the other plumage), a species of the same genus, family or order, or ``visual`` (the species sharing most
attributes with the base's, of another genus). A base photo serves ``PAIRS_PER_BASE`` pairs on average; the
split (``--split-fractions``) is drawn per base photo, so that no photo is in two splits. Each pair gets 1-5
descriptions (``ANNOTATIONS_P``, mean ~3.3 as IDC-PCL reports), rows ``annN`` 1.., each a paragraph stating
2-4 attribute differences with ``animal1`` / ``animal2`` (lower-case, tokenised: the release's text). URLs are
iNaturalist's (``https://static.inaturalist.org/photos/<id>/medium.<ext>?<timestamp>``; ``.jpg``, some
``.jpeg`` and ``.png``), species columns the birds' scientific names.

Everything about a photo draws from ``default_rng([seed, index])``; the plan (photos, pairs, split) from
``default_rng([seed, PLAN_STREAM])``, a pair's descriptions from ``default_rng([seed, TEXT_STREAM, pair])``:
the world is the same for any worker count (``pipeline.synth.world``).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
from pathlib import Path

import numpy as np

from pipeline.datasets import birds_to_words as release
from pipeline.errors import PipelineError
from pipeline.synth import birds
from pipeline.synth.world import add_pair_world_arguments, check_arguments, meta_path, render_world, save_image
from pipeline.utils.io import atomic_path, read_json, write_json, write_jsonl

GENERATOR = "pipeline.synth.birds_to_words"
VERSION = "1.0.0"
SUBDIRS = (release.IMAGES,)
DEFAULT_SPLIT_FRACTIONS = (0.8, 0.1, 0.1)
PLAN_STREAM, TEXT_STREAM = 1 << 40, 1 << 42
PAIRS_PER_BASE = 1.5
SELECTION_P = {"sameSpecies": 0.1, "sameGenus": 0.4, "sameFamily": 0.25, "sameOrder": 0.1, "visual": 0.15}
ANNOTATIONS_P = {1: 0.05, 2: 0.15, 3: 0.35, 4: 0.3, 5: 0.15}  # descriptions per pair (mean ~3.35)
EXTENSIONS_P = {"jpg": 0.93, "jpeg": 0.05, "png": 0.02}


def _partner(tax: dict, s: int, selection: str, rng: np.random.Generator) -> int:
    """A species for the partner photo of a base of species ``s`` under ``selection``."""
    o, f, g = birds.lineage(tax, s)
    n = len(tax["species"])
    if selection == "sameSpecies":
        return s
    if selection == "visual":
        others = [t for t in range(n) if birds.lineage(tax, t)[2] != g]
        shared = [len(birds.ATTRIBUTES) - len(birds.differences(tax["species"][s]["attrs"], tax["species"][t]["attrs"]))
                  for t in others]
        best = [t for t, k in zip(others, shared) if k == max(shared)]
        return best[int(rng.integers(len(best)))]
    level = {"sameOrder": 0, "sameFamily": 1, "sameGenus": 2}[selection]  # shared down to, differing below
    mine = (o, f, g)
    cands = [t for t in range(n) if t != s and birds.lineage(tax, t)[:level + 1] == mine[:level + 1]
             and (level == 2 or birds.lineage(tax, t)[level + 1] != mine[level + 1])]
    return cands[int(rng.integers(len(cands)))] if cands else s


@functools.lru_cache(maxsize=4)
def plan(seed: int, n_pairs: int, fractions: tuple) -> dict:
    """``{"photos": [{"species", "female", "photo_id", "obs_id", "url", "file"}], "pairs": [{"img1", "img2",
    "selection", "split", "n_ann"}]}``: a pure function of its arguments."""
    tax = birds.taxonomy(seed)
    rng = np.random.default_rng([int(seed), PLAN_STREAM])
    n_species = len(tax["species"])
    photos: list[dict] = []
    ids: set[int] = set()

    def new_photo(s: int, female: bool) -> int:
        while True:
            pid = int(rng.integers(100_000, 60_000_000))
            if pid not in ids:
                break
        ids.add(pid)
        ext = str(rng.choice(list(EXTENSIONS_P), p=list(EXTENSIONS_P.values())))
        url = f"https://static.inaturalist.org/photos/{pid}/medium.{ext}?{int(rng.integers(1_400_000_000, 1_560_000_000))}"
        photos.append({"species": s, "female": bool(female), "photo_id": pid,
                       "obs_id": int(rng.integers(1_000_000, 30_000_000)), "url": url, "file": release.local_name(url)})
        return len(photos) - 1

    def plumage(s: int) -> bool:
        return tax["species"][s]["female"] is not None and rng.random() < 0.3

    n_base = max(3, int(round(n_pairs / PAIRS_PER_BASE)))
    bases = [new_photo(int(s), False) for s in rng.integers(n_species, size=n_base)]
    for b in bases:
        photos[b]["female"] = plumage(photos[b]["species"])
    order = rng.permutation(n_base)
    n_val = max(1, int(round(n_base * fractions[1])))
    n_test = max(1, int(round(n_base * fractions[2])))
    split_of = {}
    for k, j in enumerate(order):
        split_of[bases[int(j)]] = "val" if k < n_val else "test" if k < n_val + n_test else "train"
    sels, sel_p = list(SELECTION_P), list(SELECTION_P.values())
    pairs = []
    for k in range(n_pairs):
        b = bases[k] if k < n_base else bases[int(rng.integers(n_base))]
        sel = str(rng.choice(sels, p=sel_p))
        s2 = _partner(tax, photos[b]["species"], sel, rng)
        p2 = new_photo(s2, plumage(s2))
        n_ann = int(rng.choice(list(ANNOTATIONS_P), p=list(ANNOTATIONS_P.values())))
        pairs.append({"img1": b, "img2": p2, "selection": sel, "split": split_of[b], "n_ann": n_ann})
    return {"photos": photos, "pairs": pairs}


def photo_attrs(tax: dict, photo: dict) -> dict:
    return birds.plumage(tax["species"][photo["species"]], photo["female"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_pair_world_arguments(parser, (600, "pairs; the release: ~3.3k"), DEFAULT_SPLIT_FRACTIONS,
                             ("TRAIN", "VAL", "TEST"), "photo width in pixels, height 3/4 of it")


def run(args: argparse.Namespace) -> None:
    generate(args.out, n_pairs=args.n_pairs, seed=args.seed, split_fractions=tuple(args.split_fractions),
             size=args.size, workers=args.workers, progress=not args.no_progress)


def _work(task) -> int:
    partial, index, params = task
    partial = Path(partial)
    seed = params["seed"]
    photo = plan(seed, params["n_pairs"], tuple(params["split_fractions"]))["photos"][index]
    rgb, bbox, sha = birds.photo(seed, index, photo_attrs(birds.taxonomy(seed), photo), params["image_size"])
    save_image(partial / "data" / release.IMAGES / photo["file"], rgb)
    write_json(meta_path(partial, index), {"index": index, "file": photo["file"], "bbox": bbox, "pixel_sha256": sha},
               indent=None)
    return index


def _done(partial: Path, index: int) -> bool:
    m = meta_path(partial, index)
    return m.exists() and (partial / "data" / release.IMAGES / read_json(m)["file"]).exists()


def _finalize(partial: Path, params: dict) -> None:
    seed = params["seed"]
    pl = plan(seed, params["n_pairs"], tuple(params["split_fractions"]))
    tax = birds.taxonomy(seed)
    photos = pl["photos"]
    lines = ["\t".join(release.COLUMNS)]
    described = []
    for k, p in enumerate(pl["pairs"]):
        a, b = (photos[p[x]] for x in ("img1", "img2"))
        rng = np.random.default_rng([seed, TEXT_STREAM, k])
        attrs = photo_attrs(tax, a), photo_attrs(tax, b)
        for n in range(1, p["n_ann"] + 1):
            lines.append("\t".join([f"https://www.inaturalist.org/observations/{a['obs_id']}", a["url"],
                                    tax["species"][a["species"]]["latin"], "base",
                                    f"https://www.inaturalist.org/observations/{b['obs_id']}", b["url"],
                                    tax["species"][b["species"]]["latin"], p["selection"], p["split"], str(n),
                                    birds.comparison(*attrs, rng)]))
        described.append({"pair": k, "img1": a["file"], "img2": b["file"], "selection": p["selection"],
                          "species": [tax["species"][a["species"]]["name"], tax["species"][b["species"]]["name"]],
                          "attrs": list(attrs), "differences": birds.differences(*attrs)})
    with atomic_path(partial / "data" / release.TSV) as tmp:
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    write_jsonl(partial / "pairs.jsonl", described)
    counts = {s: {"pairs": sum(p["split"] == s for p in pl["pairs"]),
                  "rows": sum(p["n_ann"] for p in pl["pairs"] if p["split"] == s),
                  "photos": len({p[x] for p in pl["pairs"] if p["split"] == s for x in ("img1", "img2")})}
              for s in release.SPLITS}
    metas = [read_json(meta_path(partial, i)) for i in range(len(photos))]
    write_json(partial / "SYNTHETIC.json", {
        **params, "synthetic": True,
        "note": "synthetic — not the official Birds-to-Words: procedural birds (pipeline.synth.birds) in the "
                "release's TSV layout, photos stored under their URLs' local names",
        "counts": counts, "photos": len(photos), "species": len(tax["species"]),
        "pixel_sha256": hashlib.sha256("".join(m["pixel_sha256"] for m in metas).encode()).hexdigest(),
        "pairs": "pairs.jsonl"}, indent=2)


def generate(out, n_pairs: int = 600, seed: int = 0, split_fractions=DEFAULT_SPLIT_FRACTIONS, size: int = 224,
             workers: int = 1, progress: bool = True, max_new_indices: int | None = None) -> bool:
    """Render the world into ``out`` (resumable, ``pipeline.synth.world``); True once complete."""
    fr = check_arguments("synth-birds-to-words", split_fractions, n_pairs, seed, workers, size)
    pl = plan(seed, n_pairs, tuple(fr))
    if not any(p["split"] == "train" for p in pl["pairs"]):
        raise PipelineError(f"--n-pairs {n_pairs} leaves no training pair with --split-fractions {fr}")
    params = {"generator": GENERATOR, "version": VERSION, "seed": int(seed), "n_pairs": int(n_pairs),
              "split_fractions": fr, "image_size": int(size)}
    return render_world(out, params, params, list(range(len(pl["photos"]))), _work, _done,
                        lambda p: _finalize(p, params), SUBDIRS, workers=workers, progress=progress,
                        desc="synth-birds-to-words", max_new_indices=max_new_indices)
