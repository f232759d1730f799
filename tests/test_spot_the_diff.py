"""Spot-the-Diff parser and the ``inspect`` stage on small hand-made trees."""

import json
import subprocess
import sys

import pytest

from pipeline.datasets import spot_the_diff as sd
from pipeline.datasets.inspect_tree import inspect_tree
from pipeline.errors import PipelineError

ANNOTATIONS = {
    "train": [
        {"img_id": "256", "sentences": ["person with umbrella is gone", "car up at top to left is now missing"]},
        {"img_id": "12", "sentences": ["the white car is no longer in the parking lot", ""]},
        {"img_id": "256", "sentences": ["the person with the umbrella left"]},  # a second annotator
        {"img_id": "40", "sentences": ["there is a person walking in the after image"]},
        {"img_id": "256", "sentences": ["   "]},  # a third, empty
    ],
    "val": [{"img_id": "7", "sentences": ["black car missing from bottom left corner"]},
            {"img_id": "9", "sentences": ["", ""]}],  # nothing left: the pair is left out
    "test": [{"img_id": "300", "sentences": ["a red car drove in", "the bag is gone"]},
             {"img_id": "300", "sentences": ["the red car is new"]}],
}


def make_tree(root, annotations=ANNOTATIONS, jpg=(), skip=()):
    data = root / "data"
    (data / "annotations").mkdir(parents=True)
    (data / "resized_images").mkdir()
    for split, entries in annotations.items():
        (data / "annotations" / f"{split}.json").write_text(json.dumps(entries))
        for e in entries:
            for stem in (e["img_id"], e["img_id"] + "_2"):
                name = stem + (".jpg" if stem in jpg else ".png")
                if stem not in skip:
                    (data / "resized_images" / name).write_bytes(b"img")
    return data


def test_duplicates_merged_empty_sentences_dropped(tmp_path):
    data = make_tree(tmp_path, jpg={"40_2"})
    warnings = []
    recs = sd.parse(data, source="synthetic", warnings=warnings)
    by_id = {r["pair_id"]: r for r in recs}
    assert [(r["split"], r["pair_id"]) for r in recs] == [("train", "12"), ("train", "40"), ("train", "256"),
                                                         ("val", "7"), ("test", "300")]
    assert by_id["256"]["captions"] == ["person with umbrella is gone", "car up at top to left is now missing",
                                        "the person with the umbrella left"]
    assert by_id["12"]["captions"] == ["the white car is no longer in the parking lot"]
    assert by_id["300"]["captions"] == ["a red car drove in", "the bag is gone", "the red car is new"]
    assert by_id["256"]["before"] == "resized_images/256.png" and by_id["256"]["after"] == "resized_images/256_2.png"
    assert by_id["40"]["after"] == "resized_images/40_2.jpg"  # either extension
    assert {r["change_type"] for r in recs} == {sd.CHANGE} and by_id["256"]["index"] == 256
    assert len(warnings) == 3
    assert "train.json: 2 empty sentence(s) dropped (img_id 12, 256)" in warnings[0]
    assert "val.json: 2 empty sentence(s) dropped" in warnings[1]
    assert "val.json: 1 img_id(s) left out, no sentence with a word: 9" in warnings[2]


def test_without_a_warning_list_the_drops_are_printed_once(tmp_path, capsys):
    sd.parse(make_tree(tmp_path), source="synthetic")
    out = capsys.readouterr().out
    assert out.count("Spot-the-Diff:") == 3 and "2 empty sentence(s) dropped" in out


def test_inspect_counts_entries_pairs_sentences_and_empty_ones(tmp_path):
    make_tree(tmp_path)
    report = inspect_tree("spot_the_diff", tmp_path, source="synthetic")
    tr, va, te = (report["splits"][s] for s in ("train", "val", "test"))
    assert (tr["entries"], tr["distinct_pairs"], tr["sentences"], tr["empty_sentences"]) == (5, 3, 7, 2)
    assert (va["entries"], va["distinct_pairs"], va["sentences"], va["empty_sentences"]) == (2, 2, 3, 2)
    assert (te["entries"], te["distinct_pairs"], te["sentences"], te["empty_sentences"]) == (2, 1, 3, 0)
    assert tr["duplicate_ids"] == 1 and va["pairs_without_sentences"] == 1
    assert (tr["pairs"], va["pairs"], te["pairs"]) == (3, 1, 1)  # manifest records
    assert tr["types"] == {"change": 3} and report["n_warnings"] == 3


def test_missing_after_image_names_the_file(tmp_path):
    data = make_tree(tmp_path, skip={"40_2"})
    with pytest.raises(PipelineError, match=r"resized_images/40_2\.png \(nor \.jpg\), img_id 40 of .*train\.json"):
        sd.parse(data, source="synthetic")
    assert len(sd.parse(data, source="synthetic", check_images=False)) == 5


@pytest.mark.parametrize("split, text, match", [
    ("val", "[{not json", r"annotations/val\.json: not valid JSON"),
    ("train", json.dumps({"img_id": "1"}), r"annotations/train\.json: expected a JSON list"),
    ("test", json.dumps([{"img_id": "300"}]), r"annotations/test\.json: entry 0 is not an object"),
    ("test", json.dumps([{"img_id": "a1", "sentences": []}]), r"test\.json: entry 0: img_id 'a1' is not"),
    ("test", json.dumps([{"img_id": "3", "sentences": "x"}]), r"test\.json: entry 0 \(img_id 3\): 'sentences'"),
    ("test", json.dumps([{"img_id": "12", "sentences": ["x"]}]), r"test\.json: img_id 12 is also in .*train\.json"),
])
def test_bad_annotation_file_gives_one_error_naming_it(tmp_path, split, text, match):
    data = make_tree(tmp_path)
    (data / "annotations" / f"{split}.json").write_text(text)
    with pytest.raises(PipelineError, match=match):
        sd.parse(data, source="synthetic", check_images=False)
    p = subprocess.run([sys.executable, "-m", "pipeline", "inspect", "spot_the_diff", "--root", str(tmp_path),
                        "--source", "synthetic"], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.count("error:") == 1 and f"{split}.json" in p.stderr and not p.stdout


def test_missing_annotation_file_and_official_checksum(tmp_path):
    data = make_tree(tmp_path)
    p = subprocess.run([sys.executable, "-m", "pipeline", "inspect", "spot_the_diff", "--root", str(tmp_path)],
                       capture_output=True, text=True)  # no SYNTHETIC.json: official, checksums checked
    assert p.returncode == 2 and "train.json: sha256" in p.stderr and "not the released train.json" in p.stderr
    assert "bytes, the release's 1327514)" in p.stderr
    (data / "annotations" / "test.json").unlink()
    with pytest.raises(PipelineError, match=r"annotation file missing: .*annotations/test\.json"):
        sd.parse(data, source="synthetic")


def test_official_constants_agree_with_the_reference():
    # reference/datasets.md §3: 12,562 entries over 11,329 distinct ids; 23,027 non-empty sentences, 66 empty
    c = sd.OFFICIAL_COUNTS
    assert sum(v["entries"] for v in c.values()) == 12562
    assert sum(v["distinct_pairs"] for v in c.values()) == 11329
    assert sum(v["sentences"] - v["empty_sentences"] for v in c.values()) == 23027
    assert sum(v["empty_sentences"] for v in c.values()) == 66
    assert all(len(h) == 64 and int(h, 16) >= 0 for h in sd.OFFICIAL_SHA256.values())


def test_counts_of_files_shaped_like_the_release(tmp_path):
    """Annotation files with the release's shape (its entries, distinct ids, sentences and empty sentences per
    split) give its counts: what ``inspect`` must print on the real files (which cannot be fetched here)."""
    annotations, next_id = {}, 0
    for split, c in sd.OFFICIAL_COUNTS.items():
        ids = [str(next_id + k) for k in range(c["distinct_pairs"])]
        next_id += c["distinct_pairs"] + 100
        entry_ids = ids + [ids[k % len(ids)] for k in range(c["entries"] - len(ids))]
        n_sent = [1] * c["entries"]
        for k in range(c["sentences"] - c["entries"]):
            n_sent[k % c["entries"]] += 1
        sents = iter([""] * c["empty_sentences"] + ["a car is gone"] * (c["sentences"] - c["empty_sentences"]))
        annotations[split] = [{"img_id": i, "sentences": [next(sents) for _ in range(n)]}
                              for i, n in zip(entry_ids, n_sent)]
    make_tree(tmp_path, annotations)
    out = subprocess.run([sys.executable, "-m", "pipeline", "inspect", "spot_the_diff", "--root", str(tmp_path),
                          "--source", "synthetic", "--no-images"], capture_output=True, text=True, check=True).stdout
    report = json.loads(out)
    for split, c in sd.OFFICIAL_COUNTS.items():
        assert {k: report["splits"][split][k] for k in c} == c


# ---------------------------------------------------------------------------------------------------- fetch
def _release(tmp_path, monkeypatch, zip_prefix="resized_images/"):
    """The release served from local files: annotation files and a zip of the images, the module's
    checksums and counts set to theirs."""
    import hashlib
    import zipfile

    from pipeline.datasets import fetch

    src = make_tree(tmp_path / "src")
    with zipfile.ZipFile(tmp_path / "src" / "resized_images.zip", "w") as zf:
        for p in sorted((src / "resized_images").iterdir()):
            zf.write(p, zip_prefix + p.name)
    zip_release = fetch.RELEASES["spot_the_diff"]["archives"]["resized_images.zip"]
    monkeypatch.setitem(fetch.RELEASES, "spot_the_diff", {
        "files": (src / "annotations").as_uri() + "/{name}",
        "archives": {"resized_images.zip": {**zip_release, "url": (tmp_path / "src" / "resized_images.zip").as_uri()}}})
    monkeypatch.setattr(sd, "OFFICIAL_SHA256", {s: hashlib.sha256(sd.annotation_path(src, s).read_bytes()).hexdigest()
                                                for s in sd.SPLITS})
    monkeypatch.setattr(sd, "OFFICIAL_COUNTS", {s: {k: c[k] for k in ("entries", "distinct_pairs", "sentences",
                                                                      "empty_sentences")}
                                                for s, c in sd.source_counts(src, "synthetic").items()})
    return fetch


@pytest.mark.parametrize("zip_prefix", ["resized_images/", ""])
def test_fetch_downloads_checks_extracts_and_verifies(tmp_path, monkeypatch, zip_prefix):
    import argparse

    fetch = _release(tmp_path, monkeypatch, zip_prefix)
    root = tmp_path / "official"
    fetch.run(argparse.Namespace(dataset="spot_the_diff", root=str(root), no_download=False))
    rep = json.loads((root / "verified.json").read_text())
    assert rep["pairs"] == 5 and "warning" not in rep and rep["counts"]["train"]["entries"] == 5
    assert (root / "data" / "resized_images" / "256_2.png").is_file()
    assert sorted(p.name for p in (root / "data").iterdir()) == ["annotations", "resized_images"]
    fetch.run(argparse.Namespace(dataset="spot_the_diff", root=str(root), no_download=True))  # in place: verify


def test_fetch_rejects_an_annotation_file_with_another_checksum(tmp_path, monkeypatch):
    import argparse

    fetch = _release(tmp_path, monkeypatch)
    monkeypatch.setattr(sd, "OFFICIAL_SHA256", {**sd.OFFICIAL_SHA256, "val": "0" * 64})
    root = tmp_path / "official"
    with pytest.raises(PipelineError, match=r"checksum mismatch for .*val\.json"):
        fetch.run(argparse.Namespace(dataset="spot_the_diff", root=str(root), no_download=False))
    assert not sd.annotation_path(root / "data", "val").exists() and not (root / "verified.json").exists()


def test_fetch_offline_or_refused_says_what_to_place_where(tmp_path, monkeypatch):
    import argparse

    fetch = _release(tmp_path, monkeypatch)
    root = tmp_path / "official"
    with pytest.raises(PipelineError) as e:
        fetch.run(argparse.Namespace(dataset="spot_the_diff", root=str(root), no_download=True))
    msg = str(e.value)
    for s in sd.SPLITS:  # each annotation file: where it comes from, where it goes
        assert f"{s}.json: download it from {fetch.RELEASES['spot_the_diff']['files'].format(name=f'{s}.json')} " \
               f"and place it at {sd.annotation_path(root / 'data', s)}" in msg
    assert "resized_images.zip" in msg and "drive.google.com/file/d/1OVb4_3Uec_xbyUk90aWC6LFpKsIOtR7v" in msg
    # annotations come, but Drive answers an HTML page instead of the archive
    page = tmp_path / "refused.html"
    page.write_text("<html>quota exceeded</html>")
    monkeypatch.setitem(fetch.RELEASES["spot_the_diff"]["archives"]["resized_images.zip"], "url", page.as_uri())
    with pytest.raises(PipelineError, match="cannot obtain the official spot_the_diff release"):
        fetch.run(argparse.Namespace(dataset="spot_the_diff", root=str(root), no_download=False))
    assert (root / "resized_images.zip.html").is_file() and not (root / "data" / "resized_images").exists()
    assert all(sd.annotation_path(root / "data", s).is_file() for s in sd.SPLITS)
