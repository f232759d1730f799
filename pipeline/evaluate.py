"""Score predicted captions against a split's references, overall and CLEVR-style by change type.

Stage: ``python -m pipeline evaluate --manifest M --predictions P --split test --out metrics.json``.

The metrics are pycocoevalcap's: its PTBTokenizer, ``Bleu(4)``, ``Meteor``, ``Rouge`` (ROUGE-L) and ``Cider``
(which is CIDEr-D: clipped tf-idf n-gram vectors, a Gaussian length penalty with sigma 6, x10, document
frequencies taken from the references it is given). Scores are fractions, exactly as pycocoevalcap returns
them (CIDEr-D of a perfect caption is 10.0, not 1.0). SPICE is computed only when ``--spice-jars DIR`` holds
``spice-1.0.jar`` with its ``lib/`` (including the Stanford CoreNLP 3.6.0 jars); otherwise it is ``null`` and
``metrics.json`` says why, never 0.

Java is started as few times as possible: a split is PTB-tokenised in one call (references and predictions
together) and every subset is scored from those tokens; one METEOR process is shared by the whole Python
process; SPICE (a per-caption score with no corpus statistics) runs once per split and its per-pair scores
are averaged over each subset.

CLEVR-style breakdown (see docs/contracts.md, ``metrics.json``):
- ``total``: all pairs; ``semantic``: change_type != no_change; ``distractor``: no_change pairs.
- ``by_type.subset_idf``: every metric re-scored on each change type's subset, so CIDEr's document
  frequencies come from that subset's references (the DUDA ``score_generation_by_type`` convention behind
  the papers' by-type tables; "texture" there is ``material`` here, "Distractor" is ``no_change``).
- ``by_type.global_idf``: CIDEr-D computed once on the whole split (document frequencies from all of its
  references), its per-pair scores averaged over each type's subset. The pair-weighted mean of these over
  all types equals ``total.CIDEr``.
Every block carries ``n_pairs``; a block with no pairs has ``n_pairs: 0`` and null metrics.

The types come from the records (``split_types``): a split whose types are all CLEVR's six (CLEVR-Change,
CLEVR-DC) gets a block for each of the six, in ``CHANGE_TYPES`` order, empty ones included; any other split
(e.g. Spot-the-Diff, whose every pair is ``change``) gets a block per type present, sorted, ``no_change`` last.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from pipeline.errors import PipelineError
from pipeline.text import has_word
from pipeline.utils.io import read_json, read_jsonl, write_json

METRICS = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr", "SPICE")
CHANGE_TYPES = ("color", "material", "add", "drop", "move", "no_change")
DISTRACTOR = "no_change"

SPICE_JAR = "spice-1.0.jar"
SPICE_CORENLP_JARS = ("stanford-corenlp-3.6.0.jar", "stanford-corenlp-3.6.0-models.jar")


# --------------------------------------------------------------------------------------------------
# Java-backed pieces
# --------------------------------------------------------------------------------------------------
def _require_java() -> None:
    if shutil.which("java") is None:
        raise PipelineError("java not found on PATH: pycocoevalcap's PTBTokenizer and METEOR need a Java runtime")


_METEOR = None
_METEOR_LOCK = threading.Lock()


def _meteor():
    """One pycocoevalcap ``Meteor`` (a long-lived JVM, ~5-10 s to start) per process, created on first use."""
    global _METEOR
    with _METEOR_LOCK:
        if _METEOR is None or _METEOR.meteor_p.poll() is not None:
            from pycocoevalcap.meteor.meteor import Meteor

            _require_java()
            # METEOR prints its scores with the JVM's default locale; a decimal comma breaks float().
            old = os.environ.get("LC_ALL")
            os.environ["LC_ALL"] = "C"
            try:
                _METEOR = Meteor()
            finally:
                if old is None:
                    del os.environ["LC_ALL"]
                else:
                    os.environ["LC_ALL"] = old
        return _METEOR


@atexit.register
def _close_meteor() -> None:
    global _METEOR
    if _METEOR is not None:
        with contextlib.suppress(Exception):
            _METEOR.meteor_p.stdin.close()
            _METEOR.meteor_p.kill()
            _METEOR.meteor_p.wait(timeout=10)
        _METEOR = None


def _clean(text: str) -> str:
    # PTBTokenizer is line-based; METEOR's protocol uses "|||" as a field separator.
    return " ".join(text.replace("|", " ").split())


def tokenize(refs: Mapping[str, list[str]], preds: Mapping[str, str]) -> tuple[dict, dict]:
    """PTB-tokenise references and predictions in one Java call.

    Returns ``(gts, res)``: ``{id: [tokenised ref, ...]}`` and ``{id: [tokenised prediction]}``, lower-cased
    with punctuation removed, as pycocoevalcap's scorers expect.
    """
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    _require_java()
    batch: dict[tuple[str, str], list[dict[str, str]]] = {}
    for k, caps in refs.items():
        batch[("ref", k)] = [{"caption": _clean(c)} for c in caps]
    for k, cap in preds.items():
        batch[("pred", k)] = [{"caption": _clean(cap)}]
    if not batch:
        return {}, {}
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            out = PTBTokenizer().tokenize(batch)
    except OSError as e:
        raise PipelineError(
            f"PTBTokenizer failed ({e}); it writes a temporary file inside the installed pycocoevalcap/tokenizer "
            "directory, which must be writable"
        ) from None
    for key, caps in batch.items():
        if len(out.get(key, [])) != len(caps):
            raise PipelineError(f"PTBTokenizer returned {len(out.get(key, []))} captions for {key}, expected {len(caps)}")
    gts = {k: [_clean(c) for c in out[("ref", k)]] for k in refs}
    res = {k: [_clean(out[("pred", k)][0])] for k in preds}
    return gts, res


def spice_status(spice_jars: str | os.PathLike | None) -> tuple[bool, str]:
    """Whether SPICE can run from ``spice_jars``, and a sentence saying why (not)."""
    if spice_jars is None:
        return False, "not available: no --spice-jars directory given (SPICE needs spice-1.0.jar and Stanford CoreNLP 3.6.0 jars)"
    d = Path(spice_jars)
    missing = [str(d / SPICE_JAR)] if not (d / SPICE_JAR).is_file() else []
    missing += [str(d / "lib" / j) for j in SPICE_CORENLP_JARS if not (d / "lib" / j).is_file()]
    if missing:
        return False, "not available: missing " + ", ".join(missing)
    if shutil.which("java") is None:
        return False, "not available: java not found on PATH"
    return True, f"computed with {d / SPICE_JAR}"


def spice_per_pair(gts: Mapping[str, list[str]], res: Mapping[str, list[str]], spice_jars: str | os.PathLike) -> dict[str, float]:
    """Run the SPICE jar once on tokenised captions; return each id's SPICE F-score ("All" f).

    pycocoevalcap's ``Spice`` class can only use the jars inside its own package directory and downloads
    CoreNLP when they are missing, so the jar is called here directly with the same input/output files and
    the same per-caption score it reads; without ``-cache`` (its FST cache fails on Java >= 16) and with
    temporary files outside site-packages.
    """
    ok, why = spice_status(spice_jars)
    if not ok:
        raise PipelineError(f"SPICE {why}")
    keys = list(gts)
    with tempfile.TemporaryDirectory(prefix="spice_") as tmp:
        in_path, out_path = Path(tmp) / "in.json", Path(tmp) / "out.json"
        data = [{"image_id": i, "test": res[k][0], "refs": gts[k]} for i, k in enumerate(keys)]
        in_path.write_text(json.dumps(data), encoding="utf-8")
        cmd = ["java", "-jar", "-Xmx8G", str(Path(spice_jars) / SPICE_JAR), str(in_path), "-out", str(out_path), "-subset", "-silent"]
        proc = subprocess.run(cmd, cwd=str(spice_jars), capture_output=True, text=True)
        if proc.returncode != 0 or not out_path.exists():
            raise PipelineError(f"SPICE failed (exit {proc.returncode}) running {' '.join(cmd)}: {proc.stderr.strip()[-2000:]}")
        results = json.loads(out_path.read_text(encoding="utf-8"))
    scores: dict[str, float] = {}
    for item in results:
        try:
            f = float(item["scores"]["All"]["f"])
        except (TypeError, ValueError, KeyError):
            f = float("nan")
        scores[keys[int(item["image_id"])]] = f
    if len(scores) != len(keys):
        raise PipelineError(f"SPICE returned {len(scores)} scores for {len(keys)} captions")
    return scores


# --------------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------------
def _subset(d: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    return {k: d[k] for k in keys}


def _mean_or_none(values: list[float]) -> float | None:
    vals = [v for v in values if not math.isnan(v)]
    return float(np.mean(vals)) if vals else None


def _check_metrics(metrics: Iterable[str] | None) -> tuple[str, ...]:
    if metrics is None:
        return METRICS
    metrics = tuple(metrics)
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise PipelineError(f"unknown metric(s) {unknown}; expected some of {METRICS}")
    return metrics


def score_tokenized(
    gts: Mapping[str, list[str]],
    res: Mapping[str, list[str]],
    spice_scores: Mapping[str, float] | None = None,
    metrics: Iterable[str] | None = None,
) -> dict[str, float | None]:
    """Metrics on already tokenised captions (same keys in ``gts`` and ``res``): all of ``METRICS``, or only
    those named in ``metrics`` (e.g. ``("CIDEr",)`` for cheap validation without METEOR's JVM).

    CIDEr's document frequencies come from exactly the references in ``gts``. ``spice_scores`` are per-id
    SPICE F-scores (``spice_per_pair``); without them SPICE is None.
    """
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    wanted = _check_metrics(metrics)
    if set(gts) != set(res):
        raise PipelineError("references and predictions cover different ids")
    if not gts:
        return {m: None for m in wanted}
    gts, res = dict(gts), {k: res[k] for k in gts}
    out: dict[str, float | None] = {}
    if any(m.startswith("Bleu_") for m in wanted):
        bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
        out.update({f"Bleu_{i + 1}": float(b) for i, b in enumerate(bleu)})
    if "METEOR" in wanted:
        out["METEOR"] = float(_meteor().compute_score(gts, res)[0])
    if "ROUGE_L" in wanted:
        out["ROUGE_L"] = float(Rouge().compute_score(gts, res)[0])
    if "CIDEr" in wanted:
        out["CIDEr"] = float(Cider().compute_score(gts, res)[0])
    if "SPICE" in wanted:
        out["SPICE"] = _mean_or_none([spice_scores[k] for k in gts]) if spice_scores is not None else None
    return {m: out[m] for m in wanted}


def cider_per_pair(gts: Mapping[str, list[str]], res: Mapping[str, list[str]]) -> dict[str, float]:
    """CIDEr-D of each id with document frequencies from all references in ``gts``."""
    from pycocoevalcap.cider.cider import Cider

    if not gts:
        return {}
    keys = list(gts)
    _, scores = Cider().compute_score({k: gts[k] for k in keys}, {k: res[k] for k in keys})
    return {k: float(s) for k, s in zip(keys, scores)}


def _check_refs(refs: Mapping[str, list[str]], origin: str) -> None:
    for k, caps in refs.items():
        if not isinstance(caps, list) or not caps or not all(isinstance(c, str) for c in caps):
            raise PipelineError(f"{origin}: pair {k!r} needs a non-empty list of reference captions (strings)")
        for c in caps:
            if not has_word(c):  # the tokenizer would leave it empty, and CIDEr-D would crash on it
                raise PipelineError(f"{origin}: pair {k!r}: reference caption {c!r} has no word (punctuation only)")


def score(
    refs: dict[str, list[str]],
    preds: dict[str, str],
    spice_jars: str | None = None,
    metrics: Iterable[str] | None = None,
) -> dict:
    """Score one prediction per id against its references.

    Returns ``{"Bleu_1".."Bleu_4", "METEOR", "ROUGE_L", "CIDEr", "SPICE"}`` as pycocoevalcap's fractions
    (CIDEr-D with document frequencies from these references), or only the keys named in ``metrics``.
    ``SPICE`` is None unless ``spice_jars`` holds the SPICE jars (see ``spice_status`` for the reason).
    One PTBTokenizer call per ``score`` call.
    """
    wanted = _check_metrics(metrics)
    missing = [k for k in refs if k not in preds]
    unknown = [k for k in preds if k not in refs]
    if missing or unknown:
        raise PipelineError(f"predictions and references differ: missing {missing[:5]}, unknown {unknown[:5]}")
    if not refs:
        raise PipelineError("nothing to score: no references given")
    _check_refs(refs, "references")
    for k, c in preds.items():
        if not isinstance(c, str):
            raise PipelineError(f"prediction for {k!r} is not a string: {c!r}")
    gts, res = tokenize(refs, preds)
    spice_ok, _ = spice_status(spice_jars)
    spice = spice_per_pair(gts, res, spice_jars) if spice_ok and "SPICE" in wanted else None
    return score_tokenized(gts, res, spice, wanted)


# --------------------------------------------------------------------------------------------------
# CLEVR-style split evaluation
# --------------------------------------------------------------------------------------------------
def check_predictions(predictions: Any, expected_ids: Iterable[str], origin: str = "predictions") -> dict[str, str]:
    """Validate COCO-results predictions (``[{"image_id", "caption"}]``) against a split's pair ids.

    Every id must appear exactly once; an unknown, duplicate or missing id (or a malformed entry) raises
    PipelineError naming the id and ``origin`` (the file). A ``{id: caption}`` dict is accepted as well.
    """
    expected = list(expected_ids)
    expected_set = set(expected)
    if isinstance(predictions, Mapping):
        entries = [{"image_id": k, "caption": v} for k, v in predictions.items()]
    elif isinstance(predictions, list):
        entries = predictions
    else:
        raise PipelineError(f"{origin}: expected a list of {{'image_id', 'caption'}} objects, got {type(predictions).__name__}")
    out: dict[str, str] = {}
    for i, e in enumerate(entries):
        if not isinstance(e, Mapping) or "image_id" not in e or "caption" not in e:
            raise PipelineError(f"{origin}: entry {i} is not an object with 'image_id' and 'caption': {e!r}")
        pid, cap = e["image_id"], e["caption"]
        if not isinstance(cap, str):
            raise PipelineError(f"{origin}: caption for image_id {pid!r} is not a string: {cap!r}")
        if pid not in expected_set:
            raise PipelineError(f"{origin}: image_id {pid!r} is not a pair of the evaluated split")
        if pid in out:
            raise PipelineError(f"{origin}: duplicate prediction for image_id {pid!r}")
        out[pid] = cap
    missing = [k for k in expected if k not in out]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise PipelineError(f"{origin}: missing prediction for image_id {missing[0]!r}{more}")
    return out


def _block(gts, res, keys, spice) -> dict:
    keys = list(keys)
    if not keys:
        return {**{m: None for m in METRICS}, "n_pairs": 0}
    return {**score_tokenized(_subset(gts, keys), _subset(res, keys), spice), "n_pairs": len(keys)}


def split_types(types: Iterable[str]) -> tuple[str, ...]:
    """The ``by_type`` blocks of a split with these change types: CLEVR's six (``CHANGE_TYPES``, in that
    order) when every type is one of them, else the types present, sorted, ``no_change`` last."""
    present = set(types)
    if present <= set(CHANGE_TYPES):
        return CHANGE_TYPES
    return tuple(sorted(present - {DISTRACTOR})) + ((DISTRACTOR,) if DISTRACTOR in present else ())


def evaluate_split(
    records: list[dict],
    predictions: Any,
    spice_jars: str | os.PathLike | None = None,
    origin: str = "predictions",
) -> dict:
    """CLEVR-style evaluation of one split (see the module docstring for the blocks).

    ``records`` are the manifest records of the split (``pair_id``, ``change_type``, ``captions``);
    ``predictions`` COCO results covering each pair exactly once (``origin`` names them in errors).
    """
    if not records:
        raise PipelineError(f"no manifest records to evaluate {origin} against")
    refs: dict[str, list[str]] = {}
    types: dict[str, str] = {}
    for r in records:
        pid = r.get("pair_id")
        if not isinstance(pid, str):
            raise PipelineError(f"manifest record without a string pair_id: {r!r}")
        if pid in refs:
            raise PipelineError(f"manifest: duplicate pair_id {pid!r}")
        ctype = r.get("change_type")
        if not isinstance(ctype, str) or not ctype:
            raise PipelineError(f"manifest: pair {pid!r} has change_type {ctype!r}, expected a non-empty string "
                                f"(e.g. one of {CHANGE_TYPES})")
        refs[pid] = r.get("captions")
        types[pid] = ctype
    _check_refs(refs, "manifest")
    preds = check_predictions(predictions, refs, origin)

    gts, res = tokenize(refs, preds)
    spice_ok, spice_note = spice_status(spice_jars)
    spice = spice_per_pair(gts, res, spice_jars) if spice_ok else None

    ids = list(refs)
    by_type_ids = {t: [k for k in ids if types[k] == t] for t in split_types(types.values())}
    global_cider = cider_per_pair(gts, res)
    splits = {r.get("split") for r in records}
    out: dict[str, Any] = {
        "split": splits.pop() if len(splits) == 1 else None,
        "n_pairs": len(ids),
        "spice": spice_note,
        "total": _block(gts, res, ids, spice),
        "semantic": _block(gts, res, [k for k in ids if types[k] != DISTRACTOR], spice),
        "distractor": _block(gts, res, [k for k in ids if types[k] == DISTRACTOR], spice),
        "by_type": {"subset_idf": {}, "global_idf": {}},
    }
    for t, keys in by_type_ids.items():
        out["by_type"]["subset_idf"][t] = _block(gts, res, keys, spice)
        out["by_type"]["global_idf"][t] = {
            "CIDEr": float(np.mean([global_cider[k] for k in keys])) if keys else None,
            "n_pairs": len(keys),
        }
    return out


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--manifest", required=True, help="results/<dataset>/manifest.jsonl")
    parser.add_argument("--predictions", required=True, help="COCO results JSON: [{image_id: pair_id, caption}]")
    parser.add_argument("--split", default="test", help="split of the manifest to evaluate (default: test)")
    parser.add_argument("--out", required=True, help="metrics.json to write")
    parser.add_argument("--spice-jars", default=None, help="directory with spice-1.0.jar and lib/ (Stanford CoreNLP 3.6.0); SPICE is null without it")
    parser.add_argument("--extra", action="append", default=[], metavar="NAME=PATH",
                        help="merge a method's own metrics JSON (e.g. retrieval=retrieval_test.json) as metrics[NAME]")


def run(args: argparse.Namespace) -> None:
    records = [r for r in read_jsonl(args.manifest) if r.get("split") == args.split]
    if not records:
        raise PipelineError(f"{args.manifest}: no records with split {args.split!r}")
    predictions = read_json(args.predictions)
    metrics = evaluate_split(records, predictions, spice_jars=args.spice_jars, origin=str(args.predictions))
    metrics["split"] = args.split
    metrics["manifest"] = str(args.manifest)
    metrics["predictions"] = str(args.predictions)
    for item in args.extra:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise PipelineError(f"--extra {item!r}: expected NAME=PATH")
        metrics[name] = read_json(path)
    write_json(args.out, metrics)
    t = metrics["total"]
    print(
        f"{args.split}: {metrics['n_pairs']} pairs  BLEU-4 {t['Bleu_4']:.4f}  METEOR {t['METEOR']:.4f}  "
        f"ROUGE-L {t['ROUGE_L']:.4f}  CIDEr {t['CIDEr']:.4f}  SPICE {t['SPICE'] if t['SPICE'] is not None else 'n/a'}"
    )
