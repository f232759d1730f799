"""A table as an HTML page for the report (rule `report_table_page`): the table's CSVs (whole split, by change
type, changed / distractor pairs) under their titles, and the notes of its ``.meta.json`` sidecar."""

import html
import sys

import pandas as pd

from pipeline.utils.io import read_json

STYLE = ("body{font-family:sans-serif;font-size:13px;margin:1em} table{border-collapse:collapse;margin-bottom:1.5em}"
         "th,td{border:1px solid #bbb;padding:2px 6px;text-align:right} th{background:#eee}")


def page(table: str, csvs: list[str], meta: str) -> str:
    m = read_json(meta)
    parts = [f"<h2>{html.escape(table)}: {html.escape(m.get('dataset_name', m.get('dataset', '')))}</h2>"]
    if m.get("preamble"):
        parts.append(f"<p>{html.escape(m['preamble'])}</p>")
    for csv in csvs:
        name = csv.rsplit("/", 1)[-1]
        title = html.escape(m.get("tables", {}).get(name, name))
        parts.append(f"<h3>{title} <small>({html.escape(name)})</small></h3>")
        parts.append(pd.read_csv(csv, dtype=str).fillna("").to_html(index=False, border=0))
    parts.append("<h3>Notes</h3><ol>" + "".join(f"<li value='{k}'>{html.escape(v)}</li>"
                                                 for k, v in m.get("notes", {}).items()) + "</ol>")
    for o in m.get("orderings", []):
        parts.append(f"<p>{html.escape(o.get('statement', ''))}</p>")
    head = f"<!doctype html><html><head><meta charset='utf-8'><style>{STYLE}</style></head>"
    return f"{head}<body>{''.join(parts)}</body></html>"


if __name__ == "__main__":
    sm = snakemake  # noqa: F821 - injected by Snakemake's script directive
    sys.stdout = sys.stderr = open(sm.log[0], "w")  # noqa: SIM115 - the rule's log, for the whole script
    with open(sm.output[0], "w", encoding="utf-8") as f:
        f.write(page(sm.wildcards.table, [sm.input.csv, sm.input.by_type, sm.input.pairs], sm.input.meta))
