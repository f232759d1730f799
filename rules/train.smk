rule train:
    """Train one method with one seed; checkpoint selected on validation CIDEr-D (greedy decoding)."""
    input:
        manifest="results/{dataset}/manifest.jsonl",
        vocab="results/{dataset}/text/vocab.json",
        labels="results/{dataset}/text/labels.h5",
        features=lambda w: f"results/{w.dataset}/features/{method_backbone(w.dataset, w.method)}.h5",
        init=lambda w: init_checkpoint(w.dataset, w.method, w.seed),
    output:
        checkpoint="results/{dataset}/{method}/seed{seed}/checkpoint.pt",
        val="results/{dataset}/{method}/seed{seed}/predictions_val.json",
        run="results/{dataset}/{method}/seed{seed}/run.json",
    wildcard_constraints:
        method="|".join(TRAINED),
    params:
        hp=lambda w: as_json(run_cfg(w.dataset, w.method)),
        init=lambda w, input: f"--init {input.init}" if input.init else "",
    threads: lambda w: devices(w.dataset, w.method)
    priority: lambda w: run_priority(w.dataset, w.method)
    resources:
        gpu=lambda w: GPU_TOKEN * devices(w.dataset, w.method),
        cpu_jobs=lambda w: cpu_jobs(w.dataset, w.method),
        mem_mb=8000,
    log:
        "logs/{dataset}/{method}/seed{seed}/train.log",
    benchmark:
        "logs/benchmarks/{dataset}/{method}/seed{seed}/train.tsv"
    shell:
        "python -m pipeline train --method {wildcards.method} --dataset {wildcards.dataset} --seed {wildcards.seed} "
        "--hparams {params.hp:q} --manifest {input.manifest} --text-dir results/{wildcards.dataset}/text "
        "--features {input.features} --run-dir results/{wildcards.dataset}/{wildcards.method}/seed{wildcards.seed} "
        "{params.init} --threads {threads} > {log} 2>&1"


rule decode_test:
    """Decode the test split once, with the selected checkpoint."""
    input:
        checkpoint="results/{dataset}/{method}/seed{seed}/checkpoint.pt",
        manifest="results/{dataset}/manifest.jsonl",
        vocab="results/{dataset}/text/vocab.json",
        features=lambda w: f"results/{w.dataset}/features/{method_backbone(w.dataset, w.method)}.h5",
    output:
        "results/{dataset}/{method}/seed{seed}/predictions_test.json",
    wildcard_constraints:
        method="|".join(TRAINED),
    threads: 1
    resources:
        gpu=GPU_TOKEN,
    log:
        "logs/{dataset}/{method}/seed{seed}/decode.log",
    shell:
        "python -m pipeline decode --checkpoint {input.checkpoint} --manifest {input.manifest} "
        "--text-dir results/{wildcards.dataset}/text --features {input.features} --split test "
        "--out {output} --threads {threads} > {log} 2>&1"
