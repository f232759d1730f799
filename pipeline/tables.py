"""Regenerate a dataset's result tables from run metrics, with the papers' numbers beside them.

Stage: ``python -m pipeline table --dataset clevr_change --runs DIR [DIR ...] --out results/tables/clevr_change.csv
[--paper-methods m1 m2 ...]``. Each DIR is ``results/<dataset>/<method>/seed<k>/`` holding ``run.json`` and
``metrics.json`` (docs/contracts.md). Written, each as CSV plus a Markdown twin, atomically:

- ``<stem>.csv``: whole test split: BLEU-4, METEOR, ROUGE-L, CIDEr(-D), SPICE;
- ``<stem>_by_type.csv``: CIDEr per change type (Color, Texture = material, Add, Drop, Move,
  Distractor = no_change), re-scored on each type's subset (the papers' convention) and, in the
  ``(global IDF)`` columns, with document frequencies from the whole split; a dataset with other types
  (Spot-the-Diff: every pair ``change``) gets one column per type its metrics hold (``type_columns``);
- ``<stem>_pairs.csv``: changed-pairs-only and distractor-pairs-only scores (the aux paper's Table 2).

Rows: one per reproduced method, then one per sanity baseline (mean and sample std, ddof=1, over its seeds;
runs are grouped by method, kind, data source and backbone), then the papers' reported numbers
(``kind = paper``, ``source`` = seed file and table) for every method id present in the runs and every id
given by ``--paper-methods`` (default: the spine methods). Scores are x100 and rounded to one decimal like
the papers; a missing value (e.g. SPICE without its jars) is ``n/a``, never 0. A paper number is never put
in place of a reproduced one: it is always its own row.

Each reproduced row also says, from its runs: ``config`` (a short summary of its run.json configuration:
width, layers, grid, steps, batch, and the first stage's steps for a method with ``init_from``; see
``summarise_config``), ``selected step`` (best validation step per seed) and ``distinct test captions`` (how
many different captions its predictions_test.json holds, per seed: 1 means the same caption for every pair).
Long notes (data source, backbone weights identity, SPICE missing, "not comparable to the paper rows", the
paper rows' labels) are written once: the ``notes`` column holds footnote numbers, resolved in the Markdown
twins' footnotes and in ``<stem>.meta.json`` (``{"notes": {"1": text, ...}, "columns", "plots", "orderings",
...}``). With ``--plots`` the Markdown links the learning-curve figures; with ``--orderings`` it states, per
block, whether the papers' ordering of the rows by CIDEr holds here (``ordering``; for ablation tables).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from pipeline import paper_numbers as pn
from pipeline.errors import PipelineError
from pipeline.plots import metric_name
from pipeline.utils.io import atomic_path, read_json

DATASET_NAMES = {
    "clevr_change": "CLEVR-Change",
    "clevr_dc": "CLEVR-DC",
    "spot_the_diff": "Spot-the-Diff",
    "image_editing_request": "Image Editing Request",
    "birds_to_words": "Birds-to-Words",
}
# table column -> metrics.json key
TOTAL_COLUMNS = {"BLEU-4": "Bleu_4", "METEOR": "METEOR", "ROUGE-L": "ROUGE_L", "CIDEr": "CIDEr", "SPICE": "SPICE"}
PAIR_BLOCKS = (("changed", "semantic", "changed pairs only"), ("distractor", "distractor", "distractor pairs only"))
SANITY_ORDER = ("most_frequent", "nearest_neighbour")
SANITY_NOTES = {
    "most_frequent": "sanity baseline: the most frequent training caption for every pair",
    "nearest_neighbour": "sanity baseline: caption of the nearest training pair (pooled features, cosine)",
}
NA = "n/a"


# --------------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------------
@dataclass
class Group:
    """The seeds of one method on one data source and backbone."""

    method: str
    kind: str
    source: str
    backbone: str
    weights: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)  # run.json of each seed


def load_runs(run_dirs: Sequence[str | Path], dataset: str) -> list[Group]:
    """Read ``run.json`` + ``metrics.json`` of every run dir and group them; validates dataset and split."""
    groups: dict[tuple, Group] = {}
    splits: dict[str, str] = {}
    for d in run_dirs:
        d = Path(d)
        run = read_json(d / "run.json")
        metrics = read_json(d / "metrics.json")
        for key in ("method", "dataset", "seed", "kind", "source"):
            if key not in run:
                raise PipelineError(f"{d / 'run.json'}: no {key!r}")
        if run["dataset"] != dataset:
            raise PipelineError(f"{d / 'run.json'}: dataset {run['dataset']!r}, but the table is for {dataset!r}")
        if run["kind"] not in ("reproduced", "sanity"):
            raise PipelineError(f"{d / 'run.json'}: kind {run['kind']!r}, expected 'reproduced' or 'sanity'")
        if not isinstance(metrics.get("total"), dict):
            raise PipelineError(f"{d / 'metrics.json'}: no 'total' block")
        splits[str(d)] = metrics.get("split")
        key = (run["method"], run["kind"], str(run["source"]), str(run.get("backbone")))
        g = groups.setdefault(key, Group(*key))
        if run["seed"] in g.seeds:
            raise PipelineError(f"{d}: seed {run['seed']} of {run['method']!r} given twice (also {g.dirs[g.seeds.index(run['seed'])]})")
        g.seeds.append(run["seed"])
        g.weights.append(str(run.get("weights")))
        g.metrics.append(metrics)
        g.dirs.append(str(d))
        g.runs.append(run)
    if len(set(splits.values())) > 1:
        raise PipelineError(f"runs were evaluated on different splits: {splits}")
    return _ordered(list(groups.values()))


def _method_rank(method: str) -> tuple:
    m = pn.canonical(method)
    if m in pn.METHOD_ORDER:
        return (0, pn.METHOD_ORDER.index(m), method)
    if method in SANITY_ORDER:
        return (1, SANITY_ORDER.index(method), method)
    return (2, 0, method)


def _ordered(groups: list[Group]) -> list[Group]:
    kind_rank = {"reproduced": 0, "sanity": 1}
    return sorted(groups, key=lambda g: (kind_rank[g.kind], _method_rank(g.method), g.source, g.backbone))


def _get(metrics: dict, path: Sequence[str]) -> Any:
    cur: Any = metrics
    for p in path:
        if not isinstance(cur, dict) or p not in cur:
            return None
        cur = cur[p]
    return cur


def mean_std(values: Iterable[Any]) -> tuple[float | None, float | None]:
    """Mean and sample std (ddof=1) of fractions, x100; None if any value is missing; std None for one value."""
    vals = list(values)
    if not vals or any(v is None or (isinstance(v, float) and math.isnan(v)) for v in vals):
        return None, None
    arr = np.asarray(vals, dtype=np.float64) * 100.0
    return float(arr.mean()), (float(arr.std(ddof=1)) if len(arr) > 1 else None)


# --------------------------------------------------------------------------------------------------
# Row descriptions: configuration summary, selected step, distinct captions, footnotes
# --------------------------------------------------------------------------------------------------
def _fmt(v: float | None) -> str:
    return NA if v is None else f"{v:.1f}"


def _count(n: Any) -> str:
    """700 -> '700', 1200 -> '1.2k', 10000 -> '10k' (training budgets)."""
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return str(n)
    if n < 1000:
        return f"{n:g}"
    k = n / 1000
    return f"{k:.1f}".rstrip("0").rstrip(".") + "k"


def _shape_parts(model: dict) -> list[str]:
    """Width, layers and grid keys present in a model block (generic: no method names)."""
    out = []
    primary = model.get("primary_model")
    shape = primary if isinstance(primary, dict) else model  # a composite (DUDA+TIRG): its captioner's shape
    width = next((shape[k] for k in ("dim", "hidden") if isinstance(shape.get(k), int)), None)
    if width is not None:
        out.append(f"d={width}")
    if isinstance(shape.get("att_hidden"), int):
        out.append(f"att {shape['att_hidden']}")
    if isinstance(primary, dict) and isinstance(model.get("embed_dim"), int):
        out.append(f"aux d={model['embed_dim']}")
    clip = model.get("clip") if isinstance(model.get("clip"), dict) else {}
    if clip:
        dims = [f"w={clip['vision_width']}" if "vision_width" in clip else "",
                f"{clip['vision_layers']} layers" if "vision_layers" in clip else ""]
        out.append("CLIP " + ", ".join(x for x in dims if x))
    if isinstance(model.get("n_intra"), int):
        total = clip.get("vision_layers")
        out.append(f"N_intra={model['n_intra']}" + (f" of {total}" if total else ""))
    layers = [shape[k] for k in ("single_layers", "pair_layers", "layers", "decoder_layers") if isinstance(shape.get(k), int)]
    if layers:
        out.append("+".join(map(str, layers)) + (" layers" if len(layers) > 1 or layers[0] != 1 else " layer"))
    if isinstance(shape.get("pool"), int):
        out.append(f"{shape['pool']}×{shape['pool']} grid (pooled)")
    elif isinstance(shape.get("grid"), int):
        out.append(f"{shape['grid']}×{shape['grid']} grid")
    if shape.get("reduce") == "mean":
        out.append("attended features averaged")
    if shape.get("own_difference"):
        out.append("each map reads its own difference")
    if shape.get("usage_weight"):
        out.append("balanced attention use")
    if shape.get("cross_cell_bias"):
        out.append("cross-cell attention bias")
    if shape.get("type_embedding"):
        out.append("image type embedding")
    if shape.get("freeze_encoder") is True or model.get("freeze_encoder") is True:
        out.append("frozen encoder")
    return out


def _budget(train: dict) -> list[str]:
    out = []
    if "iterations" in train:
        out.append(f"{_count(train['iterations'])} steps")
    if "batch_size" in train:
        out.append(f"batch {train['batch_size']}")
    return out


def first_stage_info(run_dir: str | Path, run: dict) -> tuple[str, dict] | None:
    """(kind, config) of the first-stage run a method was initialised from (``init_from``), if it is on disk:
    ``results/<dataset>/<init_from>/seed<k>/`` beside the method's ``results/<dataset>/<method>/seed<k>/``."""
    name = (run.get("config") or {}).get("init_from")
    if not name:
        return None
    d = Path(run_dir).parent.parent / name / Path(run_dir).name
    for fname, kind in (("pretrain.json", "pre-training"), ("run.json", "adaptation")):
        if (d / fname).exists():
            return kind, read_json(d / fname).get("config") or {}
    return "first stage", {}


def summarise_config(config: dict, first: tuple[str, dict] | None = None) -> str:
    """A short description of a run's configuration, e.g. ``d=512, 1+1+3 layers, 120 steps, batch 4 + pre-training
    88 steps, batch 8``: the width / layers / grid / pool keys present in the model block, the budget of the
    train block, and the first stage's budget for a method with ``init_from``."""
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    train = config.get("train") if isinstance(config.get("train"), dict) else {}
    text = ", ".join(_shape_parts(model) + _budget(train))
    if first is not None:
        kind, cfg = first
        budget = ", ".join(_budget(cfg.get("train") or {}))
        text += f" + {kind} ({config.get('init_from')})" + (f" {budget}" if budget else "")
    return text


def describe_run(run: dict, first: tuple[str, dict] | None = None) -> str:
    """``summarise_config`` of a run.json, plus ``bf16`` where the run trained under bf16 autocast (its recorded
    ``precision``: ``fast`` resolves per machine, so the config alone cannot say)."""
    text = summarise_config(run.get("config") or {}, first)
    return text + ", bf16" if run.get("precision") == "bf16" else text


def _distinct_captions(run_dir: str | Path) -> str:
    path = Path(run_dir) / "predictions_test.json"
    if not path.exists():
        return NA
    return str(len({p["caption"] for p in read_json(path)}))


class Footnotes:
    """Long notes, each written once and referred to by number (1, 2, ...) in the order first used."""

    def __init__(self):
        self.texts: list[str] = []

    def ref(self, text: str) -> int:
        if text not in self.texts:
            self.texts.append(text)
        return self.texts.index(text) + 1

    def refs(self, texts: Iterable[str]) -> list[int]:
        return sorted({self.ref(t) for t in texts if t})

    def as_dict(self) -> dict[str, str]:
        return {str(i + 1): t for i, t in enumerate(self.texts)}


def _short_weights(w: str) -> str:
    """The weights column: the identity's head (``random``, ``CLIP random``, ``sha256:0123456789ab``)."""
    if w.startswith("sha256:"):
        return w[:19]
    return w.split("(")[0].strip()


def _group_notes(g: Group, dataset: str) -> list[str]:
    name = DATASET_NAMES.get(dataset, dataset)
    weights = "; ".join(dict.fromkeys(g.weights))
    notes = [SANITY_NOTES.get(g.method, "sanity baseline")] if g.kind == "sanity" else []
    # how near a tie the most frequent caption won (the row's score rests on it); recorded by baselines.py
    margin = next((r["config"]["caption_margin"] for r in g.runs if r.get("config", {}).get("caption_margin")), None)
    if g.method == "most_frequent" and margin:
        runner = (f"; the next, '{margin['runner_up']}', {margin['runner_up_count']:,}"
                  if margin.get("runner_up") else "")
        notes[0] += (f": '{margin['caption']}' ({margin['count']:,} of {margin['training_references']:,} "
                     f"training references{runner})")
    comparable = g.source == "official"
    if not comparable:
        notes.append(f"trained (sanity rows: built) and evaluated on {g.source} {name} data: not comparable to the paper rows")
    if g.method == "most_frequent":
        pass  # uses no features: the backbone weights do not matter
    elif any("random" in w for w in g.weights):
        notes.append(f"{g.backbone} backbone with random-init weights: {weights}"
                     + (": not comparable to the paper rows" if comparable else ""))
    elif any(w in ("None", "") for w in g.weights) and g.kind == "reproduced":
        notes.append("backbone weights identity unknown")
    elif weights not in ("None", ""):
        notes.append(f"{g.backbone} backbone weights: {weights}")
    spice = sorted({str(m.get("spice")) for m in g.metrics if str(m.get("spice", "")).startswith("not available")})
    if spice:  # "not available: <reason> (<detail>)" -> "SPICE not available: <reason>"
        notes.append("SPICE " + spice[0].split(" (")[0])
    return notes


def _group_info(g: Group, dataset: str, notes: Footnotes) -> dict[str, Any]:
    name = DATASET_NAMES.get(dataset, dataset)
    weights = "; ".join(dict.fromkeys(_short_weights(w) for w in g.weights))
    if g.kind == "reproduced":
        configs = [describe_run(r, first_stage_info(d, r)) for d, r in zip(g.dirs, g.runs)]
        config = " / ".join(dict.fromkeys(configs))
        selected = ",".join(str(r.get("selected_step")) for r in g.runs if r.get("selected_step") is not None)
    else:
        config, selected = "", ""
    return {
        "method": g.method,
        "kind": g.kind,
        "config": config,
        "selected step": selected,
        "distinct test captions": ",".join(_distinct_captions(d) for d in g.dirs),
        "source": f"{g.source} {name}",
        "backbone": g.backbone if g.backbone != "None" else "",
        "weights": weights if weights != "None" else "",
        "seeds": ",".join(str(s) for s in g.seeds),
        "notes": notes.refs(_group_notes(g, dataset)),
    }


def _paper_info(r: pn.PaperRow, notes: Footnotes) -> dict[str, Any]:
    note = "; ".join(x for x in (f"paper row '{r.label}'" if r.label else "", r.note) if x)
    return {"method": r.method, "kind": "paper", "config": "", "selected step": "", "distinct test captions": "",
            "source": r.source, "backbone": "", "weights": "as published", "seeds": "", "notes": notes.refs([note])}


def _n_pairs(g: Group, path: Sequence[str]) -> str:
    ns = {_get(m, list(path) + ["n_pairs"]) for m in g.metrics}
    ns.discard(None)
    return ",".join(str(n) for n in sorted(ns))


# --------------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------------
def total_rows(groups: list[Group], dataset: str, paper_methods: Sequence[str], notes: Footnotes | None = None) -> list[dict]:
    notes = notes or Footnotes()
    rows = []
    for g in groups:
        row = _group_info(g, dataset, notes)
        row["n_pairs"] = ",".join(str(n) for n in sorted({m.get("n_pairs") for m in g.metrics if m.get("n_pairs") is not None}))
        for col, key in TOTAL_COLUMNS.items():
            row[col] = mean_std(_get(m, ["total", key]) for m in g.metrics)
        rows.append(row)
    for r in pn.rows(dataset, "total", _wanted(groups, paper_methods)):
        row = {**_paper_info(r, notes), "n_pairs": ""}
        for col in TOTAL_COLUMNS:
            row[col] = (r.value(col), None)
        rows.append(row)
    return rows


def type_columns(groups: list[Group]) -> dict[str, str]:
    """The by-type table's columns (column -> change type): the papers' six CLEVR columns
    (``paper_numbers.TYPE_TO_CHANGE``) when the runs' metrics hold no other type (CLEVR-Change, CLEVR-DC),
    else one column per type they hold, named by the type, in ``evaluate.split_types`` order (Spot-the-Diff:
    ``change``)."""
    from pipeline.evaluate import split_types

    present = {t for g in groups for m in g.metrics for t in (_get(m, ["by_type", "subset_idf"]) or {})}
    if present <= set(pn.TYPE_TO_CHANGE.values()):
        return dict(pn.TYPE_TO_CHANGE)
    return {t: t for t in split_types(present)}


def by_type_rows(groups: list[Group], dataset: str, paper_methods: Sequence[str], notes: Footnotes | None = None,
                 columns: dict[str, str] | None = None) -> list[dict]:
    notes = notes or Footnotes()
    columns = columns or type_columns(groups)
    rows = []
    for g in groups:
        row = _group_info(g, dataset, notes)
        for col, t in columns.items():
            row[col] = mean_std(_get(m, ["by_type", "subset_idf", t, "CIDEr"]) for m in g.metrics)
        for col, t in columns.items():
            row[f"{col} (global IDF)"] = mean_std(_get(m, ["by_type", "global_idf", t, "CIDEr"]) for m in g.metrics)
        row["n_pairs"] = " ".join(f"{t}:{_n_pairs(g, ['by_type', 'subset_idf', t])}" for t in columns.values())
        rows.append(row)
    if columns != pn.TYPE_TO_CHANGE:  # the papers' by-type numbers are CLEVR's six types
        return rows
    for r in pn.rows(dataset, "by_type", _wanted(groups, paper_methods), metric="CIDEr"):
        row = {**_paper_info(r, notes), "n_pairs": ""}
        for col in pn.TYPE_TO_CHANGE:
            row[col] = (r.value(col), None)
            row[f"{col} (global IDF)"] = (None, None)
        rows.append(row)
    return rows


def pair_rows(groups: list[Group], dataset: str, paper_methods: Sequence[str], notes: Footnotes | None = None) -> list[dict]:
    notes = notes or Footnotes()
    rows = []
    for block, metrics_key, label in PAIR_BLOCKS:
        for g in groups:
            row = {"subset": label, **_group_info(g, dataset, notes), "n_pairs": _n_pairs(g, [metrics_key])}
            for col, key in TOTAL_COLUMNS.items():
                row[col] = mean_std(_get(m, [metrics_key, key]) for m in g.metrics)
            rows.append(row)
        for r in pn.rows(dataset, block, _wanted(groups, paper_methods)):
            row = {"subset": label, **_paper_info(r, notes), "n_pairs": ""}
            for col in TOTAL_COLUMNS:
                row[col] = (r.value(col), None)
            rows.append(row)
    return rows


def _wanted(groups: list[Group], paper_methods: Sequence[str]) -> list[str]:
    return list(dict.fromkeys([g.method for g in groups] + list(paper_methods)))


# --------------------------------------------------------------------------------------------------
# Orderings: does the papers' ordering of the rows hold here?
# --------------------------------------------------------------------------------------------------
def _chain(items: list[tuple[str, float]]) -> str:
    """'a 1.0 < b 2.0 = c 2.0' from (name, value) pairs sorted by value (values compared as displayed)."""
    out = ""
    for i, (name, v) in enumerate(items):
        if i:
            out += " = " if f"{v:.1f}" == f"{items[i - 1][1]:.1f}" else " < "
        out += f"{name} {v:.1f}"
    return out


def ordering(rows: list[dict], dataset: str, block: str, metric: str = "CIDEr") -> dict:
    """Compare the order of the reproduced rows by ``metric`` with the order of the same methods' paper rows.

    Paper rows come from ``pipeline.paper_numbers`` for ``dataset`` and ``block``; when fewer than two of the
    methods have one there, the rows the papers report on another dataset are used, and the statement says so.
    Returns ``{"block", "metric", "paper": [[method, value]...], "here": [...], "paper_source", "paper_dataset",
    "holds": bool | None, "inverted": [[a, b]...], "statement": str}`` (``holds`` None: nothing to compare).
    """
    ours = {r["method"]: r[metric][0] for r in rows if r["kind"] == "reproduced" and r.get(metric, (None,))[0] is not None}
    datasets = [dataset] + sorted({r.dataset for r in pn.PAPER_ROWS} - {dataset})
    paper, used = {}, dataset
    for ds in datasets:
        found = {m: pn.lookup(ds, block, m) for m in ours}
        paper = {m: r for m, r in found.items() if r is not None and r.value(metric) is not None}
        used = ds
        if len(paper) >= 2:
            break
    out = {"block": block, "metric": metric, "paper_dataset": used, "paper": [], "here": [], "paper_source": [],
           "holds": None, "inverted": []}
    if len(paper) < 2:
        out["statement"] = (f"{metric}: fewer than two of these rows have a paper value ({block} block): "
                            "no ordering to compare")
        return out
    methods = sorted(paper, key=lambda m: (paper[m].value(metric), m))
    here = sorted(methods, key=lambda m: (round(ours[m], 1), methods.index(m)))
    p_val = {m: paper[m].value(metric) for m in methods}
    h_val = {m: round(ours[m], 1) for m in methods}
    inverted = [(a, b) for i, a in enumerate(methods) for b in methods[i + 1:]
                if (p_val[a] > p_val[b]) - (p_val[a] < p_val[b]) != (h_val[a] > h_val[b]) - (h_val[a] < h_val[b])]
    sources = list(dict.fromkeys(paper[m].source for m in methods))
    where = DATASET_NAMES.get(used, used)
    cross = f", reported on {where} only: compared across datasets" if used != dataset else ""
    text = (f"paper ({'; '.join(sources)}{cross}), {metric}: {_chain([(m, p_val[m]) for m in methods])}; "
            f"here: {_chain([(m, ours[m]) for m in here])}")
    if not inverted:
        text += " — the paper's ordering holds"
    else:
        first = next(i for i, (a, b) in enumerate(zip(methods, here)) if a != b) if methods != here else None
        pairs = ", ".join(f"{a} vs {b}" for a, b in inverted)
        text += (f" — ordering differs: {len(inverted)} of {len(methods) * (len(methods) - 1) // 2} pairs not in the "
                 f"paper's order ({pairs})")
        if first is not None:
            text += f"; first difference at rank {first + 1} from the bottom: paper {methods[first]}, here {here[first]}"
    out.update(paper=[[m, p_val[m]] for m in methods], here=[[m, ours[m]] for m in here], paper_source=sources,
               holds=not inverted, inverted=[list(x) for x in inverted], statement=text)
    return out


# --------------------------------------------------------------------------------------------------
# Writers
# --------------------------------------------------------------------------------------------------
INFO_COLUMNS = ("method", "kind", "config", "selected step", "distinct test captions", "source", "backbone", "weights",
                "seeds", "n_pairs")
# The Markdown twins: compact (backbone and weights identity are in the footnotes; n_pairs in the text when uniform)
MD_INFO = ("method", "kind", "source", "config", "selected step", "distinct test captions", "seeds")
MD_INFO_SHORT = ("method", "kind", "source", "seeds")
COLUMN_DOCS = {
    "config": "summary of the run's configuration (run.json config): width, layers, grid, steps, batch; "
              "'+ pre-training/adaptation (<run>) ...' = the first stage it was initialised from",
    "selected step": "training step selected on validation (per seed)",
    "distinct test captions": "number of different captions in predictions_test.json (per seed)",
    "weights": "head of the backbone weights identity (in full in the notes)",
    "notes": "footnote numbers: see 'notes' in <stem>.meta.json and the Markdown footnotes",
    "n_pairs": "test pairs scored",
}


def _csv_header(stat_cols: Sequence[str], lead: Sequence[str] = (), info: Sequence[str] = INFO_COLUMNS) -> list[str]:
    cols = list(lead) + list(info)
    for c in stat_cols:
        cols += [c, f"{c} std"]
    return cols + ["notes"]


def _refs(row: dict) -> str:
    return " ".join(f"[{n}]" for n in row.get("notes", []))


def write_csv(path: Path, rows: list[dict], stat_cols: Sequence[str], lead: Sequence[str] = (),
              info: Sequence[str] = INFO_COLUMNS) -> None:
    header = _csv_header(stat_cols, lead, info)
    with atomic_path(path) as tmp:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(header)
            for row in rows:
                out = [row.get(c, "") for c in list(lead) + list(info)]
                for c in stat_cols:
                    mean, std = row.get(c, (None, None))
                    out += [_fmt(mean), "" if std is None else f"{std:.1f}"]
                out.append(",".join(str(n) for n in row.get("notes", [])))
                w.writerow(out)


def _md_cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def md_table(rows: list[dict], stat_cols: Sequence[str], lead: Sequence[str] = (), info: Sequence[str] = MD_INFO) -> str:
    """A GitHub pipe table; statistics shown as ``mean ± std`` (std only with two or more seeds); ``notes`` as
    footnote references ``[n]`` (see ``md_footnotes``)."""
    header = list(lead) + list(info) + list(stat_cols) + ["notes"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        cells = [row.get(c, "") for c in list(lead) + list(info)]
        for c in stat_cols:
            mean, std = row.get(c, (None, None))
            cells.append(_fmt(mean) if std is None or mean is None else f"{mean:.1f} ± {std:.1f}")
        cells.append(_refs(row))
        lines.append("| " + " | ".join(_md_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def md_footnotes(rows: list[dict], notes: Footnotes) -> str:
    """The footnotes the rows refer to, each once."""
    used = sorted({n for r in rows for n in r.get("notes", [])})
    if not used:
        return ""
    return "\nNotes:\n\n" + "\n".join(f"[{n}] {_md_cell(notes.texts[n - 1])}  " for n in used) + "\n"


def _pairs_line(rows: list[dict], what: str = "test pairs") -> str:
    ns = sorted({r.get("n_pairs", "") for r in rows if r["kind"] != "paper"} - {""})
    return f"{what}: {', '.join(ns)}.\n" if ns else ""


def _write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


_PREAMBLE = (
    "Scores x100 (CIDEr is CIDEr-D), test split; reproduced and sanity rows are the mean ± sample std over the "
    "listed seeds; `n/a` = not computed or not reported. `paper` rows are the numbers printed in the papers "
    "(shared/seeds/), shown beside the reproduced rows, never in their place. The papers do not share one scorer "
    "(DUDA/SCORER/DIRL: coco-caption with PTB tokenisation and SPICE; CLIP4IDC: no SPICE; IDC-PCL: its own "
    "copies, no PTB tokenisation). `config`: the run's configuration in short; `selected step`: best validation "
    "step; `distinct test captions`: how many different captions the row predicts on the test split; `notes`: "
    "footnotes below.\n"
)


def _plots_md(plots: Sequence[str | Path], md_path: Path) -> str:
    if not plots:
        return ""
    rel = [(Path(p).stem, Path(os.path.relpath(Path(p).resolve(), md_path.parent.resolve())).as_posix()) for p in plots]
    table_figs = [(n, r) for n, r in rel if n.endswith("_val_cider")]
    method_figs = [(n, r) for n, r in rel if not n.endswith("_val_cider")]
    out = "\n## Learning curves\n\n"
    for n, r in table_figs:
        out += f"![validation score (the selection metric) vs step]({r})\n\n"
    if method_figs:
        out += "Per method (train losses per component, validation score, selected step): " + ", ".join(
            f"[{n}]({r})" for n, r in method_figs) + "\n"
    return out


# --------------------------------------------------------------------------------------------------
# Contrasts: does an addition (pre-training, extra data) help here?
# --------------------------------------------------------------------------------------------------
def _selected_val(g: Group) -> tuple[str, float] | None:
    """(metric, mean over seeds) of the validation score at each run's selected step (``run.json``)."""
    got: dict[str, list[float]] = {}
    for run in g.runs:
        for k, v in run.items():
            if k.startswith("val_") and isinstance(v, (int, float)):
                got.setdefault(k[4:], []).append(float(v))
    if len(got) != 1:
        return None
    (metric, values), = got.items()
    return metric, sum(values) / len(values)


def contrast(rows: list[dict], groups: list[Group], dataset: str, method: str, base: str,
             metrics: Sequence[str] = ("ROUGE-L", "CIDEr")) -> dict:
    """``method`` against ``base`` (the same model without the addition): test differences here and in the
    papers (``pipeline.paper_numbers``), and the selected validation scores. ``helps``: True when every listed
    metric rises here, False when every one falls, None when they disagree or a row is missing."""
    ours = {r["method"]: r for r in rows if r["kind"] == "reproduced"}
    out = {"method": method, "base": base, "here": {}, "paper": {}, "paper_source": None, "helps": None}
    if method not in ours or base not in ours:
        out["statement"] = f"{method} vs {base}: {'/'.join(m for m in (method, base) if m not in ours)} not in this table"
        return out
    here = {c: ours[method][c][0] - ours[base][c][0] for c in metrics
            if ours[method][c][0] is not None and ours[base][c][0] is not None}
    pm, pb = pn.lookup(dataset, "total", method), pn.lookup(dataset, "total", base)
    paper = {c: pm.value(c) - pb.value(c) for c in metrics
             if pm and pb and pm.value(c) is not None and pb.value(c) is not None}
    complete = len(here) == len(metrics)
    ups = {v > 0 for v in here.values()}
    helps = ups.pop() if complete and len(ups) == 1 and 0 not in here.values() else None
    fmt = lambda d: ", ".join(f"{c} {v:+.1f}" for c, v in d.items())  # noqa: E731
    text = f"{method} vs {base}: here {fmt(here)}"
    vals = {m: _selected_val(g) for g in groups for m in (method, base) if g.method == m and g.kind == "reproduced"}
    if vals.get(method) and vals.get(base) and vals[method][0] == vals[base][0]:
        text += f" (validation {metric_name(vals[method][0])} at the selected step {100 * vals[base][1]:.1f} -> {100 * vals[method][1]:.1f})"
    if paper:
        text += f"; paper ({pm.source}) {fmt(paper)}"
    if complete:
        mixed = ", ".join(f"{c} {'up' if v > 0 else 'down'}" for c, v in here.items())
        text += {True: " — helps here (every metric up)", False: " — does not help here (every metric down)",
                 None: f" — mixed here ({mixed})"}[helps]
    out.update(here=here, paper=paper, paper_source=pm.source if paper else None, helps=helps, statement=text)
    return out


def _contrasts_md(items: list[dict]) -> str:
    if not items:
        return ""
    return ("\nDoes each addition help here? (test scores of the rows above, means over their seeds: with few seeds a "
            "difference of a few points can be seed noise; the validation curves are linked below)\n\n" + "\n".join(f"- {c['statement']}" for c in items) + "\n")


def _orderings_md(items: list[dict]) -> str:
    if not items:
        return ""
    return "\nOrdering vs the paper (computed from the rows above):\n\n" + "\n".join(
        f"- {o['block']}: {o['statement']}" for o in items) + "\n"


def write_tables(groups: list[Group], dataset: str, out: str | Path, paper_methods: Sequence[str],
                 plots: Sequence[str | Path] = (), orderings: bool = False,
                 contrasts: Sequence[Sequence[str]] = ()) -> list[Path]:
    """Write the three tables (CSV + Markdown) and their ``.meta.json`` sidecar; return the paths written."""
    out = Path(out)
    stem = out.with_suffix("") if out.suffix == ".csv" else out
    name = DATASET_NAMES.get(dataset, dataset)
    notes = Footnotes()
    written, order_items = [], []
    path = lambda suffix: stem.with_name(stem.name + suffix)  # noqa: E731

    total = total_rows(groups, dataset, paper_methods, notes)
    cols = list(TOTAL_COLUMNS)
    write_csv(path(".csv"), total, cols)
    total_order = [ordering(total, dataset, "total")] if orderings else []
    order_items += total_order
    contrast_items = [contrast(total, groups, dataset, m, b) for m, b in contrasts]
    md = (f"# {name}: whole test split\n\n{_PREAMBLE}\n{_pairs_line(total)}\n" + md_table(total, cols)
          + md_footnotes(total, notes) + _orderings_md(total_order) + _contrasts_md(contrast_items)
          + _plots_md(plots, path(".md")))
    _write_text(path(".md"), md)
    written += [path(".csv"), path(".md")]

    type_cols = type_columns(groups)
    bt = by_type_rows(groups, dataset, paper_methods, notes, type_cols)
    sub_cols = list(type_cols)
    glob_cols = [f"{c} (global IDF)" for c in type_cols]
    write_csv(path("_by_type.csv"), bt, sub_cols + glob_cols)
    legend = ("Texture = `material`, Distractor = `no_change` pairs. " if type_cols == pn.TYPE_TO_CHANGE else
              "The change types are the manifest's (this dataset has none of CLEVR's). ")
    md = (
        f"# {name}: CIDEr by change type\n\n{_PREAMBLE}\n"
        + legend + _pairs_line(bt, "Test pairs per type") + "\n"
        "## Re-scored on each type's subset (document frequencies from that subset: the papers' convention)\n\n"
        + md_table(bt, sub_cols, info=MD_INFO_SHORT)
        + "\n## Document frequencies from the whole split (per-pair CIDEr-D averaged over each type)\n\n"
        + md_table([r for r in bt if r["kind"] != "paper"], glob_cols, info=MD_INFO_SHORT)
        + md_footnotes(bt, notes)
    )
    _write_text(path("_by_type.md"), md)
    written += [path("_by_type.csv"), path("_by_type.md")]

    pr = pair_rows(groups, dataset, paper_methods, notes)
    write_csv(path("_pairs.csv"), pr, cols, lead=("subset",))
    md = f"# {name}: changed pairs only / distractor pairs only\n\n{_PREAMBLE}\n"
    pair_order = []
    for block, _, label in PAIR_BLOCKS:
        sub = [r for r in pr if r["subset"] == label]
        md += (f"## {label[0].upper() + label[1:]}\n\n" + _pairs_line(sub, "Test pairs") + "\n"
               + md_table(sub, cols, info=MD_INFO_SHORT) + "\n")
        if orderings:
            pair_order.append(ordering(sub, dataset, block))
    md += md_footnotes(pr, notes) + _orderings_md(pair_order)
    order_items += pair_order
    _write_text(path("_pairs.md"), md)
    written += [path("_pairs.csv"), path("_pairs.md")]

    meta = {
        "dataset": dataset, "dataset_name": name,
        "tables": {path(".csv").name: "whole test split", path("_by_type.csv").name: "CIDEr by change type",
                   path("_pairs.csv").name: "changed pairs only / distractor pairs only"},
        "preamble": _PREAMBLE.strip(),
        "columns": COLUMN_DOCS,
        "notes": notes.as_dict(),
        "plots": [Path(os.path.relpath(Path(p).resolve(), out.parent.resolve())).as_posix() for p in plots],
        "orderings": order_items,
        "contrasts": contrast_items,
    }
    with atomic_path(path(".meta.json")) as tmp:
        tmp.write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    written.append(path(".meta.json"))
    return written


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", required=True, help="dataset id, e.g. clevr_change")
    parser.add_argument("--runs", nargs="*", default=[], help="run directories results/<dataset>/<method>/seed<k>/")
    parser.add_argument("--out", required=True, help="results/tables/<dataset>.csv (the _by_type and _pairs tables go beside it)")
    parser.add_argument(
        "--paper-methods", nargs="*", default=list(pn.SPINE_METHODS),
        help="method ids whose paper rows are always shown (default: %(default)s)",
    )
    parser.add_argument("--plots", nargs="*", default=[], help="figures the Markdown links (results/<dataset>/plots/*.png)")
    parser.add_argument("--orderings", action="store_true",
                        help="state whether the papers' ordering of the reproduced rows by CIDEr holds (ablation tables)")
    parser.add_argument("--contrasts", nargs="*", default=[], metavar="METHOD:BASE",
                        help="state, for each METHOD:BASE, whether the addition METHOD has over BASE helps here")


def run(args: argparse.Namespace) -> None:
    groups = load_runs(args.runs, args.dataset)
    pairs = []
    for c in args.contrasts:
        method, sep, base = c.partition(":")
        if not sep or not method or not base:
            raise PipelineError(f"--contrasts {c!r}: expected METHOD:BASE")
        pairs.append((method, base))
    written = write_tables(groups, args.dataset, args.out, args.paper_methods, args.plots, args.orderings, pairs)
    print(f"{args.dataset}: {len(groups)} reproduced/sanity rows from {len(args.runs)} runs -> " + ", ".join(str(p) for p in written))
