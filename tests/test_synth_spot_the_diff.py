"""The synthetic Spot-the-Diff world: the release's layout, the quirks the parser must handle (duplicate-id
entries, empty sentences, gaps in the ids), sentences in the dataset's style that state their pair's changes,
real changes under a small illumination change, determinism and resumption."""

import json
import re

import numpy as np
import pytest

from pipeline.datasets import spot_the_diff as parser
from pipeline.datasets.inspect_tree import inspect_tree
from pipeline.synth import spot_the_diff as world

N, SIZE = 60, 96


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    out = tmp_path_factory.mktemp("sd") / "synthetic"
    assert world.generate(out, n_pairs=N, seed=0, size=SIZE, progress=False)
    return out


def _scenes(sd):
    return {s["img_id"]: s for s in map(json.loads, (sd / "scenes.jsonl").read_text().splitlines())}


def test_layout_is_the_release_and_the_parser_reads_it(sd):
    data = sd / "data"
    assert sorted(p.name for p in data.iterdir()) == ["annotations", "resized_images"]
    assert sorted(p.name for p in (data / "annotations").iterdir()) == ["test.json", "train.json", "val.json"]
    images = {p.name for p in (data / "resized_images").iterdir()}
    scenes = _scenes(sd)
    assert images == {f"{i}{s}.png" for i in scenes for s in ("", "_2")}
    assert max(scenes) >= N and len(scenes) == N  # ids with gaps, as released
    from PIL import Image

    assert Image.open(data / "resized_images" / f"{min(scenes)}_2.png").size == (SIZE, SIZE)
    warnings = []
    recs = parser.parse(data, source="synthetic", warnings=warnings)
    assert len(recs) == N and {r["change_type"] for r in recs} == {parser.CHANGE}
    assert all("empty sentence(s) dropped" in w for w in warnings)  # the only fault: the planted empties
    report = inspect_tree("spot_the_diff", sd)
    assert report["source"] == "synthetic" and report["n_warnings"] == len(warnings)
    meta = json.loads((sd / "SYNTHETIC.json").read_text())
    for split in parser.SPLITS:
        got = report["splits"][split]
        assert {k: got[k] for k in ("entries", "distinct_pairs", "sentences", "empty_sentences")} == {
            k: meta["counts"][split][k] for k in ("entries", "distinct_pairs", "sentences", "empty_sentences")}
    assert {s: meta["counts"][s]["distinct_pairs"] for s in parser.SPLITS} == {"train": 45, "val": 8, "test": 7}


def test_the_parsers_quirks_are_exercised(sd):
    meta = json.loads((sd / "SYNTHETIC.json").read_text())
    counts = parser.source_counts(sd / "data", "synthetic")
    assert sum(c["duplicate_ids"] for c in counts.values()) >= 2
    assert sum(c["empty_sentences"] for c in counts.values()) >= 1
    assert sum(meta["counts"][s]["entries"] for s in parser.SPLITS) > N
    entries = json.loads((sd / "data" / "annotations" / "train.json").read_text())
    ids = [e["img_id"] for e in entries]
    assert ids != sorted(ids, key=int)  # file order is not id order
    assert all(isinstance(i, str) and i.isdigit() for i in ids)


def test_sentences_state_the_changes_in_the_dataset_style(sd):
    scenes = _scenes(sd)
    n_changes = []
    for split in parser.SPLITS:
        for e in json.loads((sd / "data" / "annotations" / f"{split}.json").read_text()):
            s = scenes[int(e["img_id"])]
            words = [x for x in e["sentences"] if x]
            assert len(words) == len(s["changes"]), e  # one sentence per change, per annotator
            for sent in words:
                assert re.fullmatch(r"[a-z]+( [a-z]+)*", sent) and len(sent.split()) <= 22, sent
            for c in s["changes"]:  # each change is described by one of the entry's sentences
                t = c["after"] if c["kind"] == "appear" else c["before"]
                noun = {"car": ("car", "vehicle"), "truck": ("truck",), "person": ("person",),
                        "bag": ("bag", "backpack")}[t["kind"]]
                assert any(t["color"] in x.split() and set(noun) & set(x.split()) for x in words), (e, c)
            n_changes.append(len(s["changes"]))
    assert set(n_changes) == {1, 2, 3}
    kinds = {c["kind"] for s in scenes.values() for c in s["changes"]}
    assert kinds == set(world.CHANGES)


def test_changes_are_visible_and_the_rest_only_relit(sd):
    from PIL import Image

    scenes = _scenes(sd)
    cam = world.Cam(SIZE, SIZE)
    for img_id, s in list(scenes.items())[:20]:
        before = np.asarray(Image.open(sd / "data" / "resized_images" / f"{img_id}.png"), np.float64)
        after = np.asarray(Image.open(sd / "data" / "resized_images" / f"{img_id}_2.png"), np.float64)
        things_b = [world.Thing(**t) for t in s["before"]]
        things_a = [world.Thing(**t) for t in s["after"]]
        _, ids_b = world.draw(things_b, cam)
        _, ids_a = world.draw(things_a, cam)
        same = (ids_b == -1) & (ids_a == -1)
        # unchanged pixels: only the illumination (gain, tint) and the noise differ
        gain = s["light"]["gain"] * (1 + np.asarray(s["light"]["tint"]))
        resid = np.abs(after[same] - np.clip(before[same] * gain, 0, 255))
        assert resid.mean() < 6.0, img_id
        assert 0.9 <= s["light"]["gain"] <= 1.1 and max(map(abs, s["light"]["tint"])) <= 0.03
        changed = np.zeros(ids_b.shape, bool)
        for c in s["changes"]:
            if c["before"] is not None:
                changed |= ids_b == things_b.index(world.Thing(**c["before"]))
            if c["after"] is not None:
                changed |= ids_a == things_a.index(world.Thing(**c["after"]))
        assert changed.sum() >= 3 and np.abs(after[changed] - before[changed]).mean() > 15.0, img_id


def test_same_seed_same_pixels_any_worker_count_and_after_a_resume(sd, tmp_path):
    meta = json.loads((sd / "SYNTHETIC.json").read_text())
    two = tmp_path / "two"
    assert world.generate(two, n_pairs=N, seed=0, size=SIZE, workers=2, progress=False)
    assert json.loads((two / "SYNTHETIC.json").read_text())["pixel_sha256"] == meta["pixel_sha256"]
    cut = tmp_path / "cut"
    assert world.generate(cut, n_pairs=N, seed=0, size=SIZE, progress=False, max_new_indices=7) is False
    assert not cut.exists() and len(list((tmp_path / "cut.partial" / "meta").iterdir())) == 7
    (tmp_path / "cut.partial" / "data" / "resized_images" / ".9.png.k1ll3d_9.tmp").write_bytes(b"half a png")
    assert world.generate(cut, n_pairs=N, seed=0, size=SIZE, progress=False)
    for split in parser.SPLITS:
        name = f"annotations/{split}.json"
        assert (cut / "data" / name).read_bytes() == (sd / "data" / name).read_bytes()
    assert json.loads((cut / "SYNTHETIC.json").read_text())["pixel_sha256"] == meta["pixel_sha256"]
    assert not (tmp_path / "cut.partial").exists() and not list(cut.rglob(".*.tmp"))
    other = tmp_path / "seed1"
    assert world.generate(other, n_pairs=N, seed=1, size=SIZE, progress=False)
    assert json.loads((other / "SYNTHETIC.json").read_text())["pixel_sha256"] != meta["pixel_sha256"]


def test_bad_arguments_are_one_clear_error(tmp_path):
    from pipeline.errors import PipelineError

    with pytest.raises(PipelineError, match="split-fractions"):
        world.generate(tmp_path / "x", n_pairs=20, split_fractions=(0.5, 0.5, 0.5), progress=False)
    with pytest.raises(PipelineError, match="n_pairs 5"):
        world.generate(tmp_path / "x", n_pairs=5, progress=False)
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()
