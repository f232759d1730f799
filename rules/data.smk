rule synth_clevr_change:
    """Render the synthetic CLEVR-Change world in the official layout (resumable; see pipeline/synth)."""
    output:
        directory("resources/raw/clevr_change/synthetic"),
    params:
        cfg=lambda w: sorted_cfg(dataset_cfg("clevr_change")["synthetic"]),
    threads: lambda w: dataset_cfg("clevr_change")["synthetic"].get("workers", 1)
    log:
        "logs/clevr_change/synth.log",
    benchmark:
        "logs/benchmarks/clevr_change/synth.tsv"
    shell:
        "python -m pipeline synth-clevr-change --out {output} --n-indices {params.cfg[n_indices]} "
        "--seed {params.cfg[seed]} --split-fractions {params.cfg[split_fractions]} --workers {threads} "
        "> {log} 2>&1"


rule synth_clevr_dc:
    """Render the synthetic CLEVR-DC world in the release's layout (resumable; see pipeline/synth)."""
    output:
        directory("resources/raw/clevr_dc/synthetic"),
    params:
        cfg=lambda w: sorted_cfg(dataset_cfg("clevr_dc")["synthetic"]),
    threads: lambda w: dataset_cfg("clevr_dc")["synthetic"].get("workers", 1)
    log:
        "logs/clevr_dc/synth.log",
    benchmark:
        "logs/benchmarks/clevr_dc/synth.tsv"
    shell:
        "python -m pipeline synth-clevr-dc --out {output} --per-block {params.cfg[per_block]} "
        "--seed {params.cfg[seed]} --workers {threads} --no-progress > {log} 2>&1"


rule synth_spot_the_diff:
    """Render the synthetic Spot-the-Diff world (a parking lot) in the release's layout (resumable)."""
    output:
        directory("resources/raw/spot_the_diff/synthetic"),
    params:
        cfg=lambda w: sorted_cfg({"size": 224, "split_fractions": [0.76, 0.13, 0.11],
                                  **dataset_cfg("spot_the_diff")["synthetic"]}),
    threads: lambda w: dataset_cfg("spot_the_diff")["synthetic"].get("workers", 1)
    log:
        "logs/spot_the_diff/synth.log",
    benchmark:
        "logs/benchmarks/spot_the_diff/synth.tsv"
    shell:
        "python -m pipeline synth-spot-the-diff --out {output} --n-pairs {params.cfg[n_pairs]} "
        "--seed {params.cfg[seed]} --split-fractions {params.cfg[split_fractions]} "
        "--size {params.cfg[size]} --workers {threads} --no-progress > {log} 2>&1"


rule synth_image_editing_request:
    """Render the synthetic Image Editing Request world (procedural photos and their edits) in the release's layout."""
    output:
        directory("resources/raw/image_editing_request/synthetic"),
    params:
        cfg=lambda w: sorted_cfg({"size": 224, "split_fractions": [0.78, 0.10, 0.12],
                                  **dataset_cfg("image_editing_request")["synthetic"]}),
    threads: lambda w: dataset_cfg("image_editing_request")["synthetic"].get("workers", 1)
    log:
        "logs/image_editing_request/synth.log",
    benchmark:
        "logs/benchmarks/image_editing_request/synth.tsv"
    shell:
        "python -m pipeline synth-image-editing-request --out {output} --n-pairs {params.cfg[n_pairs]} "
        "--seed {params.cfg[seed]} --split-fractions {params.cfg[split_fractions]} "
        "--size {params.cfg[size]} --workers {threads} --no-progress > {log} 2>&1"


rule synth_birds_to_words:
    """Render the synthetic Birds-to-Words world (procedural birds compared in pairs) in the release's layout."""
    output:
        directory("resources/raw/birds_to_words/synthetic"),
    params:
        cfg=lambda w: sorted_cfg({"size": 224, "split_fractions": [0.8, 0.1, 0.1],
                                  **dataset_cfg("birds_to_words")["synthetic"]}),
    threads: lambda w: dataset_cfg("birds_to_words")["synthetic"].get("workers", 1)
    log:
        "logs/birds_to_words/synth.log",
    benchmark:
        "logs/benchmarks/birds_to_words/synth.tsv"
    shell:
        "python -m pipeline synth-birds-to-words --out {output} --n-pairs {params.cfg[n_pairs]} "
        "--seed {params.cfg[seed]} --split-fractions {params.cfg[split_fractions]} "
        "--size {params.cfg[size]} --workers {threads} --no-progress > {log} 2>&1"


rule synth_cub:
    """Render the synthetic CUB-200-2011 world (single images, 10 captions each, L2C class-disjoint split)."""
    output:
        directory("resources/raw/cub/synthetic"),
    params:
        cfg=lambda w: sorted_cfg({"size": 224, "n_species": 40, **dataset_cfg("cub")["synthetic"]}),
    threads: lambda w: dataset_cfg("cub")["synthetic"].get("workers", 1)
    log:
        "logs/cub/synth.log",
    benchmark:
        "logs/benchmarks/cub/synth.tsv"
    shell:
        "python -m pipeline synth-cub --out {output} --n-images {params.cfg[n_images]} "
        "--n-species {params.cfg[n_species]} --seed {params.cfg[seed]} --size {params.cfg[size]} "
        "--workers {threads} --no-progress > {log} 2>&1"


rule synth_nabirds:
    """Render the synthetic NABirds world (single images, hierarchical non-contiguous class ids)."""
    output:
        directory("resources/raw/nabirds/synthetic"),
    params:
        cfg=lambda w: sorted_cfg({"size": 224, **dataset_cfg("nabirds")["synthetic"]}),
    threads: lambda w: dataset_cfg("nabirds")["synthetic"].get("workers", 1)
    log:
        "logs/nabirds/synth.log",
    benchmark:
        "logs/benchmarks/nabirds/synth.tsv"
    shell:
        "python -m pipeline synth-nabirds --out {output} --n-images {params.cfg[n_images]} "
        "--seed {params.cfg[seed]} --size {params.cfg[size]} --workers {threads} --no-progress > {log} 2>&1"


rule fetch_official:
    """Download the official release, or verify a copy placed by hand (message says what goes where)."""
    output:
        "resources/raw/{dataset}/official/verified.json",
    params:
        flag=lambda w: "" if dataset_cfg(w.dataset).get("official", {}).get("download", True) else "--no-download",
    log:
        "logs/{dataset}/fetch.log",
    shell:
        "python -m pipeline fetch --dataset {wildcards.dataset} --root resources/raw/{wildcards.dataset}/official "
        "{params.flag} > {log} 2>&1"


rule manifest:
    """Parse the official layout (either source) into one normalised record per image pair."""
    input:
        lambda w: raw_ready(w.dataset),
    output:
        "results/{dataset}/manifest.jsonl",
    params:
        root=lambda w: raw_root(w.dataset),
        source=lambda w: dataset_cfg(w.dataset)["source"],
    log:
        "logs/{dataset}/manifest.log",
    shell:
        "python -m pipeline manifest --dataset {wildcards.dataset} --raw-dir {params.root}/data "
        "--source {params.source} --out {output} > {log} 2>&1"
