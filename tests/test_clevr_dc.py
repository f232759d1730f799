"""CLEVR-DC parser and the ``inspect`` stage on small hand-made trees (and the release's real split.json)."""

import hashlib
import json
import subprocess
import sys

import pytest

from pipeline.datasets import clevr_dc
from pipeline.datasets.inspect_tree import inspect_tree
from pipeline.errors import PipelineError

CAPTION_OF = {
    "color": "the other large red object that is the same shape as the brown metal object became blue",
    "material": "the other large cylinder the same color as the large matte cylinder turned rubber",
    "add": "the other gray object that is the same size as the cyan object has been newly placed",
    "drop": "the brown shiny ball is no longer there",
    "move": "the small brown object is in a different location",
    "no_change": "there is no change",
}


def make_tree(root, indices, padded=(), captions=None, split=None, dirs=("bef", "aft")):
    data = root / "data"
    for d in dirs:
        (data / d).mkdir(parents=True)
    for i in indices:
        name = f"{i:06d}.png" if i in padded else f"{i}.png"
        for d in dirs:
            (data / d / name).write_bytes(b"png")
    caps = captions or {str(i): [CAPTION_OF[clevr_dc.block_type(i)], "x " + CAPTION_OF[clevr_dc.block_type(i)]]
                        for i in indices}
    split = split or {"train": indices[:-2], "val": indices[-2:-1], "test": indices[-1:]}
    (data / "captions.json").write_text(json.dumps(caps))
    (data / "split.json").write_text(json.dumps(split))
    return data


ONE_PER_BLOCK = [5, 8001, 16002, 24003, 32004, 40005]


def test_caption_type_reads_the_predicate_not_the_referring_expression():
    for kind, cap in CAPTION_OF.items():
        assert clevr_dc.caption_type(cap) == kind, cap
    assert clevr_dc.caption_type("the red sphere is missing") == "drop"
    assert clevr_dc.caption_type("the big cube changed to shiny") == "material"
    assert clevr_dc.caption_type("the big cube") is None


def test_parse_types_from_blocks_and_both_name_spellings(tmp_path):
    data = make_tree(tmp_path, ONE_PER_BLOCK, padded={8001})
    recs = clevr_dc.parse(data, source="synthetic")
    assert [r["change_type"] for r in recs] == ["color", "material", "add", "drop", "move", "no_change"]
    by_idx = {r["index"]: r for r in recs}
    assert by_idx[5]["before"] == "bef/5.png" and by_idx[5]["after"] == "aft/5.png"
    assert by_idx[8001]["before"] == "bef/008001.png"  # DIRL's padded rename
    assert by_idx[40005]["pair_id"] == "040005.png" and by_idx[40005]["split"] == "test"
    assert {r["split"] for r in recs} == {"train", "val", "test"}


def test_missing_image_names_the_file(tmp_path):
    data = make_tree(tmp_path, ONE_PER_BLOCK)
    (data / "aft" / "16002.png").unlink()
    with pytest.raises(PipelineError, match=r"aft/16002\.png"):
        clevr_dc.parse(data, source="synthetic")
    assert len(clevr_dc.parse(data, source="synthetic", check_images=False)) == 6


def test_caption_type_mismatch_is_reported_not_fatal(tmp_path, capsys):
    caps = {str(i): [CAPTION_OF[clevr_dc.block_type(i)]] for i in ONE_PER_BLOCK}
    caps["8001"] = ["the small brown object is in a different location"]  # a move caption in the material block
    data = make_tree(tmp_path, ONE_PER_BLOCK, captions=caps)
    warnings = []
    recs = clevr_dc.parse(data, source="synthetic", warnings=warnings)
    assert warnings == ["index 8001: block says 'material', captions say ['move']"]
    assert {r["index"]: r["change_type"] for r in recs}[8001] == "material"
    clevr_dc.parse(data, source="synthetic")
    assert "1 pair(s) whose captions disagree" in capsys.readouterr().out


@pytest.mark.parametrize("bad, match", [
    ("{not json", r"split\.json"),
    (json.dumps({"train": [5], "val": [8001]}), r"split\.json: missing split\(s\) \['test'\]"),
    (json.dumps({"train": [5, 8001], "val": [8001], "test": []}), r"split\.json: index 8001 is in both"),
    (json.dumps({"train": [5, 48000], "val": [], "test": []}), r"split\.json: index 48000 is outside"),
    (json.dumps({"train": ["5"], "val": [], "test": []}), r"split\.json: non-integer index"),
])
def test_bad_split_file_gives_one_error_naming_it(tmp_path, bad, match):
    data = make_tree(tmp_path, ONE_PER_BLOCK)
    (data / "split.json").write_text(bad)
    with pytest.raises(PipelineError, match=match):
        clevr_dc.parse(data, source="synthetic")


def test_empty_caption_is_an_error_for_the_manifest_and_a_count_for_inspect(tmp_path):
    caps = {str(i): [CAPTION_OF[clevr_dc.block_type(i)]] for i in ONE_PER_BLOCK}
    caps["5"] = [" ...", CAPTION_OF["color"], CAPTION_OF["color"].upper()]
    data = make_tree(tmp_path, ONE_PER_BLOCK, captions=caps)
    with pytest.raises(PipelineError, match=r"captions\.json: index 5: caption .* has no word"):
        clevr_dc.parse(data, source="synthetic")
    report = inspect_tree("clevr_dc", tmp_path, source="synthetic")
    assert report["splits"]["train"]["empty_captions"] == 1
    assert report["splits"]["train"]["duplicate_captions"] == 1  # case is ignored
    assert report["n_warnings"] == 1


def test_official_split_is_the_release_file_byte_for_byte():
    text = json.dumps(clevr_dc.official_split())
    assert len(text) == 324920  # the size reference/datasets.md §2 gives
    assert hashlib.sha256(text.encode()).hexdigest() == clevr_dc.OFFICIAL_SPLIT_SHA256


def test_inspect_on_the_real_split_reports_the_published_counts(tmp_path):
    data = tmp_path / "data"
    for d in ("images", "sc_images"):
        (data / d).mkdir(parents=True)
    (data / "split.json").write_text(json.dumps(clevr_dc.official_split()))
    (data / "captions.json").write_text(json.dumps(
        {str(i): [CAPTION_OF[clevr_dc.block_type(i)]] for i in range(48000)}))
    out = subprocess.run([sys.executable, "-m", "pipeline", "inspect", "clevr_dc", "--root", str(tmp_path),
                          "--no-images"], capture_output=True, text=True, check=True).stdout
    report = json.loads(out)
    assert report["source"] == "official"  # no SYNTHETIC.json: the release's checksum was checked
    assert {s: report["splits"][s]["pairs"] for s in ("train", "val", "test")} == clevr_dc.OFFICIAL_SPLIT_SIZES
    per_type = {}
    for s in report["splits"].values():
        for t, n in s["types"].items():
            per_type[t] = per_type.get(t, 0) + n
    assert per_type == {t: 8000 for t in clevr_dc.BLOCK_TYPES}
    assert report["n_warnings"] == 0


def test_official_source_checks_the_split_checksum(tmp_path):
    data = make_tree(tmp_path, ONE_PER_BLOCK)
    with pytest.raises(PipelineError, match=r"split\.json: sha256 .* is not the released"):
        clevr_dc.parse(data, source="official")
    p = subprocess.run([sys.executable, "-m", "pipeline", "inspect", "clevr_dc", "--root", str(tmp_path)],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "is not the released split.json" in p.stderr and not p.stdout
