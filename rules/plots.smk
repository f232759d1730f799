# Learning curves (pipeline/plots.py) from every run's train_log.jsonl: one figure per trained method (its
# first stage, pre-training or adaptation, as its own row of panels) and one figure per table with all its
# methods' validation CIDEr-D and the sanity rows as reference lines. The table rule takes them as input, so
# `snakemake results/tables/<table>.csv` draws them; the Markdown tables link them.


def plot_method_runs(dataset, method):
    return [f"results/{dataset}/{method}/seed{s}" for s in config["seeds"]]


def plot_first_stage_runs(dataset, method):
    name = config["methods"][method].get("init_from")
    return [f"results/{dataset}/{name}/seed{s}" for s in config["seeds"]] if name else []


def table_plots(table):
    """The figures a table links: its methods' learning curves and the table's validation CIDEr-D figure."""
    ds = table_dataset(table)
    return [f"results/{ds}/plots/{m}.png" for m in table_cfg(table)["methods"]] + [f"results/{ds}/plots/{table}_val_cider.png"]


rule plot_method:
    """Train losses per component, validation score and selected step of a method's runs (and of its first stage)."""
    input:
        runs=lambda w: [f"{r}/run.json" for r in plot_method_runs(w.dataset, w.method)],
        first_stage=lambda w: [f"{r}/checkpoint.pt" for r in plot_first_stage_runs(w.dataset, w.method)],
    output:
        report("results/{dataset}/plots/{method}.png", caption="../workflow/report/learning_curves.rst",
               category="Learning curves", subcategory="{dataset}"),
    wildcard_constraints:
        method="|".join(TRAINED),
    params:
        runs=lambda w: plot_method_runs(w.dataset, w.method),
        first=lambda w: " ".join(plot_first_stage_runs(w.dataset, w.method)),
    log:
        "logs/{dataset}/plots/{method}.log",
    shell:
        "python -m pipeline plots --method {wildcards.method} --runs {params.runs} --first-stage {params.first} "
        "--out {output} > {log} 2>&1"


rule plot_table:
    """Validation CIDEr-D vs step of all the table's methods, sanity rows as horizontal lines."""
    input:
        runs=lambda w: [f"{r}/run.json" for m in table_cfg(w.table)["methods"] for r in plot_method_runs(w.dataset, m)],
        sanity=lambda w: [f"results/{w.dataset}/{m}/seed0/predictions_val.json" for m in table_cfg(w.table).get("sanity", [])],
        manifest="results/{dataset}/manifest.jsonl",
    output:
        report("results/{dataset}/plots/{table}_val_cider.png", caption="../workflow/report/learning_curves.rst",
               category="Learning curves", subcategory="{dataset}"),
    wildcard_constraints:
        table="|".join(config["tables"]),
    params:
        runs=lambda w: [r for m in table_cfg(w.table)["methods"] for r in plot_method_runs(w.dataset, m)],
        sanity=lambda w: " ".join(f"results/{w.dataset}/{m}/seed0" for m in table_cfg(w.table).get("sanity", [])),
    log:
        "logs/{dataset}/plots/{table}_val_cider.log",
    shell:
        "python -m pipeline plots --table {wildcards.table} --runs {params.runs} --sanity {params.sanity} "
        "--manifest {input.manifest} --out {output} > {log} 2>&1"
