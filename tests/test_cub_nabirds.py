"""CUB (+ Reed et al.'s captions, L2C split) and NABirds: the parsers on miniature hand-made releases, and their
fetch served from local files (CUB's md5-checked archives; NABirds gated: placed by hand or the message)."""

import argparse
import hashlib
import json
import shutil
import tarfile

import pytest

from pipeline.datasets import cub, fetch, nabirds
from pipeline.datasets.inspect_tree import inspect_tree
from pipeline.errors import PipelineError

CLASSES = {1: "001.Black_footed_Albatross", 2: "002.Laysan_Albatross", 3: "003.Sooty_Albatross",
           4: "004.Groove_billed_Ani"}
TRAINVAL, TEST = (1, 2, 3), (4,)
PER_CLASS = 3
CAPTION_LINES = [f"this bird has {w} wings and a {w} crown" for w in
                 ("black", "white", "grey", "brown", "red", "blue", "green", "buff", "olive", "rufous", "pink")]


def make_cub(root, captions=CAPTION_LINES):
    """A miniature CUB: 4 classes x 3 images (ids 1..12 class by class), classes 1-3 trainval, 4 test; every
    other image in the official train split."""
    data = root / "data"
    c, r = data / cub.CUB, data / cub.REED
    (c / "images").mkdir(parents=True)
    images, labels = [], []
    for k, d in CLASSES.items():
        (c / "images" / d).mkdir()
        (r / cub.TEXT / d).mkdir(parents=True)
        for j in range(PER_CLASS):
            i = len(images) + 1
            rel = f"{d}/{d.split('.')[1]}_{j + 1:04d}_{100 + i}.jpg"
            images.append(f"{i} {rel}")
            labels.append(f"{i} {k}")
            (c / "images" / rel).write_bytes(b"\xff\xd8" + rel.encode())
            (r / cub.TEXT / rel).with_suffix(".txt").write_text("\n".join(captions) + "\n")
    (c / "images.txt").write_text("\n".join(images) + "\n")
    (c / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    (c / "classes.txt").write_text("".join(f"{k} {d}\n" for k, d in CLASSES.items()))
    (c / "train_test_split.txt").write_text("".join(f"{i} {i % 2}\n" for i in range(1, len(images) + 1)))
    (r / "trainvalclasses.txt").write_text("".join(CLASSES[k] + "\n" for k in TRAINVAL))
    (r / "testclasses.txt").write_text("".join(CLASSES[k] + "\n" for k in TEST))
    return data


MINI = {"images": 12, "classes": 4, "split_images": {"train": 9, "val": 3}, "split_classes": {"train": 3, "val": 1},
        "official_split": {"train": 6, "test": 6}}


def test_cub_records_are_single_images_in_the_class_disjoint_split(tmp_path, monkeypatch):
    data = make_cub(tmp_path)
    recs = cub.parse(data, source="synthetic", generator_seed=1)
    assert [r["split"] for r in recs] == ["train"] * 9 + ["val"] * 3 and [r["index"] for r in recs] == list(range(1, 13))
    r = recs[0]
    assert r["image"] == "CUB_200_2011/images/001.Black_footed_Albatross/Black_footed_Albatross_0001_101.jpg"
    assert r["image_id"] == "Black_footed_Albatross_0001_101" and r["captions"] == CAPTION_LINES[:10]
    assert r["labels"] == {"class_id": 1, "class": "001.Black_footed_Albatross", "official_split": "train"}
    assert "before" not in r and "change_type" not in r
    # official: the release's counts are asserted (the miniature's pass once they are its own)
    with pytest.raises(PipelineError, match=r"not the CUB release in the L2C split: .*'split_images': "
                                            r"\{'train': 9, 'val': 3\}.*expected .*8855"):
        cub.parse(data, source="official")
    monkeypatch.setattr(cub, "OFFICIAL", MINI)
    assert len(cub.parse(data, source="official")) == 12
    report = inspect_tree("cub", tmp_path, source="official")
    assert report["splits"]["train"] == {"images": 9, "classes": 3, "captions": 90, "empty_captions": 0,
                                         "duplicate_captions": 0}


def test_cub_caption_quirks(tmp_path):
    """Encoding artefacts removed, blank lines skipped, the first ten kept; fewer than ten is reported."""
    lines = ["this bird has a \ufffd\ufffd red crown", "", "   "] + CAPTION_LINES[1:]
    data = make_cub(tmp_path, captions=lines)
    r = cub.parse(data, source="synthetic")[0]
    assert r["captions"][0] == "this bird has a red crown" and r["captions"][1:] == CAPTION_LINES[1:10]
    data = make_cub(tmp_path / "few", captions=CAPTION_LINES[:4])
    with pytest.raises(PipelineError, match=r"Black_footed_Albatross_0001_101.txt: 4 caption\(s\), the release has 10"):
        cub.parse(data, source="synthetic")
    warnings = []
    assert len(cub.parse(data, source="synthetic", warnings=warnings)) == 12 and len(warnings) == 12


@pytest.mark.parametrize("edit, message", [
    (lambda d: (d / cub.REED / "testclasses.txt").write_text("001.Black_footed_Albatross\n004.Groove_billed_Ani\n"),
     r"testclasses.txt: class 001.Black_footed_Albatross is also in .*trainvalclasses.txt"),
    (lambda d: (d / cub.REED / "testclasses.txt").write_text(""), r"004.Groove_billed_Ani in neither"),
    (lambda d: (d / cub.CUB / "image_class_labels.txt").write_text("1 1\n"), r"image_class_labels.txt: no class for "
                                                                           r"image id\(s\) 2, 3"),
    (lambda d: (d / cub.CUB / "classes.txt").write_text("1\n"), r"classes.txt: line 1: expected 2 fields"),
    (lambda d: (d / cub.CUB / "train_test_split.txt").unlink(), r"CUB file missing: .*train_test_split.txt"),
    (lambda d: next((d / cub.CUB / "images").rglob("*_0002_*.jpg")).unlink(), r"CUB image missing: .*_0002_"),
    (lambda d: next((d / cub.REED).rglob("*_0003_*.txt")).write_text("\n...\n"), r"_0003_.*.txt: no caption"),
    (lambda d: shutil.rmtree(d / cub.REED / cub.TEXT / CLASSES[4]), r"caption file missing: .*004.Groove"),
])
def test_cub_bad_input_is_one_clear_error_naming_the_file(tmp_path, edit, message):
    data = make_cub(tmp_path)
    edit(data)
    with pytest.raises(PipelineError, match=message):
        cub.parse(data, source="synthetic", warnings=[])


# ------------------------------------------------------------------------------------------------ NABirds
# root 0 > order 400 > family 17 > species 903 (leaf) and species 250 > plumages 777 (male), 12 (female)
NB_CLASSES = {0: "Birds", 400: "Passeriformes", 17: "Tanagers", 903: "Scarlet Tanager", 250: "Summer Tanager",
              777: "Summer Tanager (Adult male)", 12: "Summer Tanager (Female/juvenile)"}
NB_PARENT = {400: 0, 17: 400, 903: 17, 250: 17, 777: 250, 12: 250}
NB_IMAGES = [("0000139e-21dc-4d0c-bfe1-4cae3c85c829", 777, 1), ("0a1b2c3d-0000-4000-8000-000000000001", 903, 0),
             ("ffff0000-1111-4222-8333-444455556666", 12, 1), ("12345678-aaaa-4bbb-8ccc-dddddddddddd", 777, 0)]


def make_nabirds(root, images=NB_IMAGES):
    data = root / "data"
    data.mkdir(parents=True)
    lines = {"images.txt": [], "image_class_labels.txt": [], "train_test_split.txt": []}
    for uuid, c, train in images:
        rel = f"{c:04d}/{uuid.replace('-', '')}.jpg"
        (data / "images" / rel).parent.mkdir(parents=True, exist_ok=True)
        (data / "images" / rel).write_bytes(b"\xff\xd8" + uuid.encode())
        lines["images.txt"].append(f"{uuid} {rel}")
        lines["image_class_labels.txt"].append(f"{uuid} {c}")
        lines["train_test_split.txt"].append(f"{uuid} {train}")
    lines["classes.txt"] = [f"{k} {v}" for k, v in sorted(NB_CLASSES.items())]
    lines["hierarchy.txt"] = [f"{c} {p}" for c, p in NB_PARENT.items()]
    for name, ls in lines.items():
        (data / name).write_text("\n".join(ls) + "\n")
    return data


def test_nabirds_leaf_classes_are_remapped_to_contiguous_labels(tmp_path, monkeypatch):
    data = make_nabirds(tmp_path)
    recs = nabirds.parse(data, source="synthetic")
    # leaves holding images: 12, 777, 903 -> 0, 1, 2 (ascending class id)
    assert [(r["labels"]["class_id"], r["labels"]["label"]) for r in recs] == [(777, 1), (903, 2), (12, 0), (777, 1)]
    assert recs[0]["labels"]["ancestors"] == [250, 17, 400, 0] and recs[1]["labels"]["ancestors"] == [17, 400, 0]
    assert recs[2]["labels"]["class"] == "Summer Tanager (Female/juvenile)"
    assert [r["split"] for r in recs] == ["train", "test", "train", "test"]
    assert recs[0]["image"] == "images/0777/0000139e21dc4d0cbfe14cae3c85c829.jpg" and recs[0]["captions"] == []
    with pytest.raises(PipelineError, match=r"not the NABirds release: \{'images': 4, 'labels': 3\}"):
        nabirds.parse(data, source="official")
    monkeypatch.setattr(nabirds, "OFFICIAL", {"images": 4, "labels": 3})
    report = inspect_tree("nabirds", tmp_path, source="official")
    assert report["splits"]["train"]["images"] == 2 and report["splits"]["test"]["classes"] == 2


@pytest.mark.parametrize("edit, message", [
    (lambda d: (d / "image_class_labels.txt").write_text(
        (d / "image_class_labels.txt").read_text().replace(" 903", " 250")), r"class 250 \(Summer Tanager\) is not a leaf"),
    (lambda d: (d / "hierarchy.txt").write_text("400 17\n17 400\n"), r"hierarchy.txt: the hierarchy has a cycle"),
    (lambda d: (d / "hierarchy.txt").write_text("903 31\n"), r"hierarchy.txt: class 31 is not in .*classes.txt"),
    (lambda d: (d / "image_class_labels.txt").write_text("0000139e-21dc-4d0c-bfe1-4cae3c85c829 x7\n"),
     r"image_class_labels.txt: class 'x7' is not a class id"),
    (lambda d: (d / "train_test_split.txt").write_text("0000139e-21dc-4d0c-bfe1-4cae3c85c829 1\n"),
     r"train_test_split.txt: no entry for image 0a1b2c3d"),
    (lambda d: shutil.rmtree(d / "images" / "0012"), r"NABirds image missing: .*0012/ffff0000"),
    (lambda d: (d / "classes.txt").unlink(), r"NABirds file missing: .*classes.txt"),
])
def test_nabirds_bad_input_is_one_clear_error_naming_the_file(tmp_path, edit, message):
    data = make_nabirds(tmp_path)
    edit(data)
    with pytest.raises(PipelineError, match=message):
        nabirds.parse(data, source="synthetic")


# ------------------------------------------------------------------------------------------------ fetch
def _tgz(folder, archive, arcname):
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname=arcname)
    return archive


def _md5(path):
    return hashlib.md5(path.read_bytes()).hexdigest()


def _run(dataset, root, no_download):
    fetch.run(argparse.Namespace(dataset=dataset, root=str(root), no_download=no_download))
    return json.loads((root / "verified.json").read_text())


@pytest.fixture
def cub_release(tmp_path, monkeypatch):
    src = tmp_path / "src"
    data = make_cub(src)
    _tgz(data / cub.CUB, src / "CUB_200_2011.tgz", cub.CUB)
    _tgz(data / cub.REED, src / "cvpr2016_cub.tar.gz", cub.REED)
    monkeypatch.setitem(fetch.RELEASES, "cub", {"archives": {
        n: {"page": f"https://example.org/{n}", "url": (src / n).as_uri()} for n in ("CUB_200_2011.tgz",
                                                                                 "cvpr2016_cub.tar.gz")}})
    monkeypatch.setattr(fetch, "CUB_MD5", _md5(src / "CUB_200_2011.tgz"))
    monkeypatch.setattr(cub, "OFFICIAL", MINI)
    return src


def test_cub_fetch_downloads_checks_the_md5_and_verifies(cub_release, tmp_path):
    root = tmp_path / "official"
    rep = _run("cub", root, no_download=False)
    assert rep["images"] == 12 and rep["split_sizes"] == {"train": 9, "val": 3} and rep["captions"] == 120
    assert sorted(p.name for p in (root / "data").iterdir()) == [cub.CUB, cub.REED]


def test_cub_md5_mismatch_is_named_and_the_download_deleted(cub_release, tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "CUB_MD5", "0" * 32)
    root = tmp_path / "official"
    with pytest.raises(PipelineError, match=r"CUB_200_2011.tgz: md5 [0-9a-f]{32} is not the release's 0{32} "
                                            r"\(download deleted; try again\)"):
        _run("cub", root, no_download=False)
    assert not (root / "CUB_200_2011.tgz").exists() and not (root / "data" / cub.CUB).exists()
    for n in ("CUB_200_2011.tgz", "cvpr2016_cub.tar.gz"):  # placed by hand: checked, kept
        shutil.copy(cub_release / n, root / n)
    with pytest.raises(PipelineError, match=r"md5 .* is not the release's"):
        _run("cub", root, no_download=True)
    assert (root / "CUB_200_2011.tgz").exists() and not (root / "data" / cub.CUB).exists()


def test_cub_download_resumes(cub_release, tmp_path):
    root = tmp_path / "official"
    root.mkdir()
    src = cub_release / "CUB_200_2011.tgz"
    whole = src.read_bytes()
    cut = len(whole) // 2
    (root / "CUB_200_2011.tgz.part").write_bytes(whole[:cut])
    src.write_bytes(b"\0" * cut + whole[cut:])  # only a resumed download gives the md5
    assert _run("cub", root, no_download=False)["images"] == 12


def test_nabirds_is_gated_placed_by_hand_and_md5_checked(tmp_path, monkeypatch):
    root = tmp_path / "official"
    with pytest.raises(PipelineError) as e:
        _run("nabirds", root, no_download=False)
    msg = str(e.value)
    assert "dl.allaboutbirds.org/nabirds" in msg and f"place it at {root / 'nabirds.tar.gz'}" in msg
    assert "gated" in msg and f"{root / 'data'}/images.txt" in msg
    src = make_nabirds(tmp_path / "src")
    root.mkdir()
    _tgz(src, root / "nabirds.tar.gz", "nabirds")
    with pytest.raises(PipelineError, match=r"nabirds.tar.gz: md5 .* is not the release's df21a9e4"):
        _run("nabirds", root, no_download=True)
    monkeypatch.setattr(fetch, "NABIRDS_MD5", _md5(root / "nabirds.tar.gz"))
    monkeypatch.setattr(nabirds, "OFFICIAL", {"images": 4, "labels": 3})
    rep = _run("nabirds", root, no_download=True)
    assert rep["images"] == 4 and rep["labels"] == 3 and rep["split_sizes"] == {"train": 2, "test": 2}
    assert "differ from the official" in rep["warning"] and (root / "data/images.txt").is_file()
