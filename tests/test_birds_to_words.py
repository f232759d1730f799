"""Birds-to-Words: the parser and ``inspect`` on a small hand-made TSV, and ``fetch --dataset birds_to_words``
served from local files (nothing can be downloaded here): the TSV, then every photo, resumable, the photos that
cannot be had listed and their pairs counted as lost."""

import argparse
import json

import pytest

from pipeline.datasets import birds_to_words as b2w
from pipeline.datasets import fetch
from pipeline.datasets.inspect_tree import inspect_tree
from pipeline.errors import PipelineError

U1 = "https://static.inaturalist.org/photos/1111/medium.jpg?1530000000"
U2 = "https://static.inaturalist.org/photos/2222/medium.JPEG?1530000001"
U3 = "https://example.org/some/bird.png"
OBS = "https://www.inaturalist.org/observations/9"
# (url1, url2, split, annN, description): rows of one pair need not be adjacent nor in annN order
ROWS = [
    (U1, U2, "train", 2, "animal1 has a   red crown , animal2 has a blue one ."),
    (U1, U3, "val", 1, "Animal 2 is larger than animal 1 ."),
    (U1, U2, "train", 1, "animal2 's beak is longer ."),
    (U1, U2, "train", 3, "both have white eye rings ."),
    (U2, U3, "test", 1, "animal1 has a streaked breast ."),
]


def tsv_text(rows=ROWS, header=b2w.COLUMNS):
    lines = ["\t".join(header)]
    for u1, u2, split, n, d in rows:
        lines.append("\t".join([OBS, u1, "Sp one", "base", OBS, u2, "Sp two", "sameGenus", split, str(n), d]))
    return "\n".join(lines) + "\n"


def make_tree(root, rows=ROWS, skip=()):
    data = root / "data"
    (data / b2w.IMAGES).mkdir(parents=True)
    (data / b2w.TSV).write_text(tsv_text(rows))
    for u in {r[k] for r in rows for k in (0, 1)}:
        if u not in skip:
            (data / b2w.IMAGES / b2w.local_name(u)).write_bytes(b"\xff\xd8" + u.encode() * 40)
    return data


def test_local_names_are_a_function_of_the_url():
    assert b2w.local_name(U1) == "1111.jpg" and b2w.local_name(U2) == "2222.jpeg"
    assert b2w.local_name(U3).startswith("url-") and b2w.local_name(U3).endswith(".png")
    assert b2w.local_name(U3) == b2w.local_name(U3) and len(b2w.local_name(U3)) == len("url-") + 16 + 4


def test_rows_are_grouped_into_pairs_with_their_descriptions_in_annotation_order(tmp_path):
    recs = b2w.parse(make_tree(tmp_path), source="synthetic", generator_seed=3)
    assert [(r["pair_id"], r["split"], r["index"]) for r in recs] == [
        ("1111_2222", "train", 0), (f"1111_{b2w.local_name(U3)[:-4]}", "val", 1),
        (f"2222_{b2w.local_name(U3)[:-4]}", "test", 2)]
    first = recs[0]
    assert first["captions"] == ["animal2 's beak is longer .", "animal1 has a red crown , animal2 has a blue one .",
                                 "both have white eye rings ."]
    assert recs[1]["captions"] == ["animal2 is larger than animal1 ."]  # "Animal 2" / "animal 1" normalised
    assert first["before"] == "images/1111.jpg" and first["after"] == "images/2222.jpeg"
    assert {r["change_type"] for r in recs} == {b2w.CHANGE}
    assert first["labels"] == {"species": ["Sp one", "Sp two"], "selection": ["base", "sameGenus"]}
    assert first["generator_seed"] == 3 and first["source"] == "synthetic"


def test_a_missing_photo_is_named_or_reported(tmp_path):
    data = make_tree(tmp_path, skip=(U3,))
    with pytest.raises(PipelineError, match=rf"photo missing: .*{b2w.local_name(U3)} \({U3}, line 3 of .*tsv\)"):
        b2w.parse(data, source="synthetic")
    warnings = []
    recs = b2w.parse(data, source="synthetic", warnings=warnings)
    assert [r["pair_id"] for r in recs] == ["1111_2222"] and len(warnings) == 2
    assert all("pair left out" in w for w in warnings)
    assert len(b2w.parse(data, source="synthetic", check_images=False)) == 3
    # listed by the fetcher as unobtainable: left out, one line
    (data / b2w.MISSING).write_text(json.dumps({U3: b2w.local_name(U3)}))
    warnings = []
    assert len(b2w.parse(data, source="synthetic", warnings=warnings)) == 1
    assert warnings == [f"2 pair(s) left out: a photo the fetcher could not get ({data / b2w.MISSING})"]
    assert len(b2w.parse(data, source="synthetic")) == 1  # no error either: the loss is the fetcher's record
    report = inspect_tree("birds_to_words", tmp_path)
    assert report["splits"]["train"]["pairs"] == 1 and report["splits"]["val"]["pairs_missing_a_photo"] == 1
    assert report["splits"]["train"]["rows"] == 3 and report["splits"]["test"]["distinct_photos"] == 2


@pytest.mark.parametrize("mutate, message", [
    (lambda t: t.replace("img2ImgURL", "imageTwo"), r"header row lacks column\(s\) img2ImgURL"),
    (lambda t: t.replace("\ttrain\t", "\tdev\t", 1), r"line 2: split 'dev' is not one of train, val, test"),
    (lambda t: t.replace("\tval\t1\t", "\tval\tone\t"), r"line 3: annN 'one' is not a number"),
    (lambda t: t.rstrip("\n").rsplit("\t", 1)[0] + "\n", r"line 6 has 10 fields, the header 11"),
    (lambda t: t.replace("\ttrain\t", "\ttest\t", 1),
     r"line 4: pair \(.*1111.*, .*2222.*\) is in split 'train' here and 'test' on line 2"),
    (lambda t: "", r"empty file"),
])
def test_bad_input_is_one_clear_error_naming_the_file(tmp_path, mutate, message):
    data = make_tree(tmp_path)
    (data / b2w.TSV).write_text(mutate(tsv_text()))
    with pytest.raises(PipelineError, match=message) as e:
        b2w.parse(data, source="synthetic")
    assert str(data / b2w.TSV) in str(e.value)


def test_a_description_without_a_word(tmp_path):
    rows = ROWS + [(U2, U3, "test", 2, " . ")]
    data = make_tree(tmp_path, rows)
    with pytest.raises(PipelineError, match=r"tsv: line 7: a description without a word"):
        b2w.parse(data, source="synthetic")
    warnings = []
    recs = b2w.parse(data, source="synthetic", warnings=warnings)
    assert recs[2]["captions"] == ["animal1 has a streaked breast ."] and "1 description(s) without a word" in warnings[0]
    data = make_tree(tmp_path / "b", [(U1, U2, "train", 1, "..."), (U1, U3, "train", 1, "ok .")])
    with pytest.raises(PipelineError, match="has no description with a word"):
        b2w.parse(data, source="synthetic", warnings=[])
    (tmp_path / "empty").mkdir()
    with pytest.raises(PipelineError, match=r"TSV missing: .*empty/birds-to-words-v1.0.tsv"):
        b2w.parse(tmp_path / "empty", source="synthetic")


# ------------------------------------------------------------------------------------------------ fetch
@pytest.fixture
def served(tmp_path, monkeypatch):
    """The release under tmp/src: the TSV and the photos, as file:// URLs; the open-data bucket under
    tmp/bucket (empty unless a test fills it)."""
    src = tmp_path / "src"
    photos = src / "photos"
    rows = []
    urls = {}
    for pid in (1111, 2222, 3333):
        (photos / str(pid)).mkdir(parents=True)
        p = photos / str(pid) / "medium.jpg"
        p.write_bytes(b"\xff\xd8" + bytes([pid % 251]) * 3000)
        urls[pid] = p.as_uri() + "?17"
    rows = [(urls[1111], urls[2222], "train", 1, "animal1 is larger ."), (urls[1111], urls[3333], "val", 1, "same .")]
    (src / b2w.TSV).write_text(tsv_text(rows))
    monkeypatch.setitem(fetch.RELEASES, "birds_to_words", {"files": src.as_uri() + "/{name}"})
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    monkeypatch.setattr(fetch, "INAT_OPEN_DATA", bucket.as_uri() + "/{id}.{ext}")
    return src, urls, bucket


def _run(root, no_download=False):
    fetch.run(argparse.Namespace(dataset="birds_to_words", root=str(root), no_download=no_download))
    return json.loads((root / "verified.json").read_text())


def test_fetch_gets_every_photo_and_reports_the_lost_pairs(served, tmp_path):
    src, urls, bucket = served
    (src / "photos/3333/medium.jpg").unlink()  # rotted at its URL ...
    root = tmp_path / "official"
    rep = _run(root)
    assert rep["photos"] == 3 and rep["missing_photos"] == 1 and rep["pairs"] == 1
    assert rep["counts"]["val"]["pairs_lost"] == 1 and rep["counts"]["train"]["pairs_lost"] == 0
    assert "1 pair(s) lost" in rep["warning"]
    assert json.loads((root / "data" / b2w.MISSING).read_text()) == {urls[3333]: "3333.jpg"}
    assert (root / "data/images/1111.jpg").read_bytes() == (src / "photos/1111/medium.jpg").read_bytes()
    # ... but in the open-data bucket: the next fetch gets it there, nothing is lost any more
    (bucket / "3333.jpg").write_bytes(b"\xff\xd8" + b"x" * 100)
    rep = _run(root)
    assert rep["missing_photos"] == 0 and rep["pairs"] == 2 and "warning" not in rep


def test_photo_downloads_resume_and_refusal_pages_are_kept_aside(served, tmp_path):
    src, urls, bucket = served
    root = tmp_path / "official"
    images = root / "data/images"
    images.mkdir(parents=True)
    whole = (src / "photos/2222/medium.jpg").read_bytes()
    (images / "2222.jpg.part").write_bytes(whole[:1000])  # a cut download: the source now serves garbage there
    (src / "photos/2222/medium.jpg").write_bytes(b"\0" * 1000 + whole[1000:])
    (src / "photos/3333/medium.jpg").write_bytes(b"<html>quota exceeded</html>")
    rep = _run(root)
    assert (images / "2222.jpg").read_bytes() == whole
    assert (images / "3333.jpg.html").exists() and not (images / "3333.jpg").exists()
    assert rep["missing_photos"] == 1
    assert _run(root, no_download=True)["missing_photos"] == 1  # offline: what is there is used
    for p in images.iterdir():
        p.unlink()
    with pytest.raises(PipelineError, match=r"no Birds-to-Words pair has both its photos \(3 photos could not be had"):
        _run(root, no_download=True)


def test_fetch_without_the_tsv_says_what_to_place_where(served, tmp_path):
    root = tmp_path / "official"
    with pytest.raises(PipelineError, match=rf"place it at {root / 'data' / b2w.TSV}"):
        _run(root, no_download=True)
