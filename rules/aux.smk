# DUDA trained with the TIRG composed-query retrieval task (shared/seeds/aux-task-duda-tirg-cvpr2021.md §4-5).
# Training, decoding and scoring run through the generic rules; this adds the auxiliary network's retrieval
# recall on the test split, merged into metrics.json as `retrieval` (EXTRA_METRICS in rules/common.smk).

AUX_METHODS = [m for m in ("duda_aux", "duda_aux_easy") if m in config["methods"]]


rule aux_retrieval:
    """Composed-query retrieval (R@1/5/10) of the auxiliary TIRG network, selected checkpoint, test split."""
    input:
        checkpoint="results/{dataset}/{method}/seed{seed}/checkpoint.pt",
        manifest="results/{dataset}/manifest.jsonl",
        vocab="results/{dataset}/text/vocab.json",
        labels="results/{dataset}/text/labels.h5",
        features=lambda w: f"results/{w.dataset}/features/{method_backbone(w.dataset, w.method)}.h5",
    output:
        "results/{dataset}/{method}/seed{seed}/retrieval_test.json",
    wildcard_constraints:
        method="|".join(AUX_METHODS) if AUX_METHODS else "(?!x)x",
    threads: 1
    resources:
        gpu=GPU_TOKEN,
    log:
        "logs/{dataset}/{method}/seed{seed}/aux_retrieval.log",
    shell:
        "python -m pipeline aux-retrieval --checkpoint {input.checkpoint} --manifest {input.manifest} "
        "--text-dir results/{wildcards.dataset}/text --features {input.features} --split test "
        "--out {output} --threads {threads} > {log} 2>&1"
