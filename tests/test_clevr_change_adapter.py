import argparse
import json
import tarfile

import numpy as np
import pytest
from PIL import Image

from pipeline.datasets import clevr_change, fetch, manifest
from pipeline.errors import PipelineError
from pipeline.utils.download import download, sha256_file
from pipeline.utils.io import read_jsonl

TYPES = ["color", "material", "add", "drop", "move"]


def make_official_layout(root, n=10):
    """A hand-made miniature in the official layout (not the synthetic generator: an independent fixture)."""
    data = root / "data"
    for d in ("images", "sc_images", "nsc_images"):
        (data / d).mkdir(parents=True)
    for i in range(n):
        for rel in clevr_change.image_names(i):
            Image.fromarray(np.full((4, 6, 3), i, np.uint8)).save(data / rel)
    (data / "images" / "stray.txt").write_text("not an image")  # position-based pairing would break here
    change = {f"CLEVR_default_{i:06d}.png": [f"the cube {i} moved", "the block moved"] for i in range(n)}
    no_change = {f"CLEVR_default_{i:06d}.png": ["nothing has changed"] for i in range(n)}
    (data / "change_captions.json").write_text(json.dumps(change))
    (data / "no_change_captions.json").write_text(json.dumps(no_change))
    (data / "splits.json").write_text(json.dumps({"train": [3, 0, 1, 2, 4, 5], "val": [7, 6], "test": [9, 8]}))
    (data / "type_mapping.json").write_text(json.dumps({t: [f"{i:06d}.png" for i in range(n) if i * 5 // n == k]
                                                        for k, t in enumerate(TYPES)}))
    return data


def test_parse_pairs_by_name_with_types_and_distractors(tmp_path):
    data = make_official_layout(tmp_path)
    recs = clevr_change.parse(data, source="official")
    assert len(recs) == 20
    by_id = {r["pair_id"]: r for r in recs}
    r, n = by_id["000009.png"], by_id["000009.png_n"]
    assert (r["split"], r["change_type"], r["after"]) == ("test", "move", "sc_images/CLEVR_semantic_000009.png")
    assert (n["change_type"], n["after"], n["before"]) == ("no_change", "nsc_images/CLEVR_nonsemantic_000009.png", r["before"])
    assert r["captions"] == ["the cube 9 moved", "the block moved"]


def test_bad_layouts_name_the_file_and_key(tmp_path):
    data = make_official_layout(tmp_path)
    caps = json.loads((data / "change_captions.json").read_text())
    del caps["CLEVR_default_000007.png"]
    (data / "change_captions.json").write_text(json.dumps(caps))
    with pytest.raises(PipelineError, match=r"change_captions\.json.*CLEVR_default_000007\.png"):
        clevr_change.parse(data, "official")
    data2 = make_official_layout(tmp_path / "b")
    (data2 / "nsc_images" / "CLEVR_nonsemantic_000004.png").unlink()
    with pytest.raises(PipelineError, match="CLEVR_nonsemantic_000004.png"):
        clevr_change.parse(data2, "official")
    data3 = make_official_layout(tmp_path / "c")
    (data3 / "splits.json").write_text(json.dumps({"train": [1, 2], "val": [2], "test": [3]}))
    with pytest.raises(PipelineError, match="index 2 is in both"):
        clevr_change.parse(data3, "official")


def test_punctuation_only_caption_is_named_before_evaluation(tmp_path, capsys):
    from pipeline.__main__ import main
    from pipeline.evaluate import score

    data = make_official_layout(tmp_path)
    change = json.loads((data / "change_captions.json").read_text())
    change["CLEVR_default_000003.png"][1] = " ... !"
    (data / "change_captions.json").write_text(json.dumps(change))
    out = tmp_path / "manifest.jsonl"
    assert main(["manifest", "--dataset", "clevr_change", "--raw-dir", str(data), "--source", "official",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"error: {data / 'change_captions.json'}: 'CLEVR_default_000003.png': caption ' ... !' "
                           "has no word (empty or punctuation only)")
    assert not out.exists()
    # `inspect` reads the tree with the same parser and counts the fault instead of stopping at it
    from pipeline.datasets.inspect_tree import inspect_tree

    report = inspect_tree("clevr_change", data)
    assert report["n_warnings"] == 1
    assert "'CLEVR_default_000003.png': caption ' ... !' has no word" in report["warnings"][0]
    assert sum(s["empty_captions"] for s in report["splits"].values()) == 1
    # the evaluation says the same of a reference it is given directly, instead of pycocoevalcap's traceback
    with pytest.raises(PipelineError, match=r"references: pair 'a': reference caption '\.\.\.' has no word"):
        score({"a": ["..."], "b": ["a ball changed"]}, {"a": "the cube", "b": "a ball"}, metrics=("CIDEr",))


def test_manifest_stage_writes_jsonl(tmp_path):
    data = make_official_layout(tmp_path)
    manifest.run(argparse.Namespace(dataset="clevr_change", raw_dir=str(data), source="official",
                                    out=str(tmp_path / "m.jsonl")))
    recs = read_jsonl(tmp_path / "m.jsonl")
    assert len(recs) == 20 and {r["source"] for r in recs} == {"official"}


def test_fetch_offline_says_what_to_place_where(tmp_path):
    root = tmp_path / "official"
    with pytest.raises(PipelineError) as e:
        fetch.run(argparse.Namespace(dataset="clevr_change", root=str(root), no_download=True))
    msg = str(e.value)
    assert "clevr_change.tar.gz" in msg and str(root / "clevr_change.tar.gz") in msg and "drive.google.com" in msg
    assert not (root / "verified.json").exists()


def test_fetch_extracts_a_placed_archive_and_verifies(tmp_path):
    src = tmp_path / "src"
    make_official_layout(src)
    root = tmp_path / "official"
    root.mkdir()
    with tarfile.open(root / "clevr_change.tar.gz", "w:gz") as tar:
        tar.add(src / "data", arcname="data")
    fetch.run(argparse.Namespace(dataset="clevr_change", root=str(root), no_download=True))
    rep = json.loads((root / "verified.json").read_text())
    assert rep["pairs"] == 20 and rep["split_sizes"] == {"train": 6, "val": 2, "test": 2}
    assert rep["splits.json"]["matches_official"] is False and "warning" in rep


def test_truncated_archive_is_reported(tmp_path):
    root = tmp_path / "official"
    root.mkdir()
    (root / "clevr_change.tar.gz").write_bytes(b"\x1f\x8b\x08\x00broken")
    with pytest.raises(PipelineError, match="cannot extract"):
        fetch.run(argparse.Namespace(dataset="clevr_change", root=str(root), no_download=True))
    assert not (root / "data").exists()


def test_archive_cut_mid_extraction_leaves_no_staging_folder(tmp_path):
    src = tmp_path / "src"
    make_official_layout(src)
    root = tmp_path / "official"
    root.mkdir()
    whole = tmp_path / "whole.tar"  # uncompressed: members are written before the cut is noticed
    with tarfile.open(whole, "w") as tar:
        tar.add(src / "data", arcname="data")
    data = whole.read_bytes()
    (root / "clevr_change.tar.gz").write_bytes(data[: int(len(data) * 0.7)])
    # a staging folder left by an extraction killed outright (SIGKILL) is removed by the next try too
    (root / ".data.k1ll3d_9.tmp.x" / "data").mkdir(parents=True)
    for _ in range(2):  # one try after another: nothing accumulates
        with pytest.raises(PipelineError, match="clevr_change.tar.gz: cannot extract"):
            fetch.run(argparse.Namespace(dataset="clevr_change", root=str(root), no_download=True))
        assert sorted(p.name for p in root.iterdir()) == ["clevr_change.tar.gz"]


def test_download_verifies_checksums_and_is_atomic(tmp_path):
    src = tmp_path / "blob.bin"
    src.write_bytes(bytes(range(256)) * 1000)
    digest = sha256_file(src)
    out = download(src.as_uri(), tmp_path / "dl" / "blob.bin", sha256_prefix=digest[:8], progress=False)
    assert out.read_bytes() == src.read_bytes()
    with pytest.raises(PipelineError, match="checksum mismatch"):
        download(src.as_uri(), tmp_path / "dl" / "other.bin", sha256_prefix="deadbeef", progress=False)
    assert not (tmp_path / "dl" / "other.bin").exists()
