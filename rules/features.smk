rule extract_features:
    """Backbone features of every image to one HDF5 file (GPU in bf16 when present; resumable)."""
    input:
        manifest="results/{dataset}/manifest.jsonl",
        raw=lambda w: raw_ready(w.dataset),
    output:
        "results/{dataset}/features/{backbone}.h5",
    params:
        root=lambda w: raw_root(w.dataset),
        cfg=lambda w: sorted_cfg(config["features"][w.backbone]),
        shortcut=lambda w: config["features"][w.backbone].get("shortcut", "strided"),
        pool=lambda w: config["features"][w.backbone].get("pool", 0),
    # All the machine's cores: Snakemake scales a rule's threads down to --cores. A constant, not workflow.cores,
    # which is undefined (an error) where no --cores is given: `snakemake --report`, cluster profiles. On a local
    # CPU run, the cores the machine has (CPU_JOB_LIMIT): `--cores 8` on 2 cores otherwise reserved all 8 for one
    # extraction, so the backbones ran one after the other with nothing beside them (~1.4 of 2 cores busy).
    threads: lambda w: CPU_JOB_LIMIT or 64
    priority: lambda w: features_priority(w.dataset, w.backbone)
    resources:
        gpu=GPU_TOKEN,
        mem_mb=8000,
        cpu_jobs=1 if CPU_JOB_LIMIT else 0,  # one of the training lanes (see features_priority)
    log:
        "logs/{dataset}/features_{backbone}.log",
    benchmark:
        "logs/benchmarks/{dataset}/features_{backbone}.tsv"
    shell:
        "python -m pipeline extract-features --manifest {input.manifest} --raw-dir {params.root}/data "
        "--backbone {wildcards.backbone} --weights {params.cfg[weights]} --shortcut {params.shortcut} "
        "--pool {params.pool} "
        "--weights-dir resources/weights "
        "--batch-size {params.cfg[batch_size]} --dtype {params.cfg[dtype]} --image-size {params.cfg[image_size]} "
        "--mean {params.cfg[mean]} --std {params.cfg[std]} --seed {params.cfg[seed]} "
        "--threads {threads} --out {output} > {log} 2>&1"
