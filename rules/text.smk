rule text:
    """Tokenise captions, build the vocabulary on the training split, encode every caption."""
    input:
        "results/{dataset}/manifest.jsonl",
    output:
        vocab="results/{dataset}/text/vocab.json",
        labels="results/{dataset}/text/labels.h5",
    params:
        cfg=lambda w: sorted_cfg({**config["text"], **dataset_cfg(w.dataset).get("text", {})}),
    log:
        "logs/{dataset}/text.log",
    shell:
        "python -m pipeline text --manifest {input} --out-dir results/{wildcards.dataset}/text "
        "--max-words {params.cfg[max_words]} --min-count {params.cfg[min_count]} > {log} 2>&1"
