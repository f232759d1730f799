"""Regenerate a dataset's result tables from run metrics, with the papers' numbers beside them.

Stage: ``python -m pipeline table --dataset clevr_change --runs DIR [DIR ...] --out results/tables/clevr_change.csv
[--paper-methods m1 m2 ...]``. Each DIR is ``results/<dataset>/<method>/seed<k>/`` holding ``run.json`` and
``metrics.json`` (docs/contracts.md). Written, each as CSV plus a Markdown twin, atomically:

- ``<stem>.csv``: whole test split: BLEU-4, METEOR, ROUGE-L, CIDEr(-D), SPICE;
- ``<stem>_by_type.csv``: CIDEr per change type (Color, Texture = material, Add, Drop, Move,
  Distractor = no_change), re-scored on each type's subset (the papers' convention) and, in the
  ``(global IDF)`` columns, with document frequencies from the whole split;
- ``<stem>_pairs.csv``: changed-pairs-only and distractor-pairs-only scores (the aux paper's Table 2).

Rows: one per reproduced method, then one per sanity baseline (mean and sample std, ddof=1, over its seeds;
runs are grouped by method, kind, data source and backbone), then the papers' reported numbers
(``kind = paper``, ``source`` = seed file and table) for every method id present in the runs and every id
given by ``--paper-methods`` (default: the spine methods). Scores are x100 and rounded to one decimal like
the papers; a missing value (e.g. SPICE without its jars) is ``n/a``, never 0. A paper number is never put
in place of a reproduced one: it is always its own row.
"""

from __future__ import annotations

import argparse
import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from pipeline import paper_numbers as pn
from pipeline.errors import PipelineError
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
# Rows
# --------------------------------------------------------------------------------------------------
def _fmt(v: float | None) -> str:
    return NA if v is None else f"{v:.1f}"


def _group_info(g: Group, dataset: str) -> dict[str, str]:
    weights = "; ".join(dict.fromkeys(g.weights))
    name = DATASET_NAMES.get(dataset, dataset)
    notes = [SANITY_NOTES.get(g.method, "sanity baseline")] if g.kind == "sanity" else []
    caveats = []
    if g.source != "official":
        verb = "trained and evaluated" if g.kind == "reproduced" else "built and evaluated"
        caveats.append(f"{verb} on {g.source} {name} data")
    if g.method == "most_frequent":
        pass  # uses no features: the backbone weights do not matter
    elif any(w.startswith("random") for w in g.weights):
        caveats.append(f"backbone with random-init weights ({weights})")
    elif any(w in ("None", "") for w in g.weights) and g.kind == "reproduced":
        caveats.append("backbone weights identity unknown")
    if caveats:
        notes.append("; ".join(caveats) + ": not comparable to the paper rows")
    spice = sorted({str(m.get("spice")) for m in g.metrics if str(m.get("spice", "")).startswith("not available")})
    if spice:  # "not available: <reason> (<detail>)" -> "SPICE not available: <reason>"
        notes.append("SPICE " + spice[0].split(" (")[0])
    return {
        "method": g.method,
        "kind": g.kind,
        "source": f"{g.source} {name}",
        "backbone": g.backbone if g.backbone != "None" else "",
        "weights": weights if weights != "None" else "",
        "seeds": ",".join(str(s) for s in g.seeds),
        "note": "; ".join(notes),
    }


def _paper_info(r: pn.PaperRow) -> dict[str, str]:
    note = "; ".join(x for x in (f"paper row '{r.label}'" if r.label else "", r.note) if x)
    return {"method": r.method, "kind": "paper", "source": r.source, "backbone": "", "weights": "as published", "seeds": "", "note": note}


def _n_pairs(g: Group, path: Sequence[str]) -> str:
    ns = {_get(m, list(path) + ["n_pairs"]) for m in g.metrics}
    ns.discard(None)
    return ",".join(str(n) for n in sorted(ns))


def total_rows(groups: list[Group], dataset: str, paper_methods: Sequence[str]) -> list[dict]:
    rows = []
    for g in groups:
        row = _group_info(g, dataset)
        row["n_pairs"] = ",".join(str(n) for n in sorted({m.get("n_pairs") for m in g.metrics if m.get("n_pairs") is not None}))
        for col, key in TOTAL_COLUMNS.items():
            row[col] = mean_std(_get(m, ["total", key]) for m in g.metrics)
        rows.append(row)
    for r in pn.rows(dataset, "total", _wanted(groups, paper_methods)):
        row = {**_paper_info(r), "n_pairs": ""}
        for col in TOTAL_COLUMNS:
            row[col] = (r.value(col), None)
        rows.append(row)
    return rows


def by_type_rows(groups: list[Group], dataset: str, paper_methods: Sequence[str]) -> list[dict]:
    rows = []
    for g in groups:
        row = _group_info(g, dataset)
        for col, t in pn.TYPE_TO_CHANGE.items():
            row[col] = mean_std(_get(m, ["by_type", "subset_idf", t, "CIDEr"]) for m in g.metrics)
        for col, t in pn.TYPE_TO_CHANGE.items():
            row[f"{col} (global IDF)"] = mean_std(_get(m, ["by_type", "global_idf", t, "CIDEr"]) for m in g.metrics)
        row["n_pairs"] = " ".join(f"{t}:{_n_pairs(g, ['by_type', 'subset_idf', t])}" for t in pn.TYPE_TO_CHANGE.values())
        rows.append(row)
    for r in pn.rows(dataset, "by_type", _wanted(groups, paper_methods), metric="CIDEr"):
        row = {**_paper_info(r), "n_pairs": ""}
        for col in pn.TYPE_TO_CHANGE:
            row[col] = (r.value(col), None)
            row[f"{col} (global IDF)"] = (None, None)
        rows.append(row)
    return rows


def pair_rows(groups: list[Group], dataset: str, paper_methods: Sequence[str]) -> list[dict]:
    rows = []
    for block, metrics_key, label in PAIR_BLOCKS:
        for g in groups:
            row = {"subset": label, **_group_info(g, dataset), "n_pairs": _n_pairs(g, [metrics_key])}
            for col, key in TOTAL_COLUMNS.items():
                row[col] = mean_std(_get(m, [metrics_key, key]) for m in g.metrics)
            rows.append(row)
        for r in pn.rows(dataset, block, _wanted(groups, paper_methods)):
            row = {"subset": label, **_paper_info(r), "n_pairs": ""}
            for col in TOTAL_COLUMNS:
                row[col] = (r.value(col), None)
            rows.append(row)
    return rows


def _wanted(groups: list[Group], paper_methods: Sequence[str]) -> list[str]:
    return list(dict.fromkeys([g.method for g in groups] + list(paper_methods)))


# --------------------------------------------------------------------------------------------------
# Writers
# --------------------------------------------------------------------------------------------------
INFO_COLUMNS = ("method", "kind", "source", "backbone", "weights", "seeds", "n_pairs")


def _csv_header(stat_cols: Sequence[str], lead: Sequence[str] = ()) -> list[str]:
    cols = list(lead) + list(INFO_COLUMNS)
    for c in stat_cols:
        cols += [c, f"{c} std"]
    return cols + ["note"]


def write_csv(path: Path, rows: list[dict], stat_cols: Sequence[str], lead: Sequence[str] = ()) -> None:
    header = _csv_header(stat_cols, lead)
    with atomic_path(path) as tmp:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(header)
            for row in rows:
                out = [row.get(c, "") for c in list(lead) + list(INFO_COLUMNS)]
                for c in stat_cols:
                    mean, std = row.get(c, (None, None))
                    out += [_fmt(mean), "" if std is None else f"{std:.1f}"]
                out.append(row.get("note", ""))
                w.writerow(out)


def _md_cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def md_table(rows: list[dict], stat_cols: Sequence[str], lead: Sequence[str] = (), info: Sequence[str] = INFO_COLUMNS) -> str:
    """A GitHub pipe table; statistics shown as ``mean ± std`` (std only with two or more seeds)."""
    header = list(lead) + list(info) + list(stat_cols) + ["note"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        cells = [row.get(c, "") for c in list(lead) + list(info)]
        for c in stat_cols:
            mean, std = row.get(c, (None, None))
            cells.append(_fmt(mean) if std is None or mean is None else f"{mean:.1f} ± {std:.1f}")
        cells.append(row.get("note", ""))
        lines.append("| " + " | ".join(_md_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


_PREAMBLE = (
    "Scores x100 (CIDEr is CIDEr-D), test split; reproduced and sanity rows are the mean ± sample std over the "
    "listed seeds; `n/a` = not computed or not reported. `paper` rows are the numbers printed in the papers "
    "(shared/seeds/), shown beside the reproduced rows, never in their place. The papers do not share one scorer "
    "(DUDA/SCORER/DIRL: coco-caption with PTB tokenisation and SPICE; CLIP4IDC: no SPICE; IDC-PCL: its own "
    "copies, no PTB tokenisation).\n"
)


def write_tables(groups: list[Group], dataset: str, out: str | Path, paper_methods: Sequence[str]) -> list[Path]:
    """Write the three tables (CSV + Markdown); return the paths written."""
    out = Path(out)
    stem = out.with_suffix("") if out.suffix == ".csv" else out
    name = DATASET_NAMES.get(dataset, dataset)
    written = []

    total = total_rows(groups, dataset, paper_methods)
    cols = list(TOTAL_COLUMNS)
    p = stem.with_name(stem.name + ".csv")
    write_csv(p, total, cols)
    md = f"# {name}: whole test split\n\n{_PREAMBLE}\n" + md_table(total, cols)
    _write_text(stem.with_name(stem.name + ".md"), md)
    written += [p, stem.with_name(stem.name + ".md")]

    bt = by_type_rows(groups, dataset, paper_methods)
    sub_cols = list(pn.TYPE_TO_CHANGE)
    glob_cols = [f"{c} (global IDF)" for c in pn.TYPE_TO_CHANGE]
    p = stem.with_name(stem.name + "_by_type.csv")
    write_csv(p, bt, sub_cols + glob_cols)
    md = (
        f"# {name}: CIDEr by change type\n\n{_PREAMBLE}\n"
        "Texture = `material`, Distractor = `no_change` pairs.\n\n"
        "## Re-scored on each type's subset (document frequencies from that subset: the papers' convention)\n\n"
        + md_table(bt, sub_cols)
        + "\n## Document frequencies from the whole split (per-pair CIDEr-D averaged over each type)\n\n"
        + md_table([r for r in bt if r["kind"] != "paper"], glob_cols)
    )
    _write_text(stem.with_name(stem.name + "_by_type.md"), md)
    written += [p, stem.with_name(stem.name + "_by_type.md")]

    pr = pair_rows(groups, dataset, paper_methods)
    p = stem.with_name(stem.name + "_pairs.csv")
    write_csv(p, pr, cols, lead=("subset",))
    md = f"# {name}: changed pairs only / distractor pairs only\n\n{_PREAMBLE}\n"
    for _, _, label in PAIR_BLOCKS:
        md += f"## {label[0].upper() + label[1:]}\n\n" + md_table([r for r in pr if r["subset"] == label], cols) + "\n"
    _write_text(stem.with_name(stem.name + "_pairs.md"), md)
    written += [p, stem.with_name(stem.name + "_pairs.md")]
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


def run(args: argparse.Namespace) -> None:
    groups = load_runs(args.runs, args.dataset)
    written = write_tables(groups, args.dataset, args.out, args.paper_methods)
    print(f"{args.dataset}: {len(groups)} reproduced/sanity rows from {len(args.runs)} runs -> " + ", ".join(str(p) for p in written))
