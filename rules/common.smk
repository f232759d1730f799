import json
import shutil

from pipeline.config import run_config, validate as validate_config
from pipeline.errors import PipelineError
from pipeline.utils.cores import available_cores
from pipeline.utils.scheduling import expected_ms

try:
    validate_config(config, source="config")
except PipelineError as e:
    raise WorkflowError(str(e)) from None

TRAINED = sorted(config["methods"])

# GPU rules take a `gpu` token only where a GPU is (profiles/default holds one: two such rules never share a
# card). On a CPU-only machine they take none, and the training jobs, one thread each (`threads: 1`; raise
# with `--set-threads train=N`), run side by side: small CPU-sized models use two cores better as two jobs
# than as two threads of one job.
# A cluster's submit node may have no GPU while its jobs run on GPU nodes: `gpu_jobs: true` (profiles/slurm).
GPU_TOKEN = 1 if config.get("gpu_jobs", shutil.which("nvidia-smi") is not None) else 0
# A training run with `train.devices: N` takes N tokens (N GPUs) there, and N threads (N processes of one thread
# each) on a CPU.
SANITY = ["most_frequent", "nearest_neighbour"]


wildcard_constraints:
    dataset="|".join(config["datasets"]),
    seed=r"\d+",
    backbone="|".join(config["features"]),


def dataset_cfg(dataset):
    return config["datasets"][dataset]


def raw_root(dataset):
    return f"resources/raw/{dataset}/{dataset_cfg(dataset)['source']}"


def raw_ready(dataset):
    """The file or folder whose existence means the raw data is complete and verified."""
    if dataset_cfg(dataset)["source"] == "synthetic":
        return raw_root(dataset)
    return f"{raw_root(dataset)}/verified.json"


def sorted_cfg(d):
    """A config block with sorted keys: rule params are compared by their text, so reordering keys in a
    config file (or rewriting it with a YAML dumper) must not look like a change."""
    return {k: sorted_cfg(v) if isinstance(v, dict) else v for k, v in sorted(d.items())}


def as_json(obj):
    # Params are compared between runs: changing a hyper-parameter re-runs exactly the rules using it.
    return json.dumps(obj, sort_keys=True)


def run_cfg(dataset, name):
    """A method's (or first-stage run's) block on ``dataset``: its per-dataset overrides merged in."""
    return run_config(config, dataset, name)


def devices(dataset, name):
    """`train.devices` of a training run (method, pre-training or adaptation): its number of processes, which the
    stage starts itself under torchrun inside this one job (`pipeline.distributed.relaunch`)."""
    return int(run_cfg(dataset, name)["train"].get("devices", 1))


# Local CPU runs: at most nproc training processes at once (the `cpu_jobs` resource). `--cores` above the
# machine's own (the README's `--cores 8` on a 2-core laptop) would otherwise start up to eight one-thread
# training jobs on two cores: measured, six DUDA runs side by side on two cores used 9 % more CPU each than two at
# a time. With the limit, `run_priority` starts the longest chains first, so the last to end are short runs.
# No limit on a cluster (jobs run elsewhere) or where a GPU is (the gpu token orders them); `--resources
# cpu_jobs=N` on the command line sets another. (`register_resource` is how Snakemake adds a global resource
# itself, e.g. for its pipe groups.)
def _cpu_job_limit():
    try:
        local = workflow.local_exec
    except AttributeError:  # a Snakemake without it: no limit rather than a wrong one
        return 0
    return available_cores() if local and not GPU_TOKEN else 0


CPU_JOB_LIMIT = _cpu_job_limit()
if CPU_JOB_LIMIT and "cpu_jobs" not in workflow.global_resources:
    workflow.register_resource("cpu_jobs", CPU_JOB_LIMIT)


def cpu_jobs(dataset, name):
    """The `cpu_jobs` a training run (method, pre-training or adaptation) takes: its processes, where limited
    (at most the limit: a job asking for more than there is would never start)."""
    return min(devices(dataset, name), CPU_JOB_LIMIT)


def run_cost(dataset, name):
    """A training run's expected length: its samples (iterations x batch) times its method's measured
    milliseconds per sample (pipeline/utils/scheduling.py), the scheduler's proxy."""
    t = run_cfg(dataset, name)["train"]
    return expected_ms(int(t.get("iterations", 0)), int(t.get("batch_size", 1)), name)


def run_priority(dataset, name):
    """Longest chain first (LPT order on the slots): a first-stage run (pre-training, adaptation) counts the
    longest method that starts from it, so the chain's second half does not start last."""
    after = [run_cost(dataset, m) for m, b in config["methods"].items() if b.get("init_from") == name]
    return run_cost(dataset, name) + max(after, default=0)


def features_priority(dataset, backbone):
    """A feature file's priority: the longest chain that reads it (`run_priority`; a first-stage run without a
    backbone of its own reads what the methods starting from it read). The extraction that the longest chain
    waits for then starts first: in the 2-core Xeon's main job of da4bdcc, when extraction took no lane, the CLIP
    jobs took both lanes and IDC-PCL's pre-training, at the head of the longest chain, started 8 minutes in
    (4 with this, docs/measurements.md)."""
    def reads(name):
        own = run_cfg(dataset, name).get("backbone")
        if own:
            return {own}
        return {run_cfg(dataset, m).get("backbone") for m, b in config["methods"].items() if b.get("init_from") == name}

    names = list(config["methods"]) + list(config.get("pretraining") or {})
    return max((run_priority(dataset, n) for n in names if backbone in reads(n)), default=0)


def method_backbone(dataset, method):
    return run_cfg(dataset, method)["backbone"]


def init_checkpoint(dataset, method, seed):
    """A method with ``init_from: <name>`` starts from ``results/<dataset>/<name>/seed<k>/checkpoint.pt``,
    the output of a first-stage rule (pre-training, adaptation) named in ``config['pretraining']``."""
    name = config["methods"][method].get("init_from")
    return [f"results/{dataset}/{name}/seed{seed}/checkpoint.pt"] if name else []


def sanity_backbone(dataset):
    for t in config["tables"].values():
        if t.get("dataset", dataset) == dataset and "sanity_backbone" in t:
            return t["sanity_backbone"]
    return "resnet101_layer3"


# Method-specific metrics merged into metrics.json by `evaluate`: method id -> {name: path pattern}
# (patterns use {dataset}, {method}, {seed}). Rules of two-network methods register theirs here,
# e.g. EXTRA_METRICS["duda_aux"] = {"retrieval": "results/{dataset}/{method}/seed{seed}/retrieval_test.json"}.
EXTRA_METRICS = {}
# DUDA + TIRG auxiliary task (rules/aux.smk): retrieval recall of the auxiliary network on the test split.
EXTRA_METRICS["duda_aux"] = {"retrieval": "results/{dataset}/{method}/seed{seed}/retrieval_test.json"}
EXTRA_METRICS["duda_aux_easy"] = {"retrieval": "results/{dataset}/{method}/seed{seed}/retrieval_test.json"}


def extra_metrics(w):
    pats = EXTRA_METRICS.get(w.method, {})
    return {k: v.format(dataset=w.dataset, method=w.method, seed=w.seed) for k, v in pats.items()}
