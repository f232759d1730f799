"""The synthetic Image Editing Request world: the release's layout and quirks (file names, mixed extensions,
1 / 3 / 3 requests, valid pairs repeated in test), requests that state their edit, edits that do what they
say, determinism and resumption."""

import json
import re

import numpy as np
import pytest

from pipeline.datasets import image_editing_request as parser
from pipeline.datasets.inspect_tree import inspect_tree
from pipeline.synth import image_editing_request as world

N, SIZE = 80, 96


@pytest.fixture(scope="module")
def ier(tmp_path_factory):
    out = tmp_path_factory.mktemp("ier") / "synthetic"
    assert world.generate(out, n_pairs=N, seed=0, size=SIZE, progress=False)
    return out


def _entries(ier):
    return {s: json.loads((ier / "data" / f"{s}.json").read_text()) for s in world.SPLITS}


def _scenes(ier):
    return {(s["img0"], s["img1"]): s for s in map(json.loads, (ier / "scenes.jsonl").read_text().splitlines())}


def test_layout_is_the_release_and_the_parser_reads_it(ier):
    data = ier / "data"
    assert sorted(p.name for p in data.iterdir()) == ["images", "test.json", "train.json", "valid.json"]
    entries = _entries(ier)
    names = {e[k] for es in entries.values() for e in es for k in ("img0", "img1")}
    n_siblings = json.loads((ier / "SYNTHETIC.json").read_text())["counts"]["test"]["siblings_of_valid"]
    assert n_siblings == round(world.SIBLING_FRACTION * 10) == 1
    assert {p.name for p in (data / "images").iterdir()} == names and len(names) == 2 * N - n_siblings
    for e in (e for es in entries.values() for e in es):
        assert re.fullmatch(r"(Reddit|Zhopped)_\d+", e["uid"])
        m0 = re.fullmatch(r"(Reddit|Zhopped)\.com_([0-9a-z]{6})_\2\.(jpg|png|JPG|jpeg|gif)", e["img0"])
        assert m0 and e["uid"].startswith(m0.group(1)), e
        assert re.fullmatch(rf"{m0.group(1)}\.com_{m0.group(2)}_[0-9a-z]{{7}}\.(jpg|png|JPG|jpeg|gif)", e["img1"])
    assert {n.rsplit(".", 1)[1] for n in names} >= {"jpg", "png"}
    assert {s: {len(e["sents"]) for e in es} for s, es in entries.items()} == {"train": {1}, "valid": {3}, "test": {3}}
    warnings = []
    recs = parser.parse(data, source="synthetic", warnings=warnings)
    assert len(recs) == sum(map(len, entries.values())) and {r["change_type"] for r in recs} == {parser.CHANGE}
    assert len(warnings) == 1 and "valid.json, kept in both splits as released" in warnings[0]  # the repeats only
    from PIL import Image

    r = recs[0]
    assert Image.open(data / r["before"]).size == (SIZE, SIZE * 3 // 4)
    meta = json.loads((ier / "SYNTHETIC.json").read_text())
    report = inspect_tree("image_editing_request", ier)
    assert report["source"] == "synthetic"
    for split, name in parser.SPLITS.items():
        assert report["splits"][name]["pairs"] == meta["counts"][split]["pairs"]
        assert report["splits"][name]["requests"] == meta["counts"][split]["requests"]
    assert {s: meta["counts"][s]["pairs"] for s in world.SPLITS} == {"train": 62, "valid": 8, "test": 10 + 1}


def test_valid_pairs_repeat_in_test_with_other_uids_and_requests(ier):
    entries = _entries(ier)
    valid = {(e["img0"], e["img1"]): e for e in entries["valid"]}
    repeats = [e for e in entries["test"] if (e["img0"], e["img1"]) in valid]
    assert len(repeats) == round(world.DUP_FRACTION * 8) == 1
    for e in repeats:
        v = valid[(e["img0"], e["img1"])]
        assert e["uid"] != v["uid"] and not set(e["sents"]) & set(v["sents"])
    counts = parser.source_counts(ier / "data", "synthetic")
    assert counts["test"]["pairs_also_in_val"] == counts["val"]["pairs_also_in_test"] == 1
    assert counts["test"]["images_also_in_val"] == 2 + 1  # the repeat's two files, the sibling's original
    assert counts["train"]["pairs_also_in_test"] == 0
    uids = [e["uid"] for es in entries.values() for e in es]
    assert len(uids) == len(set(uids))


def test_a_sibling_edits_a_valid_original_another_way(ier):
    """As the release's valid and test share originals edited differently: the same img0 file, another edit."""
    entries, scenes = _entries(ier), _scenes(ier)
    valid = {e["img0"]: e for e in entries["valid"]}
    sibs = [e for e in entries["test"] if e["img0"] in valid and e["img1"] != valid[e["img0"]]["img1"]]
    assert len(sibs) == 1
    e, v = sibs[0], valid[sibs[0]["img0"]]
    assert e["img1"].rsplit("_", 1)[0] == v["img0"].rsplit("_", 1)[0]  # a comment of the same post
    assert e["uid"].split("_")[0] == v["uid"].split("_")[0]
    s, sv = scenes[(e["img0"], e["img1"])], scenes[(v["img0"], v["img1"])]
    assert s["scene"] == sv["scene"] and s["edit"]["kind"] != sv["edit"]["kind"]


def test_every_request_states_its_edit(ier):
    scenes = _scenes(ier)
    kinds = set()
    for es in _entries(ier).values():
        for e in es:
            s = scenes[(e["img0"], e["img1"])]
            edit, kinds = s["edit"], kinds | {s["edit"]["kind"]}
            for sent in e["sents"]:
                low = sent.lower()
                assert any(k in low for k in world.KEYWORDS[edit["kind"]]), (sent, edit)
                assert 2 <= len(low.split()) <= 14 and re.fullmatch(r"[A-Za-z0-9 ,.!\"']+", sent), sent
                if "object" in edit:
                    o = s["scene"]["objects"][edit["object"]]
                    assert o["color"] in low.split() and set(world.NOUNS[o["kind"]]) & set(re.findall(r"\w+", low))
                if edit["kind"] == "recolour":
                    assert low.split()[-1].strip(".") == edit["new"], sent
                if edit["kind"] == "add_text":
                    assert edit["text"].lower() in low
                if edit["kind"] == "rotate":
                    assert any(w in low for w in world.ROTATIONS[edit["way"]]), sent
    assert len(kinds) >= 10  # global and local edits both present at this size
    assert kinds & set(world.LOCAL) and kinds & set(world.GLOBAL)


def _scene(seed=5, w=SIZE):
    rng = np.random.default_rng(seed)
    return world.make_scene(rng, w, w * 3 // 4)


@pytest.mark.parametrize("kind", world.EDITS)
def test_each_edit_does_what_its_requests_say(kind):
    w, h = SIZE, SIZE * 3 // 4
    scene = _scene()
    edits = (world.choose_edit(np.random.default_rng(k), scene) for k in range(1000))
    edit = next(e for e in edits if e["kind"] == kind)  # its parameters as the world draws them
    before = world.draw(scene, w, h)
    after = world.apply_edit(scene, edit, before).astype(float)
    b = before.astype(float)
    lum = lambda x: x.mean()  # noqa: E731
    sat = lambda x: (x.max(axis=2) - x.min(axis=2)).mean()  # noqa: E731
    if kind == "brighten":
        assert lum(after) > lum(b) + 10
    elif kind == "darken":
        assert lum(after) < lum(b) - 10
    elif kind == "more_contrast":
        assert after.std() > b.std() * 1.2
    elif kind == "less_contrast":
        assert after.std() < b.std() * 0.8
    elif kind == "saturate":
        assert sat(after) > sat(b) * 1.3
    elif kind == "black_and_white":
        assert sat(after) == 0 and sat(b) > 20
    elif kind in ("warm", "cool"):
        shift = (after[..., 0] - after[..., 2]).mean() - (b[..., 0] - b[..., 2]).mean()
        assert shift > 15 if kind == "warm" else shift < -15
    elif kind == "crop":
        assert after.shape[0] < h and after.shape[1] < w
    elif kind == "zoom":
        assert after.shape == b.shape and np.abs(after - b).mean() > 5
    elif kind == "rotate":
        if edit["way"] == "half":
            assert np.array_equal(after, b[::-1, ::-1])
        else:
            assert after.shape[:2] == (w, h)
    elif kind == "flip":
        assert np.array_equal(after, b[:, ::-1])
    elif kind in ("blur", "sharpen"):
        grad = lambda x: np.abs(np.diff(x, axis=1)).mean()  # noqa: E731
        assert grad(after) < grad(b) * 0.7 if kind == "blur" else grad(after) > grad(b) * 1.2
    elif kind in ("remove", "recolour", "add_text"):
        changed = np.abs(after - b).max(axis=2) > 30
        assert 0.003 < changed.mean() < 0.3  # a local change: some pixels, not the whole photo
        if kind == "remove":
            o = scene["objects"][edit["object"]]
            ys, xs = np.nonzero(changed)
            assert abs(xs.mean() / w - o["cx"]) < 0.15  # where the removed object stood


def test_same_seed_same_world_any_worker_count_and_resumed(tmp_path, ier):
    meta = json.loads((ier / "SYNTHETIC.json").read_text())
    out = tmp_path / "again"
    assert not world.generate(out, n_pairs=N, seed=0, size=SIZE, progress=False, max_new_indices=30)
    assert (tmp_path / "again.partial").is_dir() and not out.exists()
    assert world.generate(out, n_pairs=N, seed=0, size=SIZE, workers=2, progress=False)
    again = json.loads((out / "SYNTHETIC.json").read_text())
    assert again["pixel_sha256"] == meta["pixel_sha256"] and again["counts"] == meta["counts"]
    for s in world.SPLITS:
        assert (out / "data" / f"{s}.json").read_bytes() == (ier / "data" / f"{s}.json").read_bytes()
    other = tmp_path / "other"
    assert world.generate(other, n_pairs=N, seed=1, size=SIZE, progress=False)
    assert json.loads((other / "SYNTHETIC.json").read_text())["pixel_sha256"] != meta["pixel_sha256"]
