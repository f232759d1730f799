"""Image Editing Request: the parser and ``inspect`` on small hand-made trees, and ``fetch --dataset
image_editing_request`` served from local files (nothing can be downloaded here; the module's checksums and
counts are set to the hand-made release's)."""

import argparse
import copy
import hashlib
import json
import subprocess
import sys
import zipfile

import pytest

from pipeline.datasets import fetch
from pipeline.datasets import image_editing_request as ier
from pipeline.datasets.inspect_tree import inspect_tree
from pipeline.errors import PipelineError

ENTRIES = {
    "train": [
        {"img0": "Reddit.com_5fdtr1_5fdtr1.jpg", "img1": "Reddit.com_5fdtr1_dajgq1u.jpg",
         "sents": ["make color brighter"], "uid": "Reddit_1012"},
        {"img0": "Zhopped.com_77_77.png", "img1": "Zhopped.com_77_abc.JPG", "sents": ["remove the man on the left"],
         "uid": "Zhopped_3"},
    ],
    "valid": [
        {"img0": "Reddit.com_a1_a1.jpeg", "img1": "Reddit.com_a1_c9.gif",
         "sents": ["Increase the brightness", "brighten it", "add the effect"], "uid": "Reddit_7"},
        {"img0": "Reddit.com_b2_b2.jpg", "img1": "Reddit.com_b2_d4.jpg",
         "sents": ['Change the word "ARC" to "BEACH', "crop the image", "zoom in"], "uid": "Reddit_8"},
    ],
    "test": [
        {"img0": "Reddit.com_b2_b2.jpg", "img1": "Reddit.com_b2_d4.jpg",  # the valid pair Reddit_8 again
         "sents": ["Crop it", "cut the sides", "crop"], "uid": "Reddit_9"},
        {"img0": "Reddit.com_a1_a1.jpeg", "img1": "Zhopped.com_e5_f6.png",  # a shared img0 only
         "sents": ["make it black and white", "remove the color", "grayscale"], "uid": "Zhopped_11"},
        {"img0": "Zhopped.com_q_q.png", "img1": "Zhopped.com_q_r.png",
         "sents": ["remove the tree", "delete the tree", "take out the tree"], "uid": "Zhopped_12"},
    ],
}


def make_tree(root, entries=ENTRIES, skip=()):
    data = root / "data"
    (data / "images").mkdir(parents=True)
    for split, es in entries.items():
        (data / f"{split}.json").write_text(json.dumps(es))
        for e in es:
            for k in ("img0", "img1"):
                if e[k] not in skip and "/" not in e[k]:
                    (data / "images" / e[k]).write_bytes(hashlib.sha256(e[k].encode()).digest() * 8)
    return data


def test_one_record_per_entry_in_the_official_split(tmp_path):
    warnings = []
    recs = ier.parse(make_tree(tmp_path), source="synthetic", warnings=warnings)
    assert [(r["split"], r["pair_id"], r["index"]) for r in recs] == [
        ("train", "Reddit_1012", 0), ("train", "Zhopped_3", 1), ("val", "Reddit_7", 2), ("val", "Reddit_8", 3),
        ("test", "Reddit_9", 4), ("test", "Zhopped_11", 5), ("test", "Zhopped_12", 6)]
    by = {r["pair_id"]: r for r in recs}
    assert (by["Reddit_1012"]["before"], by["Reddit_1012"]["after"]) == (
        "images/Reddit.com_5fdtr1_5fdtr1.jpg", "images/Reddit.com_5fdtr1_dajgq1u.jpg")
    assert by["Zhopped_3"]["after"] == "images/Zhopped.com_77_abc.JPG"  # names as released, case kept
    assert by["Reddit_8"]["captions"] == ['Change the word "ARC" to "BEACH', "crop the image", "zoom in"]
    assert {r["change_type"] for r in recs} == {ier.CHANGE}
    assert all(r["labels"] == {} and r["source"] == "synthetic" for r in recs)
    # the repeated valid/test pair is kept in both splits and reported once, naming both files and its uid
    assert (by["Reddit_9"]["before"], by["Reddit_9"]["after"]) == (by["Reddit_8"]["before"], by["Reddit_8"]["after"])
    assert len(warnings) == 1
    assert "1 distinct pair(s) (1 entries) of" in warnings[0]
    assert "test.json repeat an (img0, img1) pair of" in warnings[0]
    assert "valid.json" in warnings[0] and "uid Reddit_9" in warnings[0]


def test_without_a_warning_list_the_repeats_are_printed(tmp_path, capsys):
    ier.parse(make_tree(tmp_path), source="synthetic")
    assert capsys.readouterr().out.count("Image Editing Request: 1 distinct pair(s)") == 1


def test_inspect_counts_pairs_requests_images_and_repeats(tmp_path):
    make_tree(tmp_path)
    report = inspect_tree("image_editing_request", tmp_path, source="synthetic")
    tr, va, te = (report["splits"][s] for s in ("train", "val", "test"))
    assert (tr["pairs"], tr["requests"], tr["distinct_images"]) == (2, 2, 4)
    assert (va["pairs"], va["requests"], va["distinct_images"]) == (2, 6, 4)
    assert (te["pairs"], te["requests"], te["distinct_images"]) == (3, 9, 6)
    assert (va["pairs_also_in_test"], te["pairs_also_in_val"], te["pairs_also_in_train"]) == (1, 1, 0)
    assert (va["images_also_in_test"], te["images_also_in_val"], tr["images_also_in_val"]) == (3, 3, 0)
    assert te["types"] == {"change": 3} and report["n_warnings"] == 1


def test_shared_pairs_are_counted_distinct_and_as_entries(tmp_path):
    # the release lists some shared pairs twice in test: 55 distinct valid/test pairs, 58 / 66 entries
    entries = {s: list(es) for s, es in ENTRIES.items()}
    entries["test"].append({**ENTRIES["test"][0], "uid": "Reddit_10"})
    make_tree(tmp_path, entries)
    warnings = []
    ier.parse(tmp_path / "data", source="synthetic", warnings=warnings)
    assert any("1 distinct pair(s) (2 entries) of" in w and "uid Reddit_9, Reddit_10" in w for w in warnings)
    te, va = (inspect_tree("image_editing_request", tmp_path, source="synthetic")["splits"][s]
              for s in ("test", "val"))
    assert (te["pairs"], te["distinct_pairs"], te["pairs_also_in_val"], te["entries_also_in_val"]) == (4, 3, 1, 2)
    assert (va["pairs_also_in_test"], va["entries_also_in_test"]) == (1, 1)


def test_inspect_cli_prints_the_counts(tmp_path):
    make_tree(tmp_path)
    p = subprocess.run([sys.executable, "-m", "pipeline", "inspect", "image_editing_request", "--root",
                        str(tmp_path), "--source", "synthetic"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["splits"]["test"]["pairs_also_in_val"] == 1


def _broken(tmp_path, split, i, **change):
    entries = copy.deepcopy(ENTRIES)
    entries[split][i].update(change)
    return make_tree(tmp_path, entries)


@pytest.mark.parametrize("split, i, change, message", [
    ("valid", 1, {"sents": []}, r"valid\.json: uid Reddit_8: no request \('sents' is \[\]\)"),
    ("test", 2, {"sents": ["", " ?! "]}, r"test\.json: uid Zhopped_12: no request"),
    ("train", 0, {"sents": "make color brighter"}, r"train\.json: uid Reddit_1012: 'sents' is not a list of strings"),
    ("train", 1, {"img1": "sub/x.png"}, r"train\.json: uid Zhopped_3: img1 'sub/x\.png' is not a bare file name"),
    ("test", 0, {"uid": "Zhopped_12"}, r"test\.json: uid Zhopped_12 occurs twice"),
])
def test_a_faulty_entry_is_one_error_naming_the_file_and_uid(tmp_path, split, i, change, message):
    data = _broken(tmp_path, split, i, **change)
    with pytest.raises(PipelineError, match=message):
        ier.parse(data, source="synthetic", warnings=[])


def test_an_entry_without_a_key_is_named(tmp_path):
    data = make_tree(tmp_path)
    es = json.loads((data / "valid.json").read_text())
    del es[0]["sents"]
    (data / "valid.json").write_text(json.dumps(es))
    with pytest.raises(PipelineError, match=r"valid\.json: entry 0 is not an object with img0, img1, sents, uid"):
        ier.parse(data, source="synthetic")


def test_invalid_json_names_the_file(tmp_path):
    data = make_tree(tmp_path)
    (data / "test.json").write_text('[{"img0": "a.jpg", ')
    with pytest.raises(PipelineError, match=r"test\.json: not valid JSON"):
        ier.parse(data, source="synthetic")
    (data / "test.json").write_text('{"img0": "a.jpg"}')
    with pytest.raises(PipelineError, match=r"test\.json: expected a JSON list"):
        ier.parse(data, source="synthetic")
    (data / "test.json").unlink()
    with pytest.raises(PipelineError, match=r"file missing: .*test\.json"):
        ier.parse(data, source="synthetic")


def test_a_missing_image_names_the_file_and_uid(tmp_path):
    data = make_tree(tmp_path, skip={"Zhopped.com_e5_f6.png"})
    with pytest.raises(PipelineError, match=r"image missing: .*images/Zhopped\.com_e5_f6\.png \(img1 of uid "
                                            r"Zhopped_11 in .*test\.json\)"):
        ier.parse(data, source="synthetic")
    assert len(ier.parse(data, source="synthetic", check_images=False, warnings=[])) == 7


def test_a_request_without_a_word_is_dropped_with_a_warning_or_raises(tmp_path):
    data = _broken(tmp_path, "test", 2, sents=["remove the tree", "...", "take out the tree"])
    warnings = []
    recs = ier.parse(data, source="synthetic", warnings=warnings)
    assert recs[-1]["captions"] == ["remove the tree", "take out the tree"]
    assert any("test.json: requests without a word dropped (uid Zhopped_12)" in w for w in warnings)
    with pytest.raises(PipelineError, match=r"test\.json: uid Zhopped_12: a request without a word"):
        ier.parse(data, source="synthetic")


def test_a_uid_of_an_earlier_split_keeps_the_records_apart(tmp_path):
    data = _broken(tmp_path, "test", 2, uid="Reddit_7")
    warnings = []
    recs = ier.parse(data, source="synthetic", warnings=warnings)
    assert [r["pair_id"] for r in recs if r["split"] != "train"][-1] == "test/Reddit_7"
    assert len({r["pair_id"] for r in recs}) == len(recs)
    assert any("1 uid(s) also used by an earlier split, kept as test/<uid>: Reddit_7" in w for w in warnings)


def test_official_source_checks_the_released_checksums(tmp_path):
    data = make_tree(tmp_path)
    with pytest.raises(PipelineError, match=r"train\.json: sha256 [0-9a-f]{64} is not the released train\.json's "
                                            r"\(a3d4a84e"):
        ier.parse(data, source="official")
    assert ier.OFFICIAL_SHA256["valid"].startswith("e76516f8") and ier.OFFICIAL_SHA256["test"].startswith("703c3225")
    assert {s: c["pairs"] for s, c in ier.OFFICIAL_COUNTS.items()} == {"train": 3061, "valid": 383, "test": 495}


# ---------------------------------------------------------------------------------------------------- fetch
def _run(root, no_download):
    fetch.run(argparse.Namespace(dataset="image_editing_request", root=str(root), no_download=no_download))
    return json.loads((root / "verified.json").read_text())


@pytest.fixture
def release(tmp_path, monkeypatch):
    """The hand-made release under tmp/src, served from there: the three JSON files and images.zip (the image
    files at its root, as an archive.org "download all" zip of the item would hold them)."""
    src = tmp_path / "src"
    data = make_tree(src)
    with zipfile.ZipFile(src / "images.zip", "w") as z:
        for p in sorted((data / "images").iterdir()):
            z.write(p, p.name)
    served = {"files": data.as_uri() + "/{name}",
              "archives": {"images.zip": {**fetch.RELEASES["image_editing_request"]["archives"]["images.zip"],
                                          "url": (src / "images.zip").as_uri()}}}
    monkeypatch.setitem(fetch.RELEASES, "image_editing_request", served)
    monkeypatch.setattr(ier, "OFFICIAL_SHA256", {s: hashlib.sha256((data / f"{s}.json").read_bytes()).hexdigest()
                                                 for s in ier.SPLITS})
    monkeypatch.setattr(ier, "OFFICIAL_COUNTS", {
        "train": {"pairs": 2, "requests": 2, "distinct_images": 4},
        "valid": {"pairs": 2, "requests": 6, "distinct_images": 4},
        "test": {"pairs": 3, "requests": 9, "distinct_images": 6}})
    monkeypatch.setattr(ier, "OFFICIAL_SHARED_PAIRS", {("valid", "test"): 1})
    return src


def test_fetch_downloads_extracts_and_verifies(release, tmp_path, monkeypatch):
    root = tmp_path / "official"
    rep = _run(root, no_download=False)
    assert rep["dataset"] == "image_editing_request" and rep["pairs"] == 7 and "warning" not in rep
    assert rep["counts"]["test"]["pairs_also_in_val"] == 1 and len(rep["parser_warnings"]) == 1
    assert rep["shared_pairs"] == {"valid/test": 1}
    got = sorted(p.name for p in (root / "data" / "images").iterdir())
    assert got == sorted(p.name for p in (release / "data" / "images").iterdir())
    assert sorted(p.name for p in (root / "data").iterdir()) == ["images", "test.json", "train.json", "valid.json"]
    # in place now: verified again without a download; other counts than the release's are a warning
    monkeypatch.setattr(fetch, "try_download", lambda *a, **k: pytest.fail("downloaded again"))
    monkeypatch.setitem(ier.OFFICIAL_COUNTS, "train", {"pairs": 3061, "requests": 3061, "distinct_images": 4516})
    assert "counts differ from the release's" in _run(root, no_download=False)["warning"]


def test_fetch_offline_is_one_message_naming_every_file_and_where_it_goes(tmp_path):
    root = tmp_path / "official"
    with pytest.raises(PipelineError) as e:
        _run(root, no_download=True)
    msg = str(e.value)
    repo = "https://github.com/airsplay/VisualRelationships/raw/9bee562ddb09e0872fd949bc1e7b1b3eaeb8e504/dataset/adobe"
    for split in ("train", "valid", "test"):
        assert f"- {split}.json: download it from {repo}/{split}.json and place it at {root / 'data'}/{split}.json" \
            in msg, msg
    assert ("- images.zip: download it from https://archive.org/details/image-editing-dataset or the Drive folder "
            "https://drive.google.com/drive/folders/1p_hkPwRUiLl1RHV3DkzQk3ti-GzHzT7O") in msg
    assert f"place it at {root / 'images.zip'} (or extract it so that {root / 'data/images'}/" in msg
    assert msg.startswith("cannot obtain the official image_editing_request release") and not root.exists()


def test_fetch_with_images_placed_by_hand_needs_only_the_json_files(release, tmp_path):
    root = tmp_path / "official"
    make_tree(tmp_path / "placed")
    (root / "data").mkdir(parents=True)
    (tmp_path / "placed/data/images").rename(root / "data/images")
    with pytest.raises(PipelineError) as e:
        _run(root, no_download=True)
    assert "- train.json:" in str(e.value) and "- images.zip:" not in str(e.value)
    assert "Already in place: images.zip." in str(e.value)
    assert _run(root, no_download=False)["pairs"] == 7
    assert not (root / "images.zip").exists()  # nothing downloaded for the images
