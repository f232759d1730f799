"""``fetch --dataset clevr_dc``: the release's four files (split.json, captions.json from the repository;
bef.tar.gz, aft.tar.gz from Drive) placed by hand or downloaded (resumable), extracted atomically, verified.

Nothing can be downloaded here: the release is a small hand-made tree in its layout (tests/test_clevr_dc.py's
``make_tree``, images of a few bytes), served from local files, the module's split checksum and sizes set to its.
"""

import argparse
import hashlib
import json
import shutil
import tarfile

import pytest

from pipeline.datasets import clevr_dc, fetch
from pipeline.errors import PipelineError
from tests.test_clevr_dc import CAPTION_OF, ONE_PER_BLOCK, make_tree

ARCHIVES = ("bef.tar.gz", "aft.tar.gz")
FILES = ("split.json", "captions.json")
SIZES = {"train": 4, "val": 1, "test": 1}  # make_tree's split of ONE_PER_BLOCK


def _run(root, no_download):
    fetch.run(argparse.Namespace(dataset="clevr_dc", root=str(root), no_download=no_download))
    return json.loads((root / "verified.json").read_text())


def _pack(folder, archive, prefix, compress=True):
    """``folder``'s files into ``archive``, under ``prefix/`` (or at its root when prefix is empty)."""
    with tarfile.open(archive, "w:gz" if compress else "w") as tar:
        for p in sorted(folder.iterdir()):
            tar.add(p, arcname=f"{prefix}/{p.name}" if prefix else p.name)
    return archive


@pytest.fixture
def release(tmp_path, monkeypatch):
    """The release under tmp/src, served from there: data/ (JSON files, bef/, aft/) and the two archives
    (bef.tar.gz holding bef/, aft.tar.gz its images at its root). One caption of the material block is a move
    caption (a type disagreement, reported)."""
    src = tmp_path / "src"
    caps = {str(i): [CAPTION_OF[clevr_dc.block_type(i)]] for i in ONE_PER_BLOCK}
    caps["8001"] = [CAPTION_OF["move"]]
    data = make_tree(src, ONE_PER_BLOCK, captions=caps)
    for d in ("bef", "aft"):  # images of 2 KB, so that a cut archive is cut inside an image
        for p in (data / d).iterdir():
            p.write_bytes(hashlib.sha256(p.name.encode()).digest() * 64)
    _pack(data / "bef", src / "bef.tar.gz", "bef")
    _pack(data / "aft", src / "aft.tar.gz", "")
    served = {"files": data.as_uri() + "/{name}",
              "archives": {n: {**fetch.RELEASES["clevr_dc"]["archives"][n], "url": (src / n).as_uri()}
                           for n in ARCHIVES}}
    monkeypatch.setitem(fetch.RELEASES, "clevr_dc", served)
    monkeypatch.setattr(clevr_dc, "OFFICIAL_SPLIT_SHA256",
                        hashlib.sha256((data / "split.json").read_bytes()).hexdigest())
    monkeypatch.setattr(clevr_dc, "OFFICIAL_SPLIT_SIZES", SIZES)
    return src


def _place(src, root, archives=ARCHIVES, files=FILES):
    (root / "data").mkdir(parents=True, exist_ok=True)
    for n in archives:
        shutil.copy(src / n, root / n)
    for n in files:
        shutil.copy(src / "data" / n, root / "data" / n)


def _assert_verified(src, root, rep):
    assert rep["dataset"] == "clevr_dc" and rep["pairs"] == 6 and rep["split_sizes"] == SIZES and "warning" not in rep
    assert rep["types"] == {t: 1 for t in clevr_dc.BLOCK_TYPES}
    assert rep["type_disagreements"] == 1
    assert rep["type_disagreement_examples"] == ["index 8001: block says 'material', captions say ['move']"]
    assert rep["captions.json"]["sha256"] == hashlib.sha256((src / "data/captions.json").read_bytes()).hexdigest()
    data = root / "data"
    assert sorted(p.name for p in data.iterdir()) == ["aft", "bef", "captions.json", "split.json"]
    for d in ("bef", "aft"):  # every image, byte for byte, where the parser reads it
        assert sorted(p.name for p in (data / d).iterdir()) == [f"{i}.png" for i in sorted(ONE_PER_BLOCK, key=str)]
        assert all((data / d / p.name).read_bytes() == p.read_bytes() for p in (src / "data" / d).iterdir())


def test_placed_archives_and_files_are_extracted_and_verified(release, tmp_path, monkeypatch):
    root = tmp_path / "official"
    _place(release, root)
    _assert_verified(release, root, _run(root, no_download=True))
    # in place now: nothing is extracted or downloaded again (the archives may go), the tree is verified again
    for n in ARCHIVES:
        (root / n).unlink()
    monkeypatch.setattr(fetch, "try_download", lambda *a, **k: pytest.fail("downloaded again"))
    _assert_verified(release, root, _run(root, no_download=False))
    # the split sizes are compared with the release's
    monkeypatch.setattr(clevr_dc, "OFFICIAL_SPLIT_SIZES", {"train": 40800, "val": 2400, "test": 4800})
    assert "differ from the official" in _run(root, no_download=True)["warning"]


@pytest.mark.parametrize("bef_holds, aft_holds", [("images", "sc_images"), ("", "aft")])
def test_the_folder_an_archive_holds_is_its_content(release, tmp_path, bef_holds, aft_holds):
    """Whatever the archives hold among the layouts the parser reads (their images under bef/ or images/,
    aft/ or sc_images/, or at their root), the images land in data/bef and data/aft."""
    _pack(release / "data/bef", release / "bef.tar.gz", bef_holds)
    _pack(release / "data/aft", release / "aft.tar.gz", aft_holds)
    root = tmp_path / "official"
    _place(release, root)
    _assert_verified(release, root, _run(root, no_download=True))


def test_downloads_resume_and_give_the_same_tree(release, tmp_path):
    """Nothing placed: all four files downloaded. Two were cut before (``.part``): the sources now serve garbage
    in place of the bytes already there, so only a download that resumes them gives the release."""
    root = tmp_path / "official"
    (root / "data").mkdir(parents=True)
    for part, source in ((root / "bef.tar.gz.part", release / "bef.tar.gz"),
                         (root / "data/split.json.part", release / "data/split.json")):
        whole = source.read_bytes()
        cut = len(whole) // 2
        part.write_bytes(whole[:cut])
        source.write_bytes(b"\0" * cut + whole[cut:])
        (tmp_path / (source.name + ".whole")).write_bytes(whole)
    _assert_verified(release, root, _run(root, no_download=False))
    assert (root / "bef.tar.gz").read_bytes() == (tmp_path / "bef.tar.gz.whole").read_bytes()
    assert (root / "aft.tar.gz").read_bytes() == (release / "aft.tar.gz").read_bytes()
    assert not list(root.rglob("*.part")) and not list(root.rglob(".*"))


def test_nothing_available_offline_is_one_message_naming_all_four_files(tmp_path):
    root = tmp_path / "official"
    with pytest.raises(PipelineError) as e:
        _run(root, no_download=True)
    msg = str(e.value)
    commit = "https://github.com/hsgkim/clevr-dc/raw/47be3211fd21a09d1062f8a3a8833d213f026c79"
    drive = "https://drive.google.com/file/d"
    for name, page, dest in (
            ("split.json", f"{commit}/split.json", root / "data/split.json"),
            ("captions.json", f"{commit}/captions.json", root / "data/captions.json"),
            ("bef.tar.gz", f"{drive}/1FeK--ilqYItdx6Fw6pLSWWNujylOovIT/view", root / "bef.tar.gz"),
            ("aft.tar.gz", f"{drive}/1csIsr8IcwrOYAe-JAWQrcb3iu5RtaTK7/view", root / "aft.tar.gz")):
        assert f"- {name}: download it from {page} and place it at {dest}" in msg, msg
    assert f"extract it so that {root / 'data/bef'}/<n>.png exist" in msg
    assert msg.startswith("cannot obtain the official clevr_dc release") and "Already in place" not in msg
    assert not root.exists()  # nothing written


def test_missing_or_refused_parts_are_named_and_nothing_is_extracted(release, tmp_path, monkeypatch):
    root = tmp_path / "official"
    _place(release, root, files=())  # the archives are there, the JSON files are not
    with pytest.raises(PipelineError) as e:
        _run(root, no_download=True)
    msg = str(e.value)
    assert "- split.json:" in msg and "- captions.json:" in msg and "- bef.tar.gz:" not in msg
    assert "Already in place: bef.tar.gz, aft.tar.gz." in msg
    assert sorted(p.name for p in root.rglob("*")) == ["aft.tar.gz", "bef.tar.gz", "data"]
    # downloads allowed, but the server answers a page instead of captions.json and of aft.tar.gz
    (root / "aft.tar.gz").unlink()
    page = tmp_path / "refused.html"
    page.write_text("<html>Google Drive: quota exceeded</html>")
    monkeypatch.setitem(fetch.RELEASES["clevr_dc"]["archives"]["aft.tar.gz"], "url", page.as_uri())
    (release / "data/captions.json").write_text("version https://git-lfs.github.com/spec/v1\n")  # an LFS pointer
    with pytest.raises(PipelineError) as e:
        _run(root, no_download=False)
    msg = str(e.value)
    assert "- captions.json:" in msg and "- aft.tar.gz:" in msg and "- split.json:" not in msg
    assert (root / "aft.tar.gz.html").is_file() and (root / "data/captions.json.html").is_file()
    assert (root / "data/split.json").is_file() and not (root / "data/captions.json").exists()
    assert not (root / "data/bef").exists() and not (root / "verified.json").exists()


@pytest.mark.parametrize("damage, message", [
    ("cut", r"aft\.tar\.gz: cannot extract"),
    ("header", r"aft\.tar\.gz: cannot extract"),
    ("foreign", r"aft\.tar\.gz: holds only the folder other/, expected aft/ or sc_images/ or the files at its root"),
])
def test_a_corrupt_archive_is_named_and_leaves_nothing_half_written(release, tmp_path, damage, message):
    root = tmp_path / "official"
    _place(release, root)
    archive = root / "aft.tar.gz"
    if damage == "cut":  # uncompressed, cut inside the last image: the first ones are written before it fails
        _pack(release / "data/aft", archive, "", compress=False)
        with tarfile.open(archive) as tar:
            last = tar.getmembers()[-1]
        archive.write_bytes(archive.read_bytes()[: last.offset_data + 100])
    elif damage == "header":
        archive.write_bytes(b"\x1f\x8b\x08\x00broken")
    else:
        _pack(release / "data/aft", archive, "other")
    for _ in range(2):  # one try after another: nothing accumulates
        with pytest.raises(PipelineError, match=message):
            _run(root, no_download=True)
        assert sorted(p.name for p in (root / "data").iterdir()) == ["bef", "captions.json", "split.json"]
        assert not (root / "verified.json").exists()
    shutil.copy(release / "aft.tar.gz", archive)  # the good archive: done
    _assert_verified(release, root, _run(root, no_download=True))


def test_a_split_file_with_another_checksum_is_named(release, tmp_path, monkeypatch):
    """The release's digest (reference/datasets.md §2), against the fixture's split.json."""
    monkeypatch.setattr(clevr_dc, "OFFICIAL_SPLIT_SHA256",
                        "a2631aa629678454971503429519807616336b9b22e5eeb755fa24fe22202f9e")
    root = tmp_path / "official"
    with pytest.raises(PipelineError, match=r"checksum mismatch for .*/split\.json"):  # downloaded: refused
        _run(root, no_download=False)
    assert not list((root / "data").iterdir()) and not (root / "verified.json").exists()
    _place(release, root)  # placed by hand: the parser refuses it
    with pytest.raises(PipelineError, match=r"data/split\.json: sha256 [0-9a-f]{64} is not the released split\.json"):
        _run(root, no_download=True)
    assert not (root / "verified.json").exists()
