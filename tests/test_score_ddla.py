"""workflow/scripts/score_ddla.py: the released DDLA predictions scored with the project's evaluator (issue 14).

The fixture is an excerpt of ``code/predictions/ddla_rerun_{gtfile,predfile}.json`` of harsh19/spot-the-diff
(five test pairs, copied unchanged: 256 and 2094 with three sentences, 421 whose prediction is one of its
sentences, 151 with one, 9420 whose only sentence is empty). On the full files the script gives the released
BLEU-4 0.0757, METEOR 0.1091, ROUGE-L 0.2797, CIDEr 0.3506 (the closing note of issue 14).
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest

from pipeline.errors import PipelineError

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
GT, PRED = DATA / "ddla_rerun_excerpt_gtfile.json", DATA / "ddla_rerun_excerpt_predfile.json"
needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="PTBTokenizer/METEOR need java")

_spec = importlib.util.spec_from_file_location("score_ddla", ROOT / "workflow" / "scripts" / "score_ddla.py")
score_ddla = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(score_ddla)


def test_release_files_become_references_and_predictions():
    refs, preds = score_ddla.load_release(GT, PRED)
    assert set(refs) == set(preds) == {"256", "151", "421", "2094", "9420"}
    assert refs["256"] == ["person with umbrella is gone", "person with red coat is moved",
                           "car up at top to left is now missing"]  # every annotation of the pair, file order
    assert refs["9420"] == [""] and preds["421"] == "the car is gone"


def test_malformed_release_files_are_named(tmp_path):
    gt, pred = json.loads(GT.read_text()), json.loads(PRED.read_text())
    cases = {
        "missing": (gt, pred[:-1], r"pred\.json: no prediction for image_id '9420'"),
        "duplicate": (gt, pred + pred[:1], r"pred\.json: duplicate prediction for image_id '256'"),
        "unknown": (gt, pred + [{"image_id": "7", "caption": "x"}], r"image_id '7' has no reference in .*gt\.json"),
        "not coco": (gt["annotations"], pred, r"gt\.json: expected coco-caption ground truth"),
    }
    for name, (g, p, message) in cases.items():
        (tmp_path / "gt.json").write_text(json.dumps(g))
        (tmp_path / "pred.json").write_text(json.dumps(p))
        with pytest.raises(PipelineError, match=message):
            score_ddla.load_release(tmp_path / "gt.json", tmp_path / "pred.json")


@needs_java
def test_one_pair_by_hand():
    """BLEU and ROUGE-L of single pairs, worked out by hand."""
    refs, preds = score_ddla.load_release(GT, PRED)
    # 151: "the car is gone" (4 words) against "black car missing from bottom left corner" (7): one unigram of four
    # matches, no bigram; brevity penalty exp(1 - 7/4). ROUGE-L: LCS 1, P = 1/4, R = 1/7, beta = 1.2.
    s = score_ddla.score_release({"151": refs["151"]}, {"151": preds["151"]})
    assert s["Bleu_1"] == pytest.approx(0.25 * math.exp(-0.75), abs=1e-8) and s["Bleu_2"] < 1e-6
    p, r = 1 / 4, 1 / 7
    assert s["ROUGE_L"] == pytest.approx((1 + 1.44) * p * r / (r + 1.44 * p), abs=1e-8)
    # 256: "the person walking is gone" against three sentences: unigrams person, is, gone clipped to 3 of 5,
    # bigram "is gone" 1 of 4, the closest reference has 5 words (no penalty); ROUGE-L: LCS 3 of 5 and 5.
    s = score_ddla.score_release({"256": refs["256"]}, {"256": preds["256"]})
    assert (s["Bleu_1"], s["Bleu_2"], s["ROUGE_L"]) == pytest.approx((0.6, math.sqrt(0.6 * 0.25), 0.6), abs=1e-8)


@needs_java
def test_excerpt_scored_as_released_and_as_the_parser_reads_it():
    """``keep`` scores the pair whose only sentence is empty, as coco-caption did; ``drop`` leaves it out, as the
    Spot-the-Diff parser does. Values computed with the evaluator (the hand-checked pairs above are in them)."""
    refs, preds = score_ddla.load_release(GT, PRED)
    keep = score_ddla.score_release(refs, preds, "keep")
    drop = score_ddla.score_release(refs, preds, "drop")
    assert (keep["n_pairs"], keep["n_references"], drop["n_pairs"], drop["n_references"]) == (5, 10, 4, 9)
    want_keep = {"Bleu_1": 0.3462, "Bleu_4": 0.1654, "METEOR": 0.1886, "ROUGE_L": 0.3802, "CIDEr": 1.2061}
    want_drop = {"Bleu_1": 0.3909, "Bleu_4": 0.1814, "METEOR": 0.1919, "ROUGE_L": 0.4753, "CIDEr": 1.4823}
    assert {m: round(keep[m], 4) for m in want_keep} == want_keep
    assert {m: round(drop[m], 4) for m in want_drop} == want_drop
    # the empty-reference pair adds a zero to CIDEr-D's and ROUGE-L's means over pairs
    assert keep["ROUGE_L"] == pytest.approx(drop["ROUGE_L"] * 4 / 5)


@needs_java
def test_command_line_writes_the_scores(tmp_path, capsys):
    out = tmp_path / "scores.json"
    assert score_ddla.main(["--gt", str(GT), "--pred", str(PRED), "--out", str(out)]) == 0
    scores = json.loads(out.read_text())
    assert scores["empty_references"] == "keep" and round(scores["CIDEr"], 4) == 1.2061
    assert "0.3506" in capsys.readouterr().out  # the released CIDEr beside ours
    assert score_ddla.main(["--gt", str(GT), "--pred", str(GT), "--out", str(out)]) == 1
