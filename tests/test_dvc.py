"""DVC over the Snakemake DAG (dvc.yaml, issue 17): stages generated from config/config.yaml, one table reproduced by
`dvc repro` in a git + DVC temporary copy on the tiny configuration, its metrics and plots, a push / pull round trip
through a local-directory remote, and Snakemake planning no job after the pull (README, "With DVC")."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_workflow import ROOT, TEST_CONFIG, planned_rules

TABLE = "clevr_change"
# One tiny table: the tiny configuration's cheapest trained method and one sanity row (about a minute on one core).
TINY_TABLE = {"dataset": "clevr_change", "methods": ["duda"], "sanity": ["most_frequent"]}
ENV = {**os.environ, "DVC_NO_ANALYTICS": "1"}


def run(cwd, *cmd, check=True):
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, env=ENV)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p


def dvc(cwd, *args, check=True):
    return run(cwd, sys.executable, "-m", "dvc", *args, check=check)


def snakemake(cwd, *args):
    """Snakemake as a user runs it in the repository (its Snakefile and config/config.yaml, nothing merged in)."""
    return run(cwd, sys.executable, "-m", "snakemake", "--cores", "1", *args)


def stages(repo_dir) -> dict:
    """The stages DVC generates from dvc.yaml and config/config.yaml: name -> (cmd, deps, outs)."""
    from dvc.repo import Repo

    with Repo(str(repo_dir)) as repo:
        return {s.name: (s.cmd, [d.def_path for d in s.deps], [o.def_path for o in s.outs]) for s in repo.index.stages}


def lock_outs(repo_dir) -> list[str]:
    lock = yaml.safe_load((repo_dir / "dvc.lock").read_text())
    return [o["path"] for s in lock["stages"].values() for o in s.get("outs", [])]


def file_hashes(repo_dir, outs) -> dict[str, str]:
    files = [p for o in outs for p in ([repo_dir / o] if (repo_dir / o).is_file() else (repo_dir / o).rglob("*"))]
    return {str(p.relative_to(repo_dir)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files if p.is_file()}


def test_dvc_stages_match_the_configured_tables_and_datasets():
    """Every table under `tables:` has a `table@` stage building its Snakemake target after its dataset's raw data,
    every dataset a `data@` stage, and nothing else: a new table or dataset joins by config alone."""
    cfg = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    got = stages(ROOT)
    assert set(got) == {f"table@{t}" for t in cfg["tables"]} | {f"data@{d}" for d in cfg["datasets"]}
    for t, block in cfg["tables"].items():
        cmd, deps, outs = got[f"table@{t}"]
        assert cmd.startswith("snakemake ") and f"results/tables/{t}.csv" in cmd.split()
        assert f"resources/raw/{block['dataset']}" in deps
        assert f"results/tables/{t}.csv" in outs
    for d in cfg["datasets"]:
        assert got[f"data@{d}"][2] == [f"resources/raw/{d}"]


@pytest.mark.parametrize("config", ["config/config.yaml", "config/paper.yaml", ".test/config/config.yaml"])
def test_every_configuration_names_each_table_s_dataset(config):
    """Any of them may be DVC's params file (written over config/config.yaml): dvc.yaml reads tables.<t>.dataset."""
    tables = yaml.safe_load((ROOT / config).read_text())["tables"]
    assert [t for t, block in tables.items() if "dataset" not in block] == []


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A git + DVC copy of the repository (tracked and new files) on the tiny configuration with one tiny table,
    written over config/config.yaml (see dvc.yaml), after `dvc repro table@clevr_change`."""
    d = tmp_path_factory.mktemp("dvc") / "repo"
    listed = run(ROOT, "git", "ls-files", "-z", "--cached", "--others", "--exclude-standard").stdout.split("\0")
    for f in filter(None, listed):
        if (ROOT / f).is_file():
            (d / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, d / f)
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    cfg["tables"] = {TABLE: TINY_TABLE}
    (d / "config/config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    run(d, "git", "init", "-q")
    run(d, "git", "add", "-A")
    run(d, "git", "-c", "user.name=test", "-c", "user.email=test@example.org", "commit", "-qm", "tiny")
    dvc(d, "repro", f"table@{TABLE}")
    return d


@pytest.mark.slow
def test_repro_of_one_table_stage_builds_and_versions_its_data_and_table(repo):
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert set(lock["stages"]) == {f"data@{TABLE}", f"table@{TABLE}"}
    assert {f"resources/raw/{TABLE}", f"results/tables/{TABLE}.csv", f"results/tables/{TABLE}_curves"} <= set(lock_outs(repo))
    assert "up to date" in dvc(repo, "status", f"table@{TABLE}").stdout
    assert (repo / f"results/tables/{TABLE}_curves/duda_seed0.csv").read_text().startswith("step,val_score\n")


@pytest.mark.slow
def test_metrics_show_has_the_table_and_each_run(repo):
    (workspace,) = json.loads(dvc(repo, "metrics", "show", "--json").stdout).values()  # keyed "" (the workspace)
    data = workspace["data"][f"results/tables/{TABLE}_metrics.json"]["data"]
    assert set(data["table"]) == {"duda", "most_frequent"} and "CIDEr" in data["table"]["most_frequent"]
    assert set(data["runs"]) == {"duda/seed0", "most_frequent/seed0"}
    run_metrics = json.loads((repo / f"results/{TABLE}/duda/seed0/metrics.json").read_text())
    assert data["runs"]["duda/seed0"]["total"]["CIDEr"] == run_metrics["total"]["CIDEr"]


@pytest.mark.slow
def test_plots_show_renders_curves_and_per_type_scores(repo, tmp_path):
    dvc(repo, "plots", "show", "-o", tmp_path / "plots")
    html = (tmp_path / "plots/index.html").read_text()
    assert f"{TABLE}_curves/duda_seed0.csv" in html and f"{TABLE}_by_type_plot.csv" in html


@pytest.mark.slow
def test_push_pull_round_trip_restores_every_file_and_snakemake_plans_nothing(repo, tmp_path):
    """A finished tree pushed to a local-directory remote, its cache and every DVC output lost, pulled: identical
    bytes, and after `snakemake --touch` (DVC restores contents, not timestamps) no job is planned; likewise in a
    colleague's clone that holds only the pulled files."""
    dvc(repo, "remote", "add", "-d", "store", tmp_path / "store")
    dvc(repo, "push")
    outs = lock_outs(repo)
    before = file_hashes(repo, outs)
    assert any(f.startswith(f"resources/raw/{TABLE}/") for f in before) and f"results/tables/{TABLE}.csv" in before
    shutil.rmtree(repo / ".dvc/cache")
    for o in outs:
        shutil.rmtree(repo / o) if (repo / o).is_dir() else (repo / o).unlink()
    dvc(repo, "pull", "--with-deps", f"table@{TABLE}")  # the stages that ran (a plain pull wants every dataset)
    assert file_hashes(repo, outs) == before
    assert "up to date" in dvc(repo, "status", f"table@{TABLE}").stdout
    targets = stages(repo)[f"table@{TABLE}"][0].split()[3:]  # the stage's Snakemake targets
    assert "manifest" in planned_rules(snakemake(repo, "-n", *targets))  # fresh timestamps: all would re-run
    snakemake(repo, "--touch", *targets)
    p = snakemake(repo, "-n", *targets)
    assert "Nothing to be done" in p.stdout + p.stderr, p.stdout[-3000:]
    # a colleague's clone: only what git and DVC hold (no features, checkpoints or predictions), same commands
    run(repo, "git", "add", "-A")
    run(repo, "git", "-c", "user.name=test", "-c", "user.email=test@example.org", "commit", "-qm", "results")
    run(tmp_path, "git", "clone", "-q", repo, tmp_path / "clone")
    clone = tmp_path / "clone"
    dvc(clone, "pull", "--with-deps", f"table@{TABLE}")
    assert file_hashes(clone, outs) == before and not (clone / f"results/{TABLE}/duda").exists()
    snakemake(clone, "--touch", *targets)
    p = snakemake(clone, "-n", *targets)
    assert "Nothing to be done" in p.stdout + p.stderr, p.stdout[-3000:]
