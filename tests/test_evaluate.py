"""Evaluator: pinned metric values, subset- vs global-IDF CIDEr, split blocks, prediction checks, SPICE absence."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from pipeline import evaluate as ev
from pipeline.__main__ import main
from pipeline.errors import PipelineError

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="PTBTokenizer/METEOR need java")


def _rec(pid, ctype, caps, split="test"):
    return {"pair_id": pid, "index": 0, "split": split, "before": f"images/{pid}", "after": f"sc_images/{pid}",
            "change_type": ctype, "captions": caps, "labels": {}, "source": "synthetic", "generator_seed": 0}


# Two colour pairs with the same reference, a move pair and two distractors; every prediction equals its reference.
RECORDS = [
    _rec("000001.png", "color", ["the small cube turned blue"]),
    _rec("000002.png", "color", ["the small cube turned blue"]),
    _rec("000003.png", "move", ["the large sphere moved to the left"]),
    _rec("000001.png_n", "no_change", ["there is no change at all"]),
    _rec("000002.png_n", "no_change", ["no change was made here"]),
]
PERFECT = [{"image_id": r["pair_id"], "caption": r["captions"][0]} for r in RECORDS]


@needs_java
def test_bleu_rouge_hand_case():
    s = ev.score({"a": ["the cat sat on a mat"]}, {"a": "the cat sat on the mat"})
    # clipped n-gram precisions 5/6, 3/5, 2/4, 1/3; equal lengths so no brevity penalty
    assert s["Bleu_1"] == pytest.approx(5 / 6, abs=1e-6)
    assert s["Bleu_2"] == pytest.approx(math.sqrt(5 / 6 * 3 / 5), abs=1e-6)
    assert s["Bleu_3"] == pytest.approx((5 / 6 * 3 / 5 * 2 / 4) ** (1 / 3), abs=1e-6)
    assert s["Bleu_4"] == pytest.approx((5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** (1 / 4), abs=1e-6)
    assert s["ROUGE_L"] == pytest.approx(5 / 6)  # LCS 5 of 6 words both ways
    # a single pair: every n-gram occurs in all (one) documents, so CIDEr-D's idf is zero
    assert s["CIDEr"] == 0.0
    assert s["SPICE"] is None
    assert 0.0 < s["METEOR"] < 1.0


@needs_java
def test_perfect_prediction_pinned_values():
    refs = {"a": ["a red cube turned green"], "b": ["one metal sphere was moved"], "c": ["nothing in this scene has changed"]}
    # PTB tokenisation lower-cases and drops punctuation, so these are perfect predictions
    preds = {"a": "A red cube turned green.", "b": "one metal sphere, was moved", "c": "Nothing in this scene has changed!"}
    s = ev.score(refs, preds)
    assert s["Bleu_4"] == pytest.approx(1.0, abs=1e-6)
    assert s["ROUGE_L"] == pytest.approx(1.0)
    assert s["METEOR"] == pytest.approx(1.0, abs=1e-6)
    # CIDEr-D of an exact match with one reference and distinct vocabularies: cosine 1 for n = 1..4, x10
    assert s["CIDEr"] == pytest.approx(10.0, abs=1e-9)
    assert s["SPICE"] is None


@needs_java
def test_evaluate_split_blocks_and_idf(monkeypatch):
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    calls = []
    real = PTBTokenizer.tokenize
    monkeypatch.setattr(PTBTokenizer, "tokenize", lambda self, d: calls.append(len(d)) or real(self, d))

    m = ev.evaluate_split(RECORDS, PERFECT)
    assert len(calls) == 1  # the split is tokenised once, references and predictions together
    assert m["n_pairs"] == 5 and m["total"]["n_pairs"] == 5
    assert m["semantic"]["n_pairs"] == 3 and m["distractor"]["n_pairs"] == 2
    sub, glob = m["by_type"]["subset_idf"], m["by_type"]["global_idf"]
    assert {t: sub[t]["n_pairs"] for t in ev.CHANGE_TYPES} == {
        "color": 2, "material": 0, "add": 0, "drop": 0, "move": 1, "no_change": 2}
    assert sub["material"]["CIDEr"] is None and glob["material"]["CIDEr"] is None

    # Subset IDF: both colour references are identical, so every n-gram has df = N = 2 and weight 0;
    # the lone move pair has N = 1. Global IDF (N = 5) gives the exact matches their full 10.
    assert sub["color"]["CIDEr"] == 0.0
    assert sub["move"]["CIDEr"] == 0.0
    assert glob["color"]["CIDEr"] == pytest.approx(10.0)
    assert glob["move"]["CIDEr"] == pytest.approx(10.0)
    assert sub["no_change"]["CIDEr"] == pytest.approx(10.0)
    assert m["total"]["CIDEr"] == pytest.approx(10.0)
    # the pair-weighted mean of the global-IDF per-type scores is the total CIDEr
    weighted = sum(glob[t]["CIDEr"] * glob[t]["n_pairs"] for t in ev.CHANGE_TYPES if glob[t]["n_pairs"]) / 5
    assert weighted == pytest.approx(m["total"]["CIDEr"])
    assert m["distractor"]["CIDEr"] == pytest.approx(sub["no_change"]["CIDEr"])

    # SPICE: null everywhere, never 0, and the record says why
    assert m["total"]["SPICE"] is None and sub["color"]["SPICE"] is None
    assert m["spice"].startswith("not available")
    json.dumps(m, allow_nan=False)  # strict JSON

    # one wrong distractor caption lowers the distractor block but not the semantic one
    wrong = [dict(p) for p in PERFECT]
    wrong[3]["caption"] = "the small cube turned blue"
    m2 = ev.evaluate_split(RECORDS, wrong)
    assert m2["distractor"]["CIDEr"] < m["distractor"]["CIDEr"]
    assert m2["semantic"]["Bleu_4"] == pytest.approx(m["semantic"]["Bleu_4"])


@pytest.mark.parametrize(
    "preds, needle",
    [
        (PERFECT[:-1], "missing prediction for image_id '000002.png_n'"),
        (PERFECT + [PERFECT[0]], "duplicate prediction for image_id '000001.png'"),
        (PERFECT + [{"image_id": "999999.png", "caption": "x"}], "image_id '999999.png' is not a pair"),
        (PERFECT[:-1] + [{"image_id": "000002.png_n", "caption": None}], "not a string"),
    ],
)
def test_prediction_id_errors(preds, needle):
    with pytest.raises(PipelineError) as e:
        ev.evaluate_split(RECORDS, preds, origin="runs/x/predictions_test.json")
    assert needle in str(e.value)
    assert "runs/x/predictions_test.json" in str(e.value)


@pytest.mark.parametrize("ctype", [None, "", 3])
def test_missing_change_type_rejected(ctype):
    with pytest.raises(PipelineError, match=f"pair '000001.png' has change_type {ctype!r}"):
        ev.evaluate_split([_rec("000001.png", ctype, ["a"])], [{"image_id": "000001.png", "caption": "a"}])


def test_split_types_clevr_six_or_the_types_present():
    assert ev.split_types(["color", "move"]) == ev.CHANGE_TYPES  # CLEVR-Change, CLEVR-DC: all six blocks
    assert ev.split_types(["no_change"]) == ev.CHANGE_TYPES
    assert ev.split_types(["change", "change"]) == ("change",)  # Spot-the-Diff
    assert ev.split_types(["texture", "no_change", "color"]) == ("color", "texture", "no_change")


@needs_java
def test_evaluate_split_on_a_dataset_without_clevr_types():
    recs = [_rec("256", "change", ["the white car is gone", "a person walked in"]),
            _rec("12", "change", ["the red car moved"])]
    m = ev.evaluate_split(recs, [{"image_id": "256", "caption": "the white car is gone"},
                                 {"image_id": "12", "caption": "the red car moved"}])
    assert list(m["by_type"]["subset_idf"]) == ["change"] and list(m["by_type"]["global_idf"]) == ["change"]
    assert m["by_type"]["subset_idf"]["change"]["n_pairs"] == 2 and m["semantic"]["n_pairs"] == 2
    assert m["distractor"]["n_pairs"] == 0 and m["distractor"]["CIDEr"] is None
    assert m["by_type"]["subset_idf"]["change"]["CIDEr"] == pytest.approx(m["total"]["CIDEr"])


def test_spice_status_without_jars(tmp_path):
    ok, why = ev.spice_status(None)
    assert not ok and why.startswith("not available")
    (tmp_path / "spice-1.0.jar").write_bytes(b"")
    ok, why = ev.spice_status(tmp_path)
    assert not ok and "stanford-corenlp-3.6.0.jar" in why and "stanford-corenlp-3.6.0-models.jar" in why


@needs_java
def test_cli_writes_metrics_and_rejects_bad_ids(tmp_path, capsys):
    manifest = tmp_path / "manifest.jsonl"
    train = _rec("000009.png", "add", ["a cube was added"], split="train")
    manifest.write_text("".join(json.dumps(r) + "\n" for r in [train] + RECORDS))
    preds = tmp_path / "predictions_test.json"
    preds.write_text(json.dumps(PERFECT))
    out = tmp_path / "run" / "metrics.json"
    assert main(["evaluate", "--manifest", str(manifest), "--predictions", str(preds), "--split", "test", "--out", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["split"] == "test" and m["n_pairs"] == 5  # the train pair is not evaluated
    assert m["total"]["SPICE"] is None and m["spice"].startswith("not available")
    assert set(m["by_type"]) == {"subset_idf", "global_idf"}

    preds.write_text(json.dumps(PERFECT[1:]))
    assert main(["evaluate", "--manifest", str(manifest), "--predictions", str(preds), "--out", str(tmp_path / "m2.json")]) == 2
    err = capsys.readouterr().err
    assert "000001.png" in err and str(preds) in err
    assert not (tmp_path / "m2.json").exists()


def _fake_spice_dir(tmp_path):
    d = tmp_path / "spice"
    (d / "lib").mkdir(parents=True)
    for name in ("spice-1.0.jar", "lib/stanford-corenlp-3.6.0.jar", "lib/stanford-corenlp-3.6.0-models.jar"):
        (d / name).write_bytes(b"")
    return d


def test_spice_wrapper_plumbing(tmp_path, monkeypatch):
    """The SPICE jar's input/output files are mapped back to our ids (a fake ``java`` stands in for SPICE)."""
    spice_dir = _fake_spice_dir(tmp_path)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "java"
    fake.write_text(
        "#!/usr/bin/env python3\n"
        "import json, sys\n"
        "a = sys.argv[1:]\n"
        "data = json.load(open(a[3]))\n"
        "out = [{'image_id': d['image_id'], 'scores': {'All': {'f': 0.5 if d['test'] == d['refs'][0] else 0.25}}} for d in data]\n"
        "json.dump(out, open(a[a.index('-out') + 1], 'w'))\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    ok, why = ev.spice_status(spice_dir)
    assert ok and why.startswith("computed with")
    got = ev.spice_per_pair({"x": ["a b"], "y": ["c d"]}, {"x": ["a b"], "y": ["e f"]}, spice_dir)
    assert got == {"x": 0.5, "y": 0.25}


@needs_java
def test_spice_averaged_per_subset(tmp_path, monkeypatch):
    spice_dir = _fake_spice_dir(tmp_path)
    per_pair = {"000001.png": 0.2, "000002.png": 0.4, "000003.png": 0.6, "000001.png_n": 0.8, "000002.png_n": 1.0}
    monkeypatch.setattr(ev, "spice_per_pair", lambda gts, res, jars: {k: per_pair[k] for k in gts})
    m = ev.evaluate_split(RECORDS, PERFECT, spice_jars=spice_dir)
    assert m["spice"].startswith("computed with")
    assert m["total"]["SPICE"] == pytest.approx(0.6)
    assert m["semantic"]["SPICE"] == pytest.approx(0.4)
    assert m["distractor"]["SPICE"] == pytest.approx(0.9)
    assert m["by_type"]["subset_idf"]["color"]["SPICE"] == pytest.approx(0.3)


@needs_java
def test_score_subset_of_metrics():
    s = ev.score({"a": ["a red cube turned green"], "b": ["one metal sphere was moved"]},
                 {"a": "a red cube turned green", "b": "one metal sphere was moved"}, metrics=("CIDEr",))
    assert s == {"CIDEr": pytest.approx(10.0)}
    with pytest.raises(PipelineError, match="unknown metric"):
        ev.score({"a": ["x"]}, {"a": "x"}, metrics=("CIDEr-D",))
