"""The synthetic CLEVR-DC world: the release's layout, drastic camera moves, viewpoint-free captions that
state their block's change, determinism and resumption."""

import json

import numpy as np
import pytest

from pipeline.datasets import clevr_dc as parser
from pipeline.synth import captions as cap
from pipeline.synth import clevr_dc as world
from pipeline.synth.scene import SceneObject, default_view

PER_BLOCK, W, H = 20, 96, 64


@pytest.fixture(scope="module")
def dc(tmp_path_factory):
    out = tmp_path_factory.mktemp("dc") / "synthetic"
    assert world.generate(out, per_block=PER_BLOCK, seed=0, width=W, height=H, progress=False)
    return out


def test_layout_is_the_release_and_the_parser_reads_it_without_warnings(dc):
    data = dc / "data"
    names = sorted(p.name for p in (data / "images").iterdir())
    assert "8001.png" in names and "008001.png" not in names  # unpadded, as released
    assert sorted(p.name for p in (data / "sc_images").iterdir()) == names
    split = json.loads((data / "split.json").read_text())
    assert {s: len(v) for s, v in split.items()} == {"train": 102, "val": 6, "test": 12}
    assert split["train"][:3] == [0, 1, 2] and split["val"][0] == 17 and split["test"][-1] == 40019  # blockwise
    warnings = []
    recs = parser.parse(data, source="synthetic", warnings=warnings)
    assert warnings == [] and len(recs) == 6 * PER_BLOCK
    assert {t: sum(r["change_type"] == t for r in recs) for t in parser.BLOCK_TYPES} == dict.fromkeys(
        parser.BLOCK_TYPES, PER_BLOCK)


def test_every_caption_states_its_block_and_has_no_viewpoint_word(dc):
    caps = json.loads((dc / "data" / "captions.json").read_text())
    viewpoint = {"left", "right", "behind", "front"}
    for key, cs in caps.items():
        assert len(cs) >= 3, key
        for c in cs:
            assert parser.caption_type(c) == parser.block_type(int(key)), (key, c)
            assert not viewpoint & set(c.split()), c
            assert set(c.split()) <= cap.dc_generator_words() <= set(cap.POS_LEXICON), c
    compared = sum("same" in c and "as" in c.split() for cs in caps.values() for c in cs)
    assert compared > len(caps)  # comparison references are the common form, as in CLEVR-DC


def test_after_camera_moves_drastically_and_the_change_is_real(dc):
    scenes = [json.loads(line) for line in (dc / "scenes.jsonl").read_text().splitlines()]
    base = default_view().orbit
    for s in scenes:
        cam_b, cam_a = s["views"]["before"]["camera"], s["views"]["after"]["camera"]
        assert (cam_b["azimuth_deg"], cam_b["elevation_deg"], cam_b["distance"]) == pytest.approx(base)
        d_az = abs(cam_a["azimuth_deg"] - cam_b["azimuth_deg"])
        assert 30.0 <= d_az <= 90.0
        assert -8.0 <= cam_a["elevation_deg"] - cam_b["elevation_deg"] <= 12.0
        assert 0.9 <= cam_a["distance"] / cam_b["distance"] <= 1.25
        if s["change_type"] == "no_change":
            assert s["after"] == s["before"] and s["change"] is None
        else:
            assert s["after"] != s["before"] and s["change"]["type"] == s["change_type"]


def test_same_seed_same_pixels_any_worker_count_and_after_a_resume(dc, tmp_path):
    meta = json.loads((dc / "SYNTHETIC.json").read_text())
    two = tmp_path / "two"
    assert world.generate(two, per_block=PER_BLOCK, seed=0, width=W, height=H, workers=2, progress=False)
    assert json.loads((two / "SYNTHETIC.json").read_text())["pixel_sha256"] == meta["pixel_sha256"]
    cut = tmp_path / "cut"
    assert world.generate(cut, per_block=PER_BLOCK, seed=0, width=W, height=H, progress=False,
                          max_new_indices=7) is False
    assert not cut.exists() and len(list((tmp_path / "cut.partial" / "meta").iterdir())) == 7
    (tmp_path / "cut.partial" / "data" / "sc_images" / ".9.png.k1ll3d_9.tmp").write_bytes(b"half a png")
    assert world.generate(cut, per_block=PER_BLOCK, seed=0, width=W, height=H, progress=False)
    assert (cut / "data" / "captions.json").read_bytes() == (dc / "data" / "captions.json").read_bytes()
    assert json.loads((cut / "SYNTHETIC.json").read_text())["pixel_sha256"] == meta["pixel_sha256"]
    assert not (tmp_path / "cut.partial").exists() and not list(cut.rglob(".*.tmp"))
    other = tmp_path / "seed1"
    assert world.generate(other, per_block=PER_BLOCK, seed=1, width=W, height=H, progress=False)
    assert json.loads((other / "SYNTHETIC.json").read_text())["pixel_sha256"] != meta["pixel_sha256"]


def test_same_as_references_denote_exactly_their_target():
    objs = [SceneObject("cube", "large", "rubber", "red", 0, 0), SceneObject("sphere", "large", "rubber", "red", 1, 0),
            SceneObject("sphere", "small", "metal", "blue", 2, 0), SceneObject("cube", "small", "metal", "red", 3, 0)]
    # object 1, the large red rubber sphere: "the other object that is the same shape as the blue object"
    refs = cap.same_as_references(objs, 1)
    assert refs and all(len(r.attrs) == len(refs[0].attrs) for r in refs)
    for r in refs:
        denoted = [c for c in cap.matching(objs, objs[1], r.attrs)
                   if c != r.ref and getattr(objs[c], r.same) == getattr(objs[r.ref], r.same)]
        assert denoted == [1] and cap.matching(objs, objs[r.ref], r.ref_attrs) == [r.ref]
    rng = np.random.default_rng(0)
    text = cap.describe_same_as(rng, objs, refs[0])
    assert text.startswith("the other ") and f"the same {refs[0].same} as the " in text


def test_bad_arguments_are_one_clear_error(tmp_path):
    from pipeline.errors import PipelineError

    with pytest.raises(PipelineError, match="--per-block 5"):
        world.generate(tmp_path / "x", per_block=5, progress=False)
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()
