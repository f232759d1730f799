rule evaluate:
    """Score test predictions: total, semantic, distractor, and per change type both ways."""
    input:
        manifest="results/{dataset}/manifest.jsonl",
        predictions="results/{dataset}/{method}/seed{seed}/predictions_test.json",
        extra=lambda w: list(extra_metrics(w).values()),
    output:
        "results/{dataset}/{method}/seed{seed}/metrics.json",
    params:
        extra=lambda w: " ".join(f"--extra {k}={v}" for k, v in extra_metrics(w).items()),
        spice=lambda w: f"--spice-jars {config['evaluation']['spice_jars']}" if config["evaluation"].get("spice_jars") else "",
    log:
        "logs/{dataset}/{method}/seed{seed}/evaluate.log",
    shell:
        "python -m pipeline evaluate --manifest {input.manifest} --predictions {input.predictions} --split test "
        "--out {output} {params.spice} {params.extra} > {log} 2>&1"
