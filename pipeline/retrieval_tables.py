"""Stage ``retrieval-table``: CLIP4IDC's adaptation retrieval table (seed paper Table 6; the retrieval half of
Table 7), from adaptation runs, with the paper's numbers beside them.

``python -m pipeline retrieval-table --dataset clevr_change --runs results/clevr_change/clip4idc_adapt/seed0 ...
--out results/tables/clevr_change_retrieval.csv``. Each run dir holds ``run.json`` and ``retrieval_test.json``
(written by ``adapt-clip4idc``). Rows: one per adaptation run name (mean ± sample std over its seeds), then the
paper rows (``pipeline.paper_numbers.RETRIEVAL_ROWS``) of the runs present and of ``--paper-runs``. Columns:
image pair → text (P2T) and text → image pair (T2P) R@1/5/10 in %, median and mean rank, and R@20/50 where a
paper row reports them (``table_columns``); as in the captioning tables (``pipeline.tables``), each run row names
its configuration in short and its selected step, and the long notes are footnotes written once (Markdown) and
in ``<stem>.meta.json``. CSV + Markdown + sidecar.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from pipeline import paper_numbers as pn
from pipeline.errors import PipelineError
from pipeline.tables import DATASET_NAMES, Footnotes, describe_run, md_footnotes, md_table, write_csv
from pipeline.utils.io import atomic_path, read_json

# column -> (direction, key, scale): every column a table may have; R@20 and R@50 only where a paper row reports them
COLUMNS = {f"{d} {k}": (direction, k, 100.0 if k.startswith("R@") else 1.0)
           for d, direction in (("P2T", "pair_to_text"), ("T2P", "text_to_pair"))
           for k in ("R@1", "R@5", "R@10", "R@20", "R@50", "MedianR", "MeanR")}
COLUMNS = {c.replace("MedianR", "MdR").replace("MeanR", "MnR"): v for c, v in COLUMNS.items()}
assert tuple(COLUMNS) == pn.RETRIEVAL_ALL_COLUMNS and set(pn.RETRIEVAL_COLUMNS) <= set(COLUMNS)


def table_columns(rows: list[dict]) -> list[str]:
    """The columns of a table: ``paper_numbers.RETRIEVAL_COLUMNS``, plus each further one (R@20, R@50) that one
    of its paper rows reports (CLIP4IDC reports Spot-the-Diff at R@10/20/50), in ``COLUMNS`` order."""
    extra = {c for r in rows if r["kind"] == "paper" for c in COLUMNS if r.get(c, (None,))[0] is not None}
    return [c for c in COLUMNS if c in pn.RETRIEVAL_COLUMNS or c in extra]


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), (float(arr.std(ddof=1)) if len(arr) > 1 else None)


def load_groups(run_dirs, dataset: str) -> list[dict]:
    groups: dict[tuple, dict] = {}
    for d in map(Path, run_dirs):
        run, res = read_json(d / "run.json"), read_json(d / "retrieval_test.json")
        if run.get("dataset") != dataset:
            raise PipelineError(f"{d}/run.json: dataset {run.get('dataset')!r}, expected {dataset!r}")
        if res.get("split") != "test":
            raise PipelineError(f"{d}/retrieval_test.json: split {res.get('split')!r}, expected 'test'")
        key = (run["method"], run["kind"], str(run["source"]), str(run.get("backbone")))
        g = groups.setdefault(key, {"run": key[0], "kind": key[1], "source": key[2], "backbone": key[3],
                                    "weights": [], "seeds": [], "results": [], "runs": []})
        if run["seed"] in g["seeds"]:
            raise PipelineError(f"{d}: seed {run['seed']} of {key[0]!r} given twice")
        g["seeds"].append(run["seed"])
        g["weights"].append(str(run.get("weights")))
        g["results"].append(res)
        g["runs"].append(run)
    return list(groups.values())


INFO = ("method", "kind", "config", "selected step", "source", "backbone", "weights", "seeds", "n_pairs")
MD_INFO = ("method", "kind", "source", "config", "selected step", "seeds")


def table_rows(groups: list[dict], dataset: str, paper_runs=(), notes: Footnotes | None = None) -> list[dict]:
    name = DATASET_NAMES.get(dataset, dataset)
    notes = notes or Footnotes()
    rows = []
    for g in groups:
        weights = "; ".join(dict.fromkeys(g["weights"]))
        caveats = []
        if g["source"] != "official":
            caveats.append(f"adapted and evaluated on {g['source']} {name} data")
        if "random" in weights:
            caveats.append(f"CLIP with random-init weights ({weights})")
        row = {"method": g["run"], "kind": g["kind"], "source": f"{g['source']} {name}", "backbone": g["backbone"],
               "config": " / ".join(dict.fromkeys(describe_run(r) for r in g["runs"])),
               "selected step": ",".join(str(r["selected_step"]) for r in g["runs"] if r.get("selected_step") is not None),
               "weights": " ".join(weights.split("(")[0].split()), "seeds": ",".join(map(str, g["seeds"])),
               "n_pairs": ",".join(str(n) for n in sorted({r["n_pairs"] for r in g["results"]})),
               "notes": notes.refs(["; ".join(caveats) + (": not comparable to the paper rows" if caveats else "")])}
        for col, (direction, key, scale) in COLUMNS.items():  # a key missing from a run (older runs: R@20, R@50) is n/a
            vals = [r[direction].get(key) for r in g["results"]]
            row[col] = (None, None) if None in vals else _mean_std([v * scale for v in vals])
        rows.append(row)
    wanted = list(dict.fromkeys([g["run"] for g in groups] + list(paper_runs)))
    for r in pn.retrieval_rows(dataset, wanted):
        note = "; ".join(x for x in (f"paper row '{r.label}'" if r.label else "", r.note) if x)
        row = {"method": r.run, "kind": "paper", "source": r.source, "backbone": "", "weights": "as published",
               "config": "", "selected step": "", "seeds": "", "n_pairs": "", "notes": notes.refs([note])}
        row.update({c: (r.values.get(c), None) for c in COLUMNS})
        rows.append(row)
    return rows


PREAMBLE = ("Image pair → text (P2T) and text → image pair (T2P) retrieval on the test split's changed pairs, "
            "queries and candidates over all their change captions (pair → text scores a pair's caption set by "
            "its best caption); R@K in %, MdR/MnR = median/mean rank; ties are counted against the model. "
            "Reproduced rows: mean ± sample std over seeds; `paper` rows as printed.\n")


def write(groups: list[dict], dataset: str, out: str | Path, paper_runs=()) -> list[Path]:
    out = Path(out)
    notes = Footnotes()
    rows = table_rows(groups, dataset, paper_runs, notes)
    columns = table_columns(rows)
    write_csv(out, rows, columns, info=INFO)
    md = out.with_suffix(".md")
    with atomic_path(md) as tmp:
        tmp.write_text(PREAMBLE + "\n" + md_table(rows, columns, info=MD_INFO) + md_footnotes(rows, notes),
                       encoding="utf-8")
    meta = out.with_suffix(".meta.json")
    with atomic_path(meta) as tmp:
        tmp.write_text(json.dumps({"dataset": dataset, "tables": {out.name: "CLIP4IDC adaptation retrieval"},
                                   "preamble": PREAMBLE.strip(), "notes": notes.as_dict()}, indent=1, ensure_ascii=False)
                       + "\n", encoding="utf-8")
    return [out, md, meta]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--runs", nargs="*", default=[], help="adaptation run dirs results/<dataset>/<run>/seed<k>/")
    parser.add_argument("--paper-runs", nargs="*", default=[], help="run ids whose paper rows are always shown")
    parser.add_argument("--out", required=True, help="results/tables/<name>.csv (a .md twin is written beside it)")


def run(args: argparse.Namespace) -> None:
    written = write(load_groups(args.runs, args.dataset), args.dataset, args.out, args.paper_runs)
    print("retrieval-table: wrote " + ", ".join(map(str, written)))
