# FDA hard negatives of IDC-PCL (pipeline/negatives.py): retrieve / replace / confuse, 6 per caption,
# for the train and val splits of any dataset. The POS tagger is stanza (models placed under
# resources/stanza by `stanza_models`) or, for synthetic data, the synthetic world's own lexicon.


def negatives_cfg():
    return config.get("negatives", {})


def negatives_tagger(dataset):
    """``negatives.tagger`` when set; otherwise the lexicon for synthetic data and stanza for official data."""
    default = "lexicon" if dataset_cfg(dataset)["source"] == "synthetic" else "stanza"
    return negatives_cfg().get("tagger", default)


def stanza_dir():
    return negatives_cfg().get("stanza_dir", "resources/stanza")


localrules:
    stanza_models,


rule stanza_models:
    """stanza's English tokenize,pos models (one download rule: parallel downloads corrupt resources.json).
    Where the host cannot be reached it stops with a message saying what to place where."""
    output:
        f"{stanza_dir()}/resources.json",
    params:
        dir=stanza_dir(),
    log:
        "logs/stanza_models.log",
    shell:
        "python -m pipeline stanza-models --dir {params.dir} > {log} 2>&1 || (tail -n 1 {log} >&2; exit 1)"


rule negatives:
    """Hard negative captions for FDA, with the appendix's Table 7 statistics and Table 8 vocabularies."""
    input:
        manifest="results/{dataset}/manifest.jsonl",
        tagger=lambda w: [f"{stanza_dir()}/resources.json"] if negatives_tagger(w.dataset) == "stanza" else [],
    output:
        negatives="results/{dataset}/text/negatives.jsonl",
        stats="results/{dataset}/text/negatives_stats.json",
    params:
        tagger=lambda w: negatives_tagger(w.dataset),
        per_kind=lambda w: " ".join(map(str, negatives_cfg().get("per_kind", [2, 2, 2]))),
        fraction=lambda w: negatives_cfg().get("replace_fraction", 0.5),
        min_df=lambda w: negatives_cfg().get("min_df", 10),
        seed=lambda w: negatives_cfg().get("seed", 0),
        stanza_dir=lambda w: stanza_dir(),
    threads: 2
    log:
        "logs/{dataset}/negatives.log",
    benchmark:
        "logs/benchmarks/{dataset}/negatives.tsv"
    shell:
        "python -m pipeline negatives --manifest {input.manifest} --dataset {wildcards.dataset} "
        "--out {output.negatives} --stats {output.stats} --tagger {params.tagger} --stanza-dir {params.stanza_dir} "
        "--per-kind {params.per_kind} --replace-fraction {params.fraction} --min-df {params.min_df} "
        "--seed {params.seed} > {log} 2>&1"
