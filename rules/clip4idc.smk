# CLIP4IDC and CLIP-FT (shared/seeds/clip4idc-aacl2022.md): the pixel cache they read, the IDC adaptation
# (image-pair <-> text retrieval), its retrieval tables (Table 6), and the intra/inter layer-split sweep
# (Table 7) as the named target `clip4idc_layer_sweep` (not part of `all`).
# Captioning itself runs through the generic `train` / `decode_test` / `evaluate` / `table` rules
# (methods with `backbone: clip_pixels224`, `init_from: clip4idc_adapt` for the adapted ones).
import re

CLIP4IDC_ADAPT = sorted(n for n in config.get("pretraining", {}) if re.fullmatch(r"clip4idc_adapt(_intra\d+_inter\d+)?", n))
CLIP4IDC_SWEEP_RE = r"clip4idc_frozen_intra(\d+)_inter(\d+)"
CLIP4IDC_SWEEP = sorted((m for m in config["methods"] if re.fullmatch(CLIP4IDC_SWEEP_RE, m)),
                        key=lambda m: int(re.fullmatch(CLIP4IDC_SWEEP_RE, m).group(1)))


def _alternatives(names):
    return "|".join(map(re.escape, names)) if names else "(?!x)x"  # never matches when nothing is configured


def clip4idc_sweep():
    """The sweep's methods. A sweep id names its split: the block must say the same, freeze the encoder, and
    start from an adaptation with the same split. Checked only when the sweep is asked for (a --configfile
    merged over config/config.yaml may leave the default's sweep blocks inconsistent, harmlessly)."""
    for m in CLIP4IDC_SWEEP:
        n, k = map(int, re.fullmatch(CLIP4IDC_SWEEP_RE, m).groups())
        hp = config["methods"][m]["model"]
        layers = hp.get("clip", {}).get("vision_layers", 12)
        init = config["methods"][m].get("init_from")
        if hp.get("n_intra", 9) != n or layers - n != k or not hp.get("freeze_encoder", False):
            raise WorkflowError(f"config: methods.{m}: needs model.n_intra: {n} with {n + k} vision layers and "
                                f"freeze_encoder: true (got n_intra {hp.get('n_intra')}, {layers} layers, "
                                f"freeze_encoder {hp.get('freeze_encoder', False)})")
        if init not in CLIP4IDC_ADAPT or config["pretraining"][init]["model"].get("n_intra", 9) != n:
            raise WorkflowError(f"config: methods.{m}: init_from must name a clip4idc_adapt* pretraining block "
                                f"with model.n_intra: {n} (got {init!r})")
    return CLIP4IDC_SWEEP

# The adapted methods' metrics.json carry the adaptation's test retrieval (DESIGN: "retrieval metrics where the
# method has them"); this also makes the adaptation part of every job that scores the method.
for _m, _b in config["methods"].items():
    if _b.get("init_from") in CLIP4IDC_ADAPT:
        EXTRA_METRICS[_m] = {"retrieval": f"results/{{dataset}}/{_b['init_from']}/seed{{seed}}/retrieval_test.json"}


def clip4idc_table_adapts(dataset, methods=None):
    """The adaptation runs that the captioning methods of ``dataset``'s configured tables start from."""
    if methods is None:
        methods = [m for t in config["tables"] for m in table_cfg(t)["methods"] if table_dataset(t) == dataset]
    inits = [config["methods"].get(m, {}).get("init_from") for m in methods]
    return list(dict.fromkeys(i for i in inits if i in CLIP4IDC_ADAPT))


def adapt_run_files(dataset, adapts):
    return [f"results/{dataset}/{a}/seed{s}/{f}" for a in adapts for s in config["seeds"]
            for f in ("run.json", "retrieval_test.json")]


rule cache_pixels:
    """Every image decoded once, resized to 224x224 (bicubic, no crop), stored as uint8 (resumable)."""
    input:
        manifest="results/{dataset}/manifest.jsonl",
        raw=lambda w: raw_ready(w.dataset),
    output:
        "results/{dataset}/features/clip_pixels224.h5",
    params:
        root=lambda w: raw_root(w.dataset),
    threads: 2
    priority: lambda w: features_priority(w.dataset, "clip_pixels224")
    resources:
        cpu_jobs=1 if CPU_JOB_LIMIT else 0,
    log:
        "logs/{dataset}/features_clip_pixels224.log",
    benchmark:
        "logs/benchmarks/{dataset}/features_clip_pixels224.tsv"
    shell:
        "python -m pipeline cache-pixels --manifest {input.manifest} --raw-dir {params.root}/data "
        "--out {output} --workers {threads} --no-progress > {log} 2>&1"


rule clip4idc_adapt:
    """CLIP4IDC adaptation: symmetric InfoNCE between image pairs and change captions; selected on validation
    retrieval, scored once on test."""
    input:
        manifest="results/{dataset}/manifest.jsonl",
        vocab="results/{dataset}/text/vocab.json",
        labels="results/{dataset}/text/labels.h5",
        features="results/{dataset}/features/clip_pixels224.h5",
    output:
        checkpoint="results/{dataset}/{adapt}/seed{seed}/checkpoint.pt",
        val="results/{dataset}/{adapt}/seed{seed}/retrieval_val.json",
        test="results/{dataset}/{adapt}/seed{seed}/retrieval_test.json",
        run="results/{dataset}/{adapt}/seed{seed}/run.json",
    wildcard_constraints:
        adapt=_alternatives(CLIP4IDC_ADAPT),
    params:
        hp=lambda w: as_json(run_cfg(w.dataset, w.adapt)),
    threads: lambda w: devices(w.dataset, w.adapt)
    priority: lambda w: run_priority(w.dataset, w.adapt)
    resources:
        gpu=lambda w: GPU_TOKEN * devices(w.dataset, w.adapt),
        cpu_jobs=lambda w: cpu_jobs(w.dataset, w.adapt),
        mem_mb=12000,
    log:
        "logs/{dataset}/{adapt}/seed{seed}/adapt.log",
    benchmark:
        "logs/benchmarks/{dataset}/{adapt}/seed{seed}/adapt.tsv"
    shell:
        "python -m pipeline adapt-clip4idc --name {wildcards.adapt} --dataset {wildcards.dataset} "
        "--seed {wildcards.seed} --hparams {params.hp:q} --manifest {input.manifest} "
        "--text-dir results/{wildcards.dataset}/text --features {input.features} "
        "--run-dir results/{wildcards.dataset}/{wildcards.adapt}/seed{wildcards.seed} --threads {threads} > {log} 2>&1"


rule clip4idc_retrieval_table:
    """Table 6: test retrieval of the adaptation runs the dataset's captioning tables use."""
    input:
        lambda w: adapt_run_files(w.dataset, clip4idc_table_adapts(w.dataset)),
    output:
        csv="results/tables/{dataset}_retrieval.csv",
        md="results/tables/{dataset}_retrieval.md",
    wildcard_constraints:
        dataset="|".join(config["datasets"]),
    params:
        runs=lambda w: [f"results/{w.dataset}/{a}/seed{s}" for a in clip4idc_table_adapts(w.dataset) for s in config["seeds"]],
    log:
        "logs/tables/{dataset}_retrieval.log",
    shell:
        "python -m pipeline retrieval-table --dataset {wildcards.dataset} --runs {params.runs} "
        "--paper-runs clip4idc_adapt --out {output.csv} > {log} 2>&1"


rule clip4idc_layers_table:
    """Table 7, captioning half: frozen adapted encoders with N_intra / N_inter layers."""
    input:
        metrics=lambda w: [f"results/{w.dataset}/{m}/seed{s}/metrics.json" for m in clip4idc_sweep() for s in config["seeds"]],
        runs=lambda w: [f"results/{w.dataset}/{m}/seed{s}/run.json" for m in CLIP4IDC_SWEEP for s in config["seeds"]],
    output:
        csv="results/tables/{dataset}_layers_clip4idc.csv",
        md="results/tables/{dataset}_layers_clip4idc.md",
        by_type="results/tables/{dataset}_layers_clip4idc_by_type.csv",
        pairs="results/tables/{dataset}_layers_clip4idc_pairs.csv",
    wildcard_constraints:
        dataset="|".join(config["datasets"]),
    params:
        runs=lambda w: [f"results/{w.dataset}/{m}/seed{s}" for m in CLIP4IDC_SWEEP for s in config["seeds"]],
        paper=" ".join(f"clip4idc_frozen_intra{n}_inter{12 - n}" for n in range(6, 13)),
    log:
        "logs/tables/{dataset}_layers_clip4idc.log",
    shell:
        "python -m pipeline table --dataset {wildcards.dataset} --runs {params.runs} "
        "--paper-methods {params.paper} --out {output.csv} > {log} 2>&1"


rule clip4idc_layers_retrieval_table:
    """Table 7, retrieval half: the adaptation runs of the sweep."""
    input:
        lambda w: adapt_run_files(w.dataset, clip4idc_table_adapts(w.dataset, clip4idc_sweep())),
    output:
        csv="results/tables/{dataset}_layers_clip4idc_retrieval.csv",
        md="results/tables/{dataset}_layers_clip4idc_retrieval.md",
    wildcard_constraints:
        dataset="|".join(config["datasets"]),
    params:
        runs=lambda w: [f"results/{w.dataset}/{a}/seed{s}" for a in clip4idc_table_adapts(w.dataset, CLIP4IDC_SWEEP)
                        for s in config["seeds"]],
        paper=" ".join(f"clip4idc_adapt_intra{n}_inter{12 - n}" for n in range(6, 13)),
    log:
        "logs/tables/{dataset}_layers_clip4idc_retrieval.log",
    shell:
        "python -m pipeline retrieval-table --dataset {wildcards.dataset} --runs {params.runs} "
        "--paper-runs {params.paper} --out {output.csv} > {log} 2>&1"


rule clip4idc_layer_sweep:
    """Named target: `snakemake clip4idc_layer_sweep` (the methods clip4idc_frozen_intra{N}_inter{M} in config)."""
    input:
        "results/tables/clevr_change_layers_clip4idc.csv",
        "results/tables/clevr_change_layers_clip4idc_retrieval.csv",
