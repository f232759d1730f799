# The HTML report: `snakemake --report report.html [target]` gathers every output marked `report(...)` in the
# target's DAG (the default target: all tables), captions in workflow/report/*.rst. Per table:
#   learning curves     rules/plots.smk (per method, and the table's validation CIDEr-D)
#   the table           rules/tables.smk marks its CSVs; report_table_page renders them with their notes
#   report_by_type      bar chart of CIDEr-D per change type, from <table>_by_type.csv
#   report_qualitative  a few test pairs: images, ground truth, each method's caption, attention maps
#   report_items        results/report/<table>/items.txt: the target that draws all of the above
# The drawing glue is in workflow/scripts/; the attention maps come from pipeline/attention_maps.py.

from pipeline.models import attention_kind

QUALITATIVE_PAIRS = 4


def report_figures(table):
    return [f"results/report/{table}/{name}" for name in ("table.html", "by_type.png", "qualitative.png")]


def qualitative_runs(table):
    """The table's methods' first-seed runs; those with attention maps also need their checkpoint and features."""
    ds, seed = table_dataset(table), config["seeds"][0]
    return {m: f"results/{ds}/{m}/seed{seed}" for m in table_cfg(table)["methods"]}


def qualitative_attention(table):
    ds = table_dataset(table)
    return {m: {"checkpoint": f"{run}/checkpoint.pt", "features": f"results/{ds}/features/{method_backbone(ds, m)}.h5"}
            for m, run in qualitative_runs(table).items() if attention_kind(m)}


def qualitative_inputs(wildcards):
    ds = table_dataset(wildcards.table)
    runs = qualitative_runs(wildcards.table)
    return {
        "manifest": f"results/{ds}/manifest.jsonl",
        "vocab": f"results/{ds}/text/vocab.json",
        "raw": raw_ready(ds),
        "predictions": [f"{r}/predictions_test.json" for r in runs.values()],
        "attention": [f for a in qualitative_attention(wildcards.table).values() for f in a.values()],
    }


rule report_table_page:
    """The table's CSVs (whole split, by change type, changed / distractor pairs) and notes as one HTML page."""
    input:
        csv="results/tables/{table}.csv",
        by_type="results/tables/{table}_by_type.csv",
        pairs="results/tables/{table}_pairs.csv",
        meta="results/tables/{table}.meta.json",
    output:
        report("results/report/{table}/table.html", caption="../workflow/report/table.rst", category="Tables",
               subcategory=report_subcategory, labels={"table": "{table}", "figure": "table (HTML)"}),
    wildcard_constraints:
        table="|".join(config["tables"]),
    log:
        "logs/report/{table}/table_page.log",
    script:
        "../workflow/scripts/table_page.py"


rule report_by_type:
    """Bar chart of CIDEr-D per change type, one bar per row of the table's _by_type.csv."""
    input:
        by_type="results/tables/{table}_by_type.csv",
    output:
        report("results/report/{table}/by_type.png", caption="../workflow/report/by_type.rst",
               category="Change types", subcategory=report_subcategory,
               labels={"table": "{table}", "figure": "CIDEr-D by change type"}),
    wildcard_constraints:
        table="|".join(config["tables"]),
    log:
        "logs/report/{table}/by_type.log",
    script:
        "../workflow/scripts/by_type_bars.py"


rule report_qualitative:
    """A few test pairs with the ground truth, each method's caption and the attention maps of DUDA, SCORER, DIRL."""
    input:
        unpack(qualitative_inputs),
    output:
        report("results/report/{table}/qualitative.png", caption="../workflow/report/qualitative.rst",
               category="Qualitative", subcategory=report_subcategory,
               labels={"table": "{table}", "figure": "test pairs and attention"}),
    wildcard_constraints:
        table="|".join(config["tables"]),
    params:
        methods=lambda w: list(qualitative_runs(w.table)),
        attention=lambda w: qualitative_attention(w.table),
        raw_data=lambda w: f"{raw_root(table_dataset(w.table))}/data",
        n_pairs=QUALITATIVE_PAIRS,
    threads: 1
    log:
        "logs/report/{table}/qualitative.log",
    script:
        "../workflow/scripts/qualitative.py"


rule report_items:
    """Everything the report shows for a table: `snakemake --report report.html results/report/<table>/items.txt`."""
    input:
        table="results/tables/{table}.csv",
        plots=lambda w: table_plots(w.table),
        figures=lambda w: report_figures(w.table),
    output:
        "results/report/{table}/items.txt",
    wildcard_constraints:
        table="|".join(config["tables"]),
    run:
        with open(output[0], "w") as f:
            f.write("".join(f"{name}\n" for name in input))
