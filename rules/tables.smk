def table_cfg(table):
    return config["tables"][table]


def table_dataset(table):
    return table_cfg(table).get("dataset", table)


def report_subcategory(wildcards):
    """A table's items are filed under its dataset in the report (rules/report.smk)."""
    return table_dataset(wildcards.table)


def table_runs(table):
    t, ds = table_cfg(table), table_dataset(table)
    runs = [f"results/{ds}/{m}/seed{s}" for m in t["methods"] for s in config["seeds"]]
    return runs + [f"results/{ds}/{m}/seed0" for m in t.get("sanity", [])]  # sanity rows are deterministic


def table_orderings(table):
    """Ablation tables (named *_ablation_*) state whether the paper's ordering of their rows holds here."""
    return "--orderings" if "_ablation_" in table else ""


def table_contrasts(table):
    """`contrasts: [[method, base], ...]`: the Markdown says whether each addition helps here."""
    pairs = table_cfg(table).get("contrasts", [])
    return ("--contrasts " + " ".join(f"{m}:{b}" for m, b in pairs)) if pairs else ""


rule table:
    """A paper table: reproduced rows (mean ± std over seeds), sanity rows, and the papers' numbers; the
    Markdown links the learning curves (rules/plots.smk), which are drawn as part of the table's target."""
    input:
        metrics=lambda w: [f"{r}/metrics.json" for r in table_runs(w.table)],
        runs=lambda w: [f"{r}/run.json" for r in table_runs(w.table)],
        plots=lambda w: table_plots(w.table),
    output:
        csv=report("results/tables/{table}.csv", caption="../workflow/report/table.rst", category="Tables",
                   subcategory=report_subcategory, labels={"table": "{table}", "figure": "table (CSV)"}),
        md="results/tables/{table}.md",
        by_type=report("results/tables/{table}_by_type.csv", caption="../workflow/report/by_type.rst",
                       category="Change types", subcategory=report_subcategory,
                       labels={"table": "{table}", "figure": "CIDEr-D by change type (CSV)"}),
        pairs="results/tables/{table}_pairs.csv",
        meta="results/tables/{table}.meta.json",
    wildcard_constraints:
        table="|".join(config["tables"]),
    params:
        dataset=lambda w: table_dataset(w.table),
        runs=lambda w: table_runs(w.table),
        paper=lambda w: " ".join(table_cfg(w.table)["methods"] + table_cfg(w.table).get("paper_only", [])),
        orderings=lambda w: table_orderings(w.table),
        contrasts=lambda w: table_contrasts(w.table),
    log:
        "logs/tables/{table}.log",
    shell:
        "python -m pipeline table --dataset {params.dataset} --runs {params.runs} "
        "--paper-methods {params.paper} --plots {input.plots} {params.orderings} {params.contrasts} --out {output.csv} "
        "> {log} 2>&1"


rule dvc_files:
    """DVC's view of a table (dvc.yaml's table stages; docs/contracts.md): its scores and every run's metrics.json
    as one metrics file, the per-type scores and every run's validation curve as plot files. Not in `all`."""
    input:
        csv="results/tables/{table}.csv",
        by_type="results/tables/{table}_by_type.csv",
        metrics=lambda w: [f"{r}/metrics.json" for r in table_runs(w.table)],
    output:
        metrics="results/tables/{table}_metrics.json",
        by_type="results/tables/{table}_by_type_plot.csv",
        curves=directory("results/tables/{table}_curves"),
    wildcard_constraints:
        table="|".join(config["tables"]),
    params:
        runs=lambda w: table_runs(w.table),
    log:
        "logs/tables/{table}_dvc_files.log",
    script:
        "../workflow/scripts/dvc_files.py"
