"""profiles/slurm on a real single-node SLURM cluster (issue 17): scripts/slurm_single_node.sh starts munged,
slurmctld and slurmd on this machine, the tiny table's DAG runs through `--workflow-profile profiles/slurm` with
every job submitted by sbatch, and its table equals the one a local run of the same tree writes."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests.test_dvc import TINY_TABLE
from tests.test_workflow import ROOT, TEST_CONFIG

SCRIPT = ROOT / "scripts" / "slurm_single_node.sh"
PARTITION = "idc_test"
TARGET = "results/tables/clevr_change.csv"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

pytestmark = pytest.mark.slow


def cannot_run_here() -> str | None:
    if os.geteuid() != 0:
        return "a SLURM cluster needs root (slurmd starts jobs as their user; apt-get installs SLURM)"
    if not shutil.which("slurmd") and not shutil.which("apt-get"):
        return "no SLURM binaries and no apt-get to install slurm-wlm and munge"
    return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = cannot_run_here()
    if reason:
        pytest.skip(reason)
    d = tmp_path_factory.mktemp("slurm_cluster")
    p = subprocess.run(["bash", SCRIPT, "start", d, PARTITION], capture_output=True, text=True)
    # 3: no root, apt-get or packages on this machine; 4: it has another SLURM's slurm.conf (left untouched)
    if p.returncode in (3, 4):
        pytest.skip(p.stderr.strip())
    try:
        assert p.returncode == 0, f"cluster did not start:\n{p.stdout}\n{p.stderr}"
        yield d
    finally:
        subprocess.run(["bash", SCRIPT, "stop", d], capture_output=True, text=True)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """The repository's files with the tiny configuration and one tiny table written over config/config.yaml,
    which is how a cluster run picks a configuration (README: cluster jobs do not get --replace-workflow-config)."""
    d = tmp_path_factory.mktemp("slurm_tree")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for f in filter(None, listed):
        if (ROOT / f).is_file():
            (d / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, d / f)
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    cfg["tables"] = {"clevr_change": TINY_TABLE}
    (d / "config/config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return d


def cluster_overlay(profile: dict) -> list[str]:
    """Command-line settings that fit profiles/slurm to the one test node: its partition, one CPU and 1 GB for
    every job and no GPU (the node has neither GPUs nor 8 CPUs), job status from squeue (no slurmdbd, hence no
    sacct) and no account (no accounting). They replace the profile's resource entries for the rules it names;
    everything else (executor, jobs, cores, latency-wait, ...) is the profile's."""
    small = {"slurm_partition": PARTITION, "cpus_per_task": 1, "mem_mb": 1000, "runtime": 30}
    per_rule = [f"{rule}:{k}={v}" for rule in profile["set-resources"] for k, v in {**small, "gpu": 0}.items()]
    return ["--default-resources", *(f"{k}={v}" for k, v in small.items()), "--set-resources", *per_rule,
            "--set-threads", *(f"{rule}=1" for rule in profile["set-threads"]),
            "--slurm-status-command", "squeue", "--slurm-no-account",
            "--slurm-init-seconds-before-status-checks", "2", "--slurm-keep-successful-logs"]


@pytest.fixture(scope="module")
def runs(cluster, tree, tmp_path_factory):
    """The tiny table built locally and through SLURM, side by side (the SLURM run mostly waits on status polls)."""
    local, cl = tmp_path_factory.mktemp("local_run"), tmp_path_factory.mktemp("slurm_run")
    smk = [sys.executable, "-m", "snakemake", "-s", str(tree / "Snakefile")]
    profile = yaml.safe_load((tree / "profiles/slurm/config.yaml").read_text())
    t0 = time.monotonic()
    loc = subprocess.Popen([*smk, "--directory", str(local), "--cores", "1", TARGET], env=ENV, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        # a hang (say, a status command that never sees a job end) fails here; the cluster fixture cancels its jobs
        slurm = subprocess.run([*smk, "--directory", str(cl), "--workflow-profile", str(tree / "profiles/slurm"),
                                *cluster_overlay(profile), TARGET],
                               env={**ENV, "SLURM_CONF": str(cluster / "slurm.conf")},
                               capture_output=True, text=True, timeout=600)
        loc_out = loc.communicate(timeout=600)[0]
    finally:
        if loc.poll() is None:
            loc.kill()
            loc.wait()
    print(f"SLURM run {time.monotonic() - t0:.0f} s")
    assert loc.returncode == 0, f"local run failed:\n{loc_out[-4000:]}"
    assert slurm.returncode == 0, f"SLURM run failed:\n{slurm.stdout[-3000:]}\n{slurm.stderr[-5000:]}"
    return {"local": local, "slurm": cl, "local_log": loc_out, "slurm_log": slurm.stdout + slurm.stderr}


def test_every_job_of_the_dag_went_through_sbatch_on_the_cluster(runs, cluster):
    """One SLURM log per job under the plugin's .snakemake/slurm_logs/rule_<rule>/, for exactly the jobs the local
    run executed, named by the ids of batch jobs that this cluster's controller received, started in the test
    partition and saw end with exit code 0, and no other job."""
    local_rules = re.findall(r"^localrule (\w+):", runs["local_log"], flags=re.M)
    assert "train" in local_rules and "table" in local_rules
    assert not re.search(r"^localrule ", runs["slurm_log"], flags=re.M)  # nothing ran on the submitting host
    logs = sorted((runs["slurm"] / ".snakemake/slurm_logs").rglob("*.log"))
    by_rule = {}
    for log in logs:
        rule = next(p.name for p in log.parents if p.name.startswith("rule_")).removeprefix("rule_")
        by_rule.setdefault(rule, []).append(int(log.stem))
        assert f"rule {rule}:" in log.read_text()  # the job step ran that rule
    assert {r: len(ids) for r, ids in by_rule.items()} == {r: local_rules.count(r) for r in set(local_rules)}
    ctld = (cluster / "log/slurmctld.log").read_text()
    job_ids = sorted(i for ids in by_rule.values() for i in ids)
    assert sorted(map(int, re.findall(r"_slurm_rpc_submit_batch_job: JobId=(\d+) ", ctld))) == job_ids
    for i in job_ids:
        # started by the main scheduler or by backfill, which log it differently
        assert re.search(rf"sched: Allocate JobId={i} NodeList=\S+ #CPUs=\d+ Partition={PARTITION}\n"
                         rf"|_start_job: Started JobId={i} in {PARTITION} on ", ctld), i
        assert re.search(rf"_job_complete: JobId={i} WEXITSTATUS 0\n", ctld), i


def test_the_slurm_table_equals_the_local_table(runs):
    local = pd.read_csv(runs["local"] / TARGET)
    cluster = pd.read_csv(runs["slurm"] / TARGET)
    assert {"duda", "most_frequent"} <= set(cluster["method"])
    pd.testing.assert_frame_equal(cluster, local)


def test_the_cluster_stops_and_leaves_nothing_running(cluster, runs):
    """Stopping (also what the fixture does at the end) ends the daemons and frees the default slurm.conf path."""
    pids = [int((cluster / f"{d}.pid").read_text()) for d in ("munged", "slurmctld", "slurmd")]
    subprocess.run(["bash", SCRIPT, "stop", cluster], check=True, capture_output=True)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower(), pid
    assert not Path("/etc/slurm/slurm.conf").is_symlink()
