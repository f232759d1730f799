rule baseline:
    """Sanity rows on the same test split: most frequent training caption; nearest-neighbour retrieval."""
    input:
        manifest="results/{dataset}/manifest.jsonl",
        features=lambda w: f"results/{w.dataset}/features/{sanity_backbone(w.dataset)}.h5",
    output:
        val="results/{dataset}/{method}/seed{seed}/predictions_val.json",
        test="results/{dataset}/{method}/seed{seed}/predictions_test.json",
        run="results/{dataset}/{method}/seed{seed}/run.json",
    wildcard_constraints:
        method="|".join(SANITY),
    log:
        "logs/{dataset}/{method}/seed{seed}/baseline.log",
    shell:
        "python -m pipeline baseline --kind {wildcards.method} --dataset {wildcards.dataset} "
        "--manifest {input.manifest} --features {input.features} --seed {wildcards.seed} "
        "--out-dir results/{wildcards.dataset}/{wildcards.method}/seed{wildcards.seed} > {log} 2>&1"
