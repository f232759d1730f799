"""The whole DAG on the tiny `.test` configuration, as a user runs it (Snakemake CLI in a fresh folder)."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import pandas as pd
import pytest
import yaml

from pipeline.datasets.inspect_tree import inspect_tree

ROOT = Path(__file__).resolve().parent.parent
TEST_CONFIG = ROOT / ".test" / "config" / "config.yaml"
TABLE = "results/tables/clevr_change.csv"

pytestmark = pytest.mark.slow


def smk(workdir, *args, config=TEST_CONFIG, check=True):
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(config), "--cores", "2", *args]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise AssertionError(f"snakemake failed:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p


def planned_rules(p) -> set[str]:
    return set(re.findall(r"^rule (\w+):", p.stdout + p.stderr, flags=re.M))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    wd = tmp_path_factory.mktemp("dag")
    smk(wd, TABLE)
    return wd


def test_dag_writes_the_table_with_reproduced_sanity_and_paper_rows(workdir):
    t = pd.read_csv(workdir / TABLE)
    kinds = dict(zip(t["method"] + "/" + t["kind"], t["kind"]))
    assert {"duda/reproduced", "most_frequent/sanity", "nearest_neighbour/sanity", "duda/paper"} <= set(kinds)
    row = t[(t["method"] == "duda") & (t["kind"] == "reproduced")].iloc[0]
    assert "synthetic" in str(row["source"]).lower() and "random" in str(row["weights"]).lower()
    paper = t[(t["method"] == "duda") & (t["kind"] == "paper")].iloc[0]
    assert paper["CIDEr"] != row["CIDEr"]
    for f in ("clevr_change.md", "clevr_change_by_type.csv", "clevr_change_pairs.csv"):
        assert (workdir / "results" / "tables" / f).stat().st_size > 0
    for name in ("checkpoint.pt", "predictions_val.json", "predictions_test.json", "metrics.json", "run.json"):
        assert (workdir / "results/clevr_change/duda/seed0" / name).is_file()
    assert (workdir / "logs/benchmarks/clevr_change/duda/seed0/train.tsv").is_file()
    # learning curves are part of the table's target, and the Markdown links them
    for f in ("duda.png", "idc_pcl.png", "clip4idc.png", "clevr_change_val_cider.png"):
        assert (workdir / "results/clevr_change/plots" / f).stat().st_size > 0
    assert "(../clevr_change/plots/duda.png)" in (workdir / "results/tables/clevr_change.md").read_text()
    assert (workdir / "results/tables/clevr_change.meta.json").is_file()
    # finished runs keep their selected checkpoint, not the (large) state for resuming an interruption
    assert (workdir / "results/clevr_change/clip4idc_adapt/seed0/checkpoint.pt").is_file()
    # every training stage records the autocast it actually used: DUDA inherits the default's `fast`, the others `auto`
    import torch

    from pipeline.engine import native_bf16

    fast = "bf16" if native_bf16(torch.device("cpu")) else "fp32"
    for run, want in (("duda/seed0/run.json", fast), ("clip4idc_adapt/seed0/run.json", "fp32"),
                      ("idc_pcl_pretrain/seed0/pretrain.json", "fp32")):
        assert json.loads((workdir / "results/clevr_change" / run).read_text())["precision"] == want, run
    assert not list((workdir / "results").rglob("resume.pt"))


def test_second_run_does_nothing(workdir):
    p = smk(workdir, TABLE, "--dry-run")
    assert "Nothing to be done" in p.stdout + p.stderr, p.stdout[-2000:]


def test_changing_a_duda_hyperparameter_reruns_only_training_and_after(workdir, tmp_path):
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    cfg["methods"]["duda"]["train"]["lr"] = 2e-3
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(cfg))  # sorts the keys too: reordering alone must not re-run anything
    p = smk(workdir, TABLE, "--dry-run", config=changed)
    assert planned_rules(p) == {"train", "decode_test", "evaluate", "plot_method", "plot_table", "table"}, p.stdout[-3000:]


def test_same_seed_gives_the_identical_table(workdir):
    first = (workdir / TABLE).read_bytes()
    first_preds = (workdir / "results/clevr_change/duda/seed0/predictions_test.json").read_bytes()
    # Snakemake leaves an up-to-date target alone when an intermediate is deleted: remove the table too.
    shutil.rmtree(workdir / "results/clevr_change/duda")
    (workdir / TABLE).unlink()
    smk(workdir, TABLE)
    assert (workdir / "results/clevr_change/duda/seed0/predictions_test.json").read_bytes() == first_preds
    assert (workdir / TABLE).read_bytes() == first


def test_unknown_config_key_stops_with_one_clear_message(tmp_path):
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    cfg["methods"]["duda"]["train"]["learning_rate"] = 1
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    p = smk(tmp_path, TABLE, "--dry-run", config=bad, check=False)
    assert p.returncode != 0
    assert "unknown key 'learning_rate' under methods.duda.train" in p.stdout + p.stderr


def test_official_source_offline_says_what_to_place_where(tmp_path):
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    cfg["datasets"]["clevr_change"] = {"source": "official", "official": {"download": False}}
    c = tmp_path / "official.yaml"
    c.write_text(yaml.safe_dump(cfg))
    p = smk(tmp_path, "results/clevr_change/manifest.jsonl", config=c, check=False)
    assert p.returncode != 0
    log = (tmp_path / "logs/clevr_change/fetch.log").read_text()
    assert "resources/raw/clevr_change/official/clevr_change.tar.gz" in log
    assert not (tmp_path / "resources/raw/clevr_change/official/verified.json").exists()


def test_clevr_dc_data_stages_run_through_the_dag(workdir):
    """CLEVR-DC's data stages (issue 13): synthetic world -> manifest -> text and features, with the same
    generic rules as CLEVR-Change; the manifest's pairs are the world's, in its release blocks."""
    smk(workdir, "results/clevr_dc/manifest.jsonl", "results/clevr_dc/text/vocab.json",
        "results/clevr_dc/features/resnet101_layer4.h5")
    recs = [json.loads(line) for line in (workdir / "results/clevr_dc/manifest.jsonl").read_text().splitlines()]
    assert len(recs) == 120 and recs[0]["before"] == "images/0.png"
    report = inspect_tree("clevr_dc", workdir / "resources/raw/clevr_dc/synthetic")
    assert report["source"] == "synthetic" and report["n_warnings"] == 0
    assert {s: v["pairs"] for s, v in report["splits"].items()} == {"train": 102, "val": 6, "test": 12}
    assert {"other", "same", "shape"} <= set(json.loads((workdir / "results/clevr_dc/text/vocab.json").read_text())["itow"])
    with h5py.File(workdir / "results/clevr_dc/features/resnet101_layer4.h5") as f:
        assert f["features"].shape[0] == 240 and f.attrs["complete"]  # every before and after image once
