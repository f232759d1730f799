"""The synthetic bird world in its three layouts: each parses with the official parser without a warning, its text
states its birds' attributes (Birds-to-Words: their differences), pairs are of similar species, the release's
quirks are there; same seed -> byte-identical files for any worker count, resumed or not."""

import hashlib
import json
import re

import numpy as np
import pytest

from pipeline.datasets import birds_to_words as b2w_parser
from pipeline.datasets import cub as cub_parser
from pipeline.datasets import nabirds as nab_parser
from pipeline.datasets.inspect_tree import inspect_tree
from pipeline.synth import birds
from pipeline.synth import birds_to_words as b2w
from pipeline.synth import cub
from pipeline.synth import nabirds as nab

SIZE = 64
COLOR_WORDS = set(birds.COLORS)


def _tree_digest(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    base = tmp_path_factory.mktemp("birds")
    assert b2w.generate(base / "b2w", n_pairs=40, seed=0, size=SIZE, progress=False)
    assert cub.generate(base / "cub", n_images=48, n_species=8, seed=0, size=SIZE, progress=False)
    assert nab.generate(base / "nab", n_images=120, seed=0, size=SIZE, progress=False)
    return base


def test_taxonomy_species_are_distinct_attribute_combinations():
    tax = birds.taxonomy(0)
    keys = [tuple(s["attrs"][k] for k in birds.ATTRIBUTES) for s in tax["species"]]
    assert len(set(keys)) == len(keys) == 81 and len({s["name"] for s in tax["species"]}) == 81
    for s in tax["species"]:  # the genus fixes its keys, the family the body plan
        g = tax["genera"][s["genus"]]
        assert all(s["attrs"][k] == g["attrs"][k] for k in birds.FAMILY_KEYS + birds.GENUS_KEYS)
    assert birds.taxonomy(0) == birds.taxonomy(0) and birds.taxonomy(1) != birds.taxonomy(0)


def test_birds_to_words_layout_parses_and_paragraphs_state_the_differences(worlds):
    data = worlds / "b2w" / "data"
    assert sorted(p.name for p in data.iterdir()) == [b2w_parser.TSV, "images"]
    warnings = []
    recs = b2w_parser.parse(data, source="synthetic", warnings=warnings)
    assert warnings == [] and len(recs) == 40 and {r["split"] for r in recs} == {"train", "val", "test"}
    # no photo in two splits; every file is a pair's photo
    split_of = {}
    for r in recs:
        for k in ("before", "after"):
            assert split_of.setdefault(r[k], r["split"]) == r["split"]
    assert {f"images/{p.name}" for p in (data / "images").iterdir()} == set(split_of)
    pairs = [json.loads(line) for line in (worlds / "b2w" / "pairs.jsonl").read_text().splitlines()]
    tax = birds.taxonomy(0)
    genus_of = {s["latin"]: s["genus"] for s in tax["species"]}
    for r, p in zip(recs, pairs):
        assert r["before"] == f"images/{p['img1']}" and r["after"] == f"images/{p['img2']}"
        assert 1 <= len(r["captions"]) <= 5 and r["labels"]["selection"][0] == "base"
        values = {v for a in p["attrs"] for v in a.values()}
        for c in r["captions"]:
            assert c == c.lower() and re.search(r"\banimal[12]\b", c) or "both" in c, c
            assert {w for w in c.split() if w in COLOR_WORDS} <= values, (c, p)
            if not p["differences"]:
                assert re.search(r"identical|same kind|little difference", c), c
        g1, g2 = (genus_of[s] for s in r["labels"]["species"])
        if p["selection"] == "sameGenus" or p["selection"] == "sameSpecies":
            assert g1 == g2
        elif p["selection"] in ("sameFamily", "sameOrder", "visual"):
            assert g1 != g2
    assert sum(bool(p["differences"]) for p in pairs) > 30
    report = inspect_tree("birds_to_words", worlds / "b2w")
    meta = json.loads((worlds / "b2w" / "SYNTHETIC.json").read_text())
    for split in ("train", "val", "test"):
        assert report["splits"][split]["pairs"] == meta["counts"][split]["pairs"]
        assert report["splits"][split]["rows"] == meta["counts"][split]["rows"]


def test_birds_to_words_tsv_has_the_release_columns_and_urls(worlds):
    lines = (worlds / "b2w" / "data" / b2w_parser.TSV).read_text().splitlines()
    assert lines[0].split("\t") == list(b2w_parser.COLUMNS)
    for line in lines[1:]:
        f = line.split("\t")
        assert len(f) == 11 and re.fullmatch(r"https://static\.inaturalist\.org/photos/\d+/medium\.(jpg|jpeg|png)\?\d+",
                                             f[1])
        assert f[0].startswith("https://www.inaturalist.org/observations/") and f[8] in ("train", "val", "test")


def test_cub_layout_parses_in_the_class_disjoint_split_with_its_quirks(worlds):
    data = worlds / "cub" / "data"
    warnings = []
    recs = cub_parser.parse(data, source="synthetic", warnings=warnings)
    assert warnings == [] and len(recs) == 48
    classes = {s: {r["labels"]["class"] for r in recs if r["split"] == s} for s in ("train", "val")}
    assert len(classes["train"]) == 6 and len(classes["val"]) == 2 and not classes["train"] & classes["val"]
    assert all(len(r["captions"]) == 10 and len(set(r["captions"])) == 10 for r in recs)
    tax = birds.taxonomy(0)
    by_dir = {cub.class_dir(k + 1, tax["species"][s]["name"]): s for k, s in
              enumerate(cub.plan(0, 48, 8)["classes"][i]["species"] for i in range(8))}
    for r in recs:
        sp = tax["species"][by_dir[r["labels"]["class"]]]
        values = {v for a in (sp["attrs"], sp["female"] or {}) for v in a.values()}
        for c in r["captions"]:
            assert {w.strip(".,") for w in c.split() if w.strip(".,") in COLOR_WORDS} <= values
    raw = [p.read_bytes().decode() for p in (data / cub_parser.REED / cub_parser.TEXT).rglob("*.txt")]
    assert len(raw) == 48 and all(t.count("\n") >= 10 for t in raw)
    with pytest.raises(Exception, match="not the CUB release"):
        cub_parser.parse(data, source="official")
    report = inspect_tree("cub", worlds / "cub")
    assert report["splits"]["val"] == {"images": 12, "classes": 2, "captions": 120, "empty_captions": 0,
                                       "duplicate_captions": 0}


def test_cub_quirks_are_there_at_scale():
    rng_lines = [cub._caption_lines(0, {"id": i}, birds.taxonomy(0)["species"][0]["attrs"]) for i in range(1, 400)]
    assert any("\ufffd" in t for t in rng_lines) and any("\n\n" in t for t in rng_lines)


def test_nabirds_layout_has_non_contiguous_ids_and_parses(worlds):
    data = worlds / "nab" / "data"
    recs = nab_parser.parse(data, source="synthetic")
    assert len(recs) == 120 and {r["split"] for r in recs} == {"train", "test"}
    ids = sorted({r["labels"]["class_id"] for r in recs})
    labels = {r["labels"]["class_id"]: r["labels"]["label"] for r in recs}
    assert [labels[i] for i in ids] == list(range(len(ids))) and ids != list(range(len(ids)))
    plan = nab.plan(0, 120)
    assert len(ids) == len(plan["leaves"])  # every leaf holds an image (120 >= leaves)
    assert any(r["labels"]["class"].endswith("(Female/juvenile)") for r in recs)
    assert all(r["labels"]["ancestors"][-1] == 0 and len(r["labels"]["ancestors"]) in (4, 5) for r in recs)
    for r in recs:
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", r["image_id"])
        assert r["image"] == f"images/{r['labels']['class_id']:04d}/{r['image_id'].replace('-', '')}.jpg"
    classes = (data / "classes.txt").read_text().splitlines()
    assert classes[0] == "0 Birds" and len(classes) == json.loads((worlds / "nab" / "SYNTHETIC.json").read_text())[
        "counts"]["classes"]


@pytest.mark.parametrize("make", [
    lambda out, **kw: b2w.generate(out, n_pairs=12, seed=5, size=SIZE, progress=False, **kw),
    lambda out, **kw: cub.generate(out, n_images=12, n_species=4, seed=5, size=SIZE, progress=False, **kw),
    lambda out, **kw: nab.generate(out, n_images=12, seed=5, size=SIZE, progress=False, **kw),
], ids=["birds_to_words", "cub", "nabirds"])
def test_same_seed_same_bytes_for_any_worker_count_and_resumed(tmp_path, make):
    assert make(tmp_path / "a")
    assert make(tmp_path / "b", workers=2)
    assert not make(tmp_path / "c", max_new_indices=5)  # interrupted: resumed by the next call
    assert make(tmp_path / "c")
    a = _tree_digest(tmp_path / "a")
    assert a == _tree_digest(tmp_path / "b") == _tree_digest(tmp_path / "c")
    assert any(k.endswith((".jpg", ".jpeg", ".png")) for k in a)


def test_draw_bird_differs_by_attribute_and_pose():
    tax = birds.taxonomy(0)
    a = tax["species"][0]["attrs"]
    img1, box = birds.draw_bird(a, np.random.default_rng(0), 96, 72)
    img2, _ = birds.draw_bird(a, np.random.default_rng(0), 96, 72)
    assert img1.shape == (72, 96, 3) and np.array_equal(img1, img2) and box[2] > 10 and box[3] > 10
    other = {**a, "crown": "red" if a["crown"] != "red" else "blue"}
    img3, _ = birds.draw_bird(other, np.random.default_rng(0), 96, 72)
    assert 0 < (img1 != img3).any(-1).mean() < 0.1  # the crown only
