"""DVC's view of one paper table: the files that dvc.yaml's ``table@<table>`` stage declares as metrics and plots.

Run by the ``dvc_files`` rule (rules/tables.smk) from the table and its runs (docs/contracts.md, "DVC files"):

- ``results/tables/<table>_metrics.json`` (DVC metrics): ``{"table": {<method>: {<score>: x100 mean}},
  "runs": {"<method>/seed<k>": <that run's metrics.json>}}``, the table's reproduced and sanity rows (the
  columns that have a ``<score> std`` twin in ``<table>.csv``; ``n/a`` cells left out) and each run's scores;
- ``results/tables/<table>_by_type_plot.csv`` (DVC plot, horizontal bars): ``label,method,type,CIDEr``, one row
  per reproduced or sanity method and change-type column of ``<table>_by_type.csv`` with a number;
- ``results/tables/<table>_curves/<method>_seed<k>.csv`` (DVC plots, one per trained run): ``step,val_score``,
  the validation rows of the run's ``train_log.jsonl`` as the learning-curve figures read them
  (``pipeline.plots.read_log``: the last run logged, resumptions resolved).
"""

import csv
import math
from pathlib import Path

from pipeline.plots import read_log
from pipeline.utils.io import atomic_path, read_json, write_json

ROW_KINDS = ("reproduced", "sanity")  # the paper rows are constants: nothing for `dvc metrics diff` to compare


def _number(cell: str) -> float | None:
    try:
        v = float(cell)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def _rows(path: str | Path) -> tuple[list[str], list[dict]]:
    """The score columns (those with a ``<col> std`` twin) and the reproduced and sanity rows of a table CSV."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        rows = [r for r in reader if r["kind"] in ROW_KINDS]
        header = reader.fieldnames or []
    return [c for c in header if f"{c} std" in header], rows


def table_scores(path: str | Path) -> dict[str, dict[str, float]]:
    cols, rows = _rows(path)
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        key = r["method"] if r["method"] not in out else f"{r['method']} ({r['backbone']})"
        out[key] = {c: v for c in cols if (v := _number(r[c])) is not None}
    return out


def by_type_rows(path: str | Path) -> list[dict]:
    cols, rows = _rows(path)
    return [{"label": f"{r['method']}: {c}", "method": r["method"], "type": c, "CIDEr": v}
            for r in rows for c in cols if (v := _number(r[c])) is not None]


def _write_csv(path: str | Path, fields: list[str], rows: list[dict]) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(rows)


def write_dvc_files(table_csv, by_type_csv, runs, out_metrics, out_by_type, out_curves) -> None:
    runs = [Path(r) for r in runs]
    write_json(out_metrics, {"table": table_scores(table_csv),
                             "runs": {f"{r.parent.name}/{r.name}": read_json(r / "metrics.json") for r in runs}})
    _write_csv(out_by_type, ["label", "method", "type", "CIDEr"], by_type_rows(by_type_csv))
    Path(out_curves).mkdir(parents=True, exist_ok=True)
    for r in runs:
        if (r / "train_log.jsonl").exists():  # sanity rows are not trained
            curve = [{"step": rec["step"], "val_score": rec["val_score"]} for rec in read_log(r / "train_log.jsonl")]
            _write_csv(Path(out_curves) / f"{r.parent.name}_{r.name}.csv", ["step", "val_score"], curve)


if __name__ == "__main__" and "snakemake" in globals():
    from contextlib import redirect_stderr

    sm = snakemake  # noqa: F821 (the object Snakemake's `script:` directive provides)
    with open(sm.log[0], "w", encoding="utf-8") as log, redirect_stderr(log):
        write_dvc_files(sm.input.csv, sm.input.by_type, sm.params.runs, sm.output.metrics, sm.output.by_type,
                        sm.output.curves)
