"""Score the released DDLA predictions on Spot-the-Diff's test split with this project's evaluator (issue 14).

    python workflow/scripts/score_ddla.py --gt ddla_rerun_gtfile.json --pred ddla_rerun_predfile.json \
        [--empty-references keep|drop] [--out scores.json]

The two files are ``code/predictions/ddla_rerun_{gtfile,predfile}.json`` of github.com/harsh19/spot-the-diff
(the dataset's repository), in coco-caption's format: the ground truth ``{"annotations": [{"image_id",
"caption", "id"}, ...], "images": [...]}`` with one annotation per sentence of the un-merged ``test.json``
(an ``img_id`` with several entries has all their sentences), the predictions ``[{"image_id", "caption"}, ...]``,
one per test pair. The repository's ``code/check_predictions.ipynb`` scored them with coco-caption's
``COCOEvalCap`` (``RELEASED`` below).

Seven test pairs have only an empty sentence. coco-caption scores them against that empty reference (their
CIDEr-D is 0; they count in every mean); this project's Spot-the-Diff parser drops empty sentences and leaves such
pairs out. ``--empty-references keep`` (the default) scores as the release did, through the evaluator's own
tokenizer and scorers (``pipeline.evaluate.tokenize`` / ``score_tokenized``), since ``evaluate.score`` refuses a
reference without a word; ``drop`` scores the pairs the parser keeps, with their non-empty sentences, through
``pipeline.evaluate.score``. Scores are fractions, as pycocoevalcap returns them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline import evaluate
from pipeline.datasets.spot_the_diff import is_empty
from pipeline.errors import PipelineError
from pipeline.utils.io import read_json, write_json

# code/check_predictions.ipynb of the release (printed to 3 decimals there; issue 14 quotes 4).
RELEASED = {"Bleu_4": 0.0757, "METEOR": 0.1091, "ROUGE_L": 0.2797, "CIDEr": 0.3506}
METRICS = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr")


def load_release(gt_path: str | Path, pred_path: str | Path) -> tuple[dict[str, list[str]], dict[str, str]]:
    """``(refs, preds)``: every sentence of each test pair (file order, empty ones included) and its prediction.

    Raises PipelineError naming the file for a malformed entry, a duplicate prediction, or a pair that has
    references but no prediction (or the reverse)."""
    gt, pred = read_json(gt_path), read_json(pred_path)
    anns = gt.get("annotations") if isinstance(gt, dict) else None
    if not isinstance(anns, list):
        raise PipelineError(f"{gt_path}: expected coco-caption ground truth, an object with an 'annotations' list")
    refs: dict[str, list[str]] = {}
    for i, a in enumerate(anns):
        if not isinstance(a, dict) or not isinstance(a.get("caption"), str) or "image_id" not in a:
            raise PipelineError(f"{gt_path}: annotation {i} has no 'image_id' and string 'caption': {a!r}")
        refs.setdefault(str(a["image_id"]), []).append(a["caption"])
    if not isinstance(pred, list):
        raise PipelineError(f"{pred_path}: expected a list of {{'image_id', 'caption'}} objects")
    preds: dict[str, str] = {}
    for i, p in enumerate(pred):
        if not isinstance(p, dict) or not isinstance(p.get("caption"), str) or "image_id" not in p:
            raise PipelineError(f"{pred_path}: entry {i} has no 'image_id' and string 'caption': {p!r}")
        pid = str(p["image_id"])
        if pid in preds:
            raise PipelineError(f"{pred_path}: duplicate prediction for image_id {pid!r}")
        preds[pid] = p["caption"]
    unpredicted = [k for k in refs if k not in preds]
    unknown = [k for k in preds if k not in refs]
    if unpredicted:
        raise PipelineError(f"{pred_path}: no prediction for image_id {unpredicted[0]!r} of {gt_path} "
                            f"({len(unpredicted)} in all)")
    if unknown:
        raise PipelineError(f"{pred_path}: image_id {unknown[0]!r} has no reference in {gt_path} ({len(unknown)} in all)")
    return refs, preds


def score_release(refs: dict[str, list[str]], preds: dict[str, str], empty_references: str = "keep") -> dict:
    """The metrics of ``METRICS`` plus ``n_pairs`` and ``n_references``, as the release scored them (``keep``)
    or on the pairs and sentences this project's parser keeps (``drop``)."""
    if empty_references == "keep":
        gts, res = evaluate.tokenize(refs, preds)
        scores = evaluate.score_tokenized(gts, res, metrics=METRICS)
    elif empty_references == "drop":
        refs = {k: kept for k, caps in refs.items() if (kept := [c for c in caps if not is_empty(c)])}
        preds = {k: preds[k] for k in refs}
        scores = evaluate.score(refs, preds, metrics=METRICS)
    else:
        raise PipelineError(f"--empty-references must be 'keep' or 'drop', got {empty_references!r}")
    return {**scores, "n_pairs": len(refs), "n_references": sum(map(len, refs.values()))}


def report(scores: dict) -> str:
    lines = [f"{scores['n_pairs']} pairs, {scores['n_references']} references", "metric    ours     released"]
    for m in METRICS:
        lines.append(f"{m:<9} {scores[m]:.4f}" + (f"   {RELEASED[m]:.4f}" if m in RELEASED else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gt", required=True, help="ddla_rerun_gtfile.json")
    p.add_argument("--pred", required=True, help="ddla_rerun_predfile.json")
    p.add_argument("--empty-references", choices=("keep", "drop"), default="keep",
                   help="keep: score as the release did (default); drop: as this project's parser reads the split")
    p.add_argument("--out", help="write the scores as JSON")
    args = p.parse_args(argv)
    try:
        scores = score_release(*load_release(args.gt, args.pred), args.empty_references)
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    scores["empty_references"] = args.empty_references
    if args.out:
        write_json(args.out, scores)
    print(report(scores))
    return 0


if __name__ == "__main__":
    sys.exit(main())
