"""Sanity baselines: most frequent caption, nearest-neighbour retrieval on a tiny hand-made feature file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline import baselines as bl
from pipeline.__main__ import main
from pipeline.errors import PipelineError

C, H, W = 4, 2, 2
E = np.eye(C, dtype=np.float32)
# a zero-mean spatial pattern: mean pooling over H, W must cancel it
PATTERN = np.zeros((C, H, W), dtype=np.float32)
PATTERN[:, 0, 0], PATTERN[:, 1, 1] = 5.0, -5.0


def _fmap(v):
    return np.asarray(v, dtype=np.float32)[:, None, None] * np.ones((C, H, W), dtype=np.float32) + PATTERN


def _rec(pid, split, before, after, caps, ctype="color"):
    return {"pair_id": pid, "index": 0, "split": split, "before": before, "after": after, "change_type": ctype,
            "captions": caps, "labels": {}, "source": "synthetic", "generator_seed": 0}


def _world():
    """(records, {image key: [C, H, W] feature})."""
    b0, b3 = E[0], E[3]
    feats = {
        "images/t0.png": _fmap(b0), "sc_images/t0.png": _fmap(b0 + E[1]),         # change along e1
        "images/t1.png": _fmap(b0), "sc_images/t1.png": _fmap(b0 + E[2]),         # change along e2
        "images/t2.png": _fmap(b0), "sc_images/t2.png": _fmap(b0 + E[2]),         # duplicate of t1
        "images/t3.png": _fmap(b3), "nsc_images/t3.png": _fmap(b3),               # no change
        "images/v0.png": _fmap(2 * b0), "sc_images/v0.png": _fmap(2 * b0 + 3 * E[2]),
        "images/s0.png": _fmap(b0), "sc_images/s0.png": _fmap(b0 + E[1] + 0.1 * E[3]),
        "nsc_images/s0.png": _fmap(5 * b3),
        "images/s1.png": _fmap(5 * b3),
    }
    records = [
        _rec("t0.png", "train", "images/t0.png", "sc_images/t0.png", ["c0 a", "c0 b", "c0 a"]),
        _rec("t1.png", "train", "images/t1.png", "sc_images/t1.png", ["zz", "aa"]),
        _rec("t2.png", "train", "images/t2.png", "sc_images/t2.png", ["dup"]),
        _rec("t3.png_n", "train", "images/t3.png", "nsc_images/t3.png", ["no change", "no change", "nothing"], "no_change"),
        _rec("v0.png", "val", "images/v0.png", "sc_images/v0.png", ["?"]),
        _rec("s0.png", "test", "images/s0.png", "sc_images/s0.png", ["?"]),
        _rec("s0.png_n", "test", "images/s1.png", "nsc_images/s0.png", ["?"], "no_change"),
    ]
    return records, feats


class DictStore:
    """In-memory stand-in with the FeatureStore reading interface."""

    def __init__(self, feats):
        self.feats, self.calls = feats, []
        self.attrs = {"backbone": "toy", "weights": "random(seed=0)"}

    def __contains__(self, k):
        return k in self.feats

    def get_many(self, keys):
        self.calls.append(len(keys))
        return np.stack([self.feats[k] for k in keys]).astype(np.float32)


def test_most_frequent_caption_ties_lexicographic():
    assert bl.most_frequent_caption(["b", "a", "b", "a", "c"]) == "a"
    assert bl.most_frequent_caption(["x", "y", "y"]) == "y"
    records, _ = _world()
    records.append(_rec("v9.png", "val", "a", "b", ["c0 b"] * 10))  # val captions do not count
    # train counts: "c0 a" 2, "no change" 2, others 1 -> tie broken lexicographically
    assert bl.most_frequent_training_caption(records) == "c0 a"
    preds = bl.predict("most_frequent", records)
    assert {p["caption"] for s in ("val", "test") for p in preds[s]} == {"c0 a"}
    assert [p["image_id"] for p in preds["test"]] == ["s0.png", "s0.png_n"]
    # how clear the lead is: the same count for the runner-up (a tie lost on the string order)
    train_refs = sum(len(r["captions"]) for r in records if r["split"] == "train")
    assert bl.caption_margin(records) == {"caption": "c0 a", "count": 2, "runner_up": "no change",
                                          "runner_up_count": 2, "training_references": train_refs}


def test_nearest_neighbour_retrieves_right_pair():
    records, feats = _world()
    store = DictStore(feats)
    preds = bl.predict("nearest_neighbour", records, store, chunk_size=4)
    # v0: change along e2 -> t1 (tie with its duplicate t2 goes to the lower index) -> most frequent ref, ties lexicographic
    assert preds["val"] == [{"image_id": "v0.png", "caption": "aa"}]
    # s0: change along e1 -> t0; s0_n: no change on a scene like t3 -> t3
    assert preds["test"] == [{"image_id": "s0.png", "caption": "c0 a"}, {"image_id": "s0.png_n", "caption": "no change"}]
    assert max(store.calls) <= 4  # read in chunks of at most chunk_size images


def test_nearest_indices_streaming_matches_brute_force():
    rng = np.random.default_rng(0)
    q, db = rng.normal(size=(7, 16)).astype(np.float32), rng.normal(size=(50, 16)).astype(np.float32)
    n = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)
    expected = (n(q) @ n(db).T).argmax(axis=1)
    for chunk in (1, 7, 50):
        got = bl.nearest_indices(q, ((s, db[s : s + chunk]) for s in range(0, len(db), chunk)))
        assert got.tolist() == expected.tolist()
    # exact duplicates in different chunks: the lowest index wins
    db2 = np.concatenate([db[:5], db[:5]])
    got = bl.nearest_indices(db[:5], ((s, db2[s : s + 3]) for s in range(0, len(db2), 3)))
    assert got.tolist() == [0, 1, 2, 3, 4]


def _write_h5(path: Path, feats: dict) -> None:
    import h5py

    keys = sorted(feats)
    with h5py.File(path, "w") as f:
        f.create_dataset("features", data=np.stack([feats[k] for k in keys]).astype(np.float16), chunks=(1, C, H, W))
        f.create_dataset("keys", data=keys, dtype=h5py.string_dtype("utf-8"))
        f.attrs.update({"backbone": "toy_backbone", "layer": "layer3", "weights": "random(seed=0)", "input_size": 8,
                        "mean": [0.0, 0.0, 0.0], "std": [1.0, 1.0, 1.0], "code_version": "test", "complete": True})


def _write_manifest(path: Path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_cli_most_frequent_without_features(tmp_path):
    records, _ = _world()
    _write_manifest(tmp_path / "manifest.jsonl", records)
    out = tmp_path / "most_frequent" / "seed0"
    assert main(["baseline", "--kind", "most_frequent", "--manifest", str(tmp_path / "manifest.jsonl"),
                 "--dataset", "clevr_change", "--out-dir", str(out), "--seed", "0"]) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["kind"] == "sanity" and run["method"] == "most_frequent" and run["source"] == "synthetic"
    assert run["config"]["caption_margin"] == bl.caption_margin(records)
    assert json.loads((out / "predictions_test.json").read_text()) == [
        {"image_id": "s0.png", "caption": "c0 a"}, {"image_id": "s0.png_n", "caption": "c0 a"}]
    assert len(json.loads((out / "predictions_val.json").read_text())) == 1


def test_cli_nearest_neighbour_needs_features(tmp_path):
    records, _ = _world()
    _write_manifest(tmp_path / "m.jsonl", records)
    with pytest.raises(PipelineError, match="--features"):
        bl.run(bl_args(tmp_path / "m.jsonl", None, tmp_path / "o"))


def bl_args(manifest, features, out_dir, kind="nearest_neighbour"):
    import argparse

    p = argparse.ArgumentParser()
    bl.add_arguments(p)
    argv = ["--kind", kind, "--manifest", str(manifest), "--dataset", "clevr_change", "--out-dir", str(out_dir)]
    return p.parse_args(argv + (["--features", str(features)] if features else []))


def test_cli_nearest_neighbour_on_hdf5(tmp_path):
    pytest.importorskip("h5py")
    pytest.importorskip("pipeline.features.store", reason="FeatureStore not written yet")
    records, feats = _world()
    _write_manifest(tmp_path / "manifest.jsonl", records)
    _write_h5(tmp_path / "toy.h5", feats)
    out = tmp_path / "nearest_neighbour" / "seed0"
    assert main(["baseline", "--kind", "nearest_neighbour", "--manifest", str(tmp_path / "manifest.jsonl"),
                 "--features", str(tmp_path / "toy.h5"), "--dataset", "clevr_change", "--out-dir", str(out),
                 "--seed", "0", "--chunk-size", "4"]) == 0
    assert json.loads((out / "predictions_val.json").read_text()) == [{"image_id": "v0.png", "caption": "aa"}]
    assert json.loads((out / "predictions_test.json").read_text()) == [
        {"image_id": "s0.png", "caption": "c0 a"}, {"image_id": "s0.png_n", "caption": "no change"}]
    run = json.loads((out / "run.json").read_text())
    assert (run["kind"], run["method"], run["seed"]) == ("sanity", "nearest_neighbour", 0)
    assert (run["backbone"], run["weights"], run["source"]) == ("toy_backbone", "random(seed=0)", "synthetic")
