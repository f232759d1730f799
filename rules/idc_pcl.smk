# IDC-PCL (shared/seeds/idc-pcl-pretraining-aaai2022.md): pre-training runs (MLM / MVCL / FDA alternated by
# batch), named under `pretraining:` as idc_pcl_pretrain*. Fine-tuning is the generic `train` rule
# (methods with `init_from: idc_pcl_pretrain*`); the ablation of the paper's Table 4 is the named table
# `clevr_change_ablation_idc_pcl` (`snakemake results/tables/clevr_change_ablation_idc_pcl.csv`).
import re
import shlex

IDC_PCL_PRETRAIN = sorted(n for n in config.get("pretraining", {}) if re.fullmatch(r"idc_pcl_pretrain(_\w+)?", n))


def idc_pcl_pretrain_cfg(dataset, name):
    return run_cfg(dataset, name)


def idc_pcl_check_config():
    """A method starting from a pre-training run must have the same architecture (init_from also checks the
    tensors, but this says which config blocks disagree before anything runs)."""
    arch = ("hidden", "heads", "ff", "layers", "single_layers", "pair_layers", "difference_encoder", "cross_cell_bias")
    for d in config["datasets"]:
        for m in config["methods"]:
            init = config["methods"][m].get("init_from")
            if init not in IDC_PCL_PRETRAIN:
                continue
            b, pre = run_cfg(d, m), idc_pcl_pretrain_cfg(d, init)
            diff = [k for k in arch if b["model"].get(k) != pre["model"].get(k)]
            if diff or b["backbone"] != pre["backbone"]:
                on = f" on {d} (with its overrides)" if config["datasets"][d].get("overrides") else ""
                raise WorkflowError(f"config: methods.{m} and pretraining.{init} disagree on "
                                    f"{', '.join(diff or ['backbone'])}{on}: fine-tuning starts from those weights")


idc_pcl_check_config()


def idc_pcl_cross_task_inputs(w):
    """The cross-task data of an expansion run (pipeline/cross_task.py): a GIC dataset's manifest, features
    and (with FDA) its Retrieve/Replace negatives; an FGVC dataset's manifest and features."""
    cfg = idc_pcl_pretrain_cfg(w.dataset, w.name)
    spec, out = cfg.get("cross_task") or {}, {}
    for role in ("gic", "fgvc"):
        if role in spec:
            d = spec[role]
            out[f"{role}_manifest"] = f"results/{d}/manifest.jsonl"
            out[f"{role}_features"] = f"results/{d}/features/{cfg['backbone']}.h5"
    if "gic" in spec and cfg["tasks"].get("fda", 0) > 0:
        out["gic_negatives"] = f"results/{spec['gic']}/text/negatives.jsonl"
    return out


def idc_pcl_cross_task_arg(input):
    paths = {}
    for key in ("gic_manifest", "gic_features", "gic_negatives", "fgvc_manifest", "fgvc_features"):
        if key in input.keys():
            role, what = key.split("_", 1)
            paths.setdefault(role, {})[what] = str(input[key])
    return f"--cross-task {shlex.quote(json.dumps(paths, sort_keys=True))}" if paths else ""


rule pretrain_idc_pcl:
    """IDC-PCL pre-training (resumable); checkpoint.pt holds the weights after the last step."""
    input:
        unpack(idc_pcl_cross_task_inputs),
        manifest="results/{dataset}/manifest.jsonl",
        vocab="results/{dataset}/text/vocab.json",
        labels="results/{dataset}/text/labels.h5",
        features=lambda w: f"results/{w.dataset}/features/{idc_pcl_pretrain_cfg(w.dataset, w.name)['backbone']}.h5",
        negatives=lambda w: (["results/{dataset}/text/negatives.jsonl".format(dataset=w.dataset)]
                             if idc_pcl_pretrain_cfg(w.dataset, w.name)["tasks"].get("fda", 0) > 0 else []),
    output:
        checkpoint="results/{dataset}/{name}/seed{seed}/checkpoint.pt",
        summary="results/{dataset}/{name}/seed{seed}/pretrain.json",
    wildcard_constraints:
        name="|".join(map(re.escape, IDC_PCL_PRETRAIN)) if IDC_PCL_PRETRAIN else "(?!x)x",
    params:
        hp=lambda w: as_json(idc_pcl_pretrain_cfg(w.dataset, w.name)),
        negatives=lambda w, input: f"--negatives {input.negatives}" if input.negatives else "",
        cross=lambda w, input: idc_pcl_cross_task_arg(input),
    threads: lambda w: devices(w.dataset, w.name)
    priority: lambda w: run_priority(w.dataset, w.name)
    resources:
        gpu=lambda w: GPU_TOKEN * devices(w.dataset, w.name),
        cpu_jobs=lambda w: cpu_jobs(w.dataset, w.name),
        mem_mb=8000,
    log:
        "logs/{dataset}/{name}/seed{seed}/pretrain.log",
    benchmark:
        "logs/benchmarks/{dataset}/{name}/seed{seed}/pretrain.tsv"
    shell:
        "python -m pipeline pretrain-idc-pcl --name {wildcards.name} --dataset {wildcards.dataset} "
        "--seed {wildcards.seed} --hparams {params.hp:q} --manifest {input.manifest} "
        "--text-dir results/{wildcards.dataset}/text --features {input.features} {params.negatives} {params.cross} "
        "--run-dir results/{wildcards.dataset}/{wildcards.name}/seed{wildcards.seed} --threads {threads} > {log} 2>&1"
