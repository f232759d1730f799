"""The whole DAG on the tiny `.test` configuration, as a user runs it (Snakemake CLI in a fresh folder)."""

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
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
def workdir(tiny_dag):
    smk(tiny_dag, TABLE)
    return tiny_dag


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
    # every training stage records the autocast it actually used: on CLEVR-Change all inherit the default's `fast`
    # (bf16 where the CPU runs it natively), first stages included
    import torch

    from pipeline.engine import native_bf16

    fast = "bf16" if native_bf16(torch.device("cpu")) else "fp32"
    for run, want in (("duda/seed0/run.json", fast), ("clip4idc_adapt/seed0/run.json", fast),
                      ("idc_pcl_pretrain/seed0/pretrain.json", fast)):
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


def _official_offline(tmp_path, dataset):
    """Snakemake asked for the manifest of ``dataset`` from its official source, downloads disabled."""
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    cfg["datasets"][dataset] = {"source": "official", "official": {"download": False}}
    c = tmp_path / "official.yaml"
    c.write_text(yaml.safe_dump(cfg))
    p = smk(tmp_path, f"results/{dataset}/manifest.jsonl", config=c, check=False)
    assert p.returncode != 0
    return p, (tmp_path / f"logs/{dataset}/fetch.log").read_text()


def test_official_source_offline_says_what_to_place_where(tmp_path):
    p, log = _official_offline(tmp_path, "clevr_change")
    assert "resources/raw/clevr_change/official/clevr_change.tar.gz" in log
    assert not (tmp_path / "resources/raw/clevr_change/official/verified.json").exists()
    # the failed job's log reaches the console (show-failed-logs in the default profile), not only its path
    assert "place it at resources/raw/clevr_change/official/clevr_change.tar.gz" in p.stdout + p.stderr


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


def test_clevr_dc_plain_pairs_train_decode_and_score_through_the_generic_rules(workdir):
    """Issue 13: CLEVR-DC's plain pairs go through the same train / decode_test / evaluate rules as CLEVR-Change's
    partnered pairs; the data layer read each mode from the manifest."""
    smk(workdir, "results/clevr_dc/dirl/seed0/metrics.json")
    run_dir = workdir / "results/clevr_dc/dirl/seed0"
    run = json.loads((run_dir / "run.json").read_text())
    assert (run["pairing"], run["n_train_items"]) == ("plain", 102)  # one item per training pair
    assert json.loads((workdir / "results/clevr_change/duda/seed0/run.json").read_text())["pairing"] == "partner"
    log = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert "ce" in log[-1] and "ce_pos" not in log[-1]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["n_pairs"] == 12 and "no_change" in metrics["by_type"]["subset_idf"]
    assert len(json.loads((run_dir / "predictions_test.json").read_text())) == 12


def test_clevr_dc_dirl_terms_table_builds_through_the_generic_rules(workdir):
    """DIRL Table 7 on CLEVR-DC (issue 13): the rows with one term of Eq. (4) train, decode and score through the
    generic rules; the table puts each beside its paper row and says whether the paper's ordering holds."""
    smk(workdir, "results/tables/clevr_dc_ablation_dirl_terms.csv")
    rows = list(csv.DictReader((workdir / "results/tables/clevr_dc_ablation_dirl_terms.csv").open()))
    ours = {r["method"] for r in rows if r["kind"] == "reproduced"}
    assert ours == {"dirl_nonpert", "dirl_discrim", "dirl"}
    assert {r["method"] for r in rows if r["kind"] == "paper"} >= ours
    losses = {m: json.loads((workdir / f"results/clevr_dc/{m}/seed0/train_log.jsonl").read_text().splitlines()[-1])["dirl"]
              for m in ours}
    assert len(set(losses.values())) == 3, losses  # three different objectives (tests/test_dirl.py: their terms)
    meta = json.loads((workdir / "results/tables/clevr_dc_ablation_dirl_terms.meta.json").read_text())
    assert any(o["block"] == "total" for o in meta["orderings"])


def test_a_dataset_override_changes_that_dataset_s_runs_only(workdir, tmp_path):
    """Per-dataset settings (``datasets.<d>.overrides``, e.g. DIRL's layer4 7x7 grid on CLEVR-DC): the override
    re-runs that dataset's training and what follows, leaves every other dataset's runs alone, and the run
    trains on the overridden backbone."""
    import torch

    target = "results/clevr_dc/dirl/seed0/metrics.json"
    smk(workdir, target, "results/clevr_dc/features/resnet101_layer4.h5")
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    cfg["datasets"]["clevr_dc"]["overrides"]["dirl"] = {"backbone": "resnet101_layer4", "train": {"lr": 2e-3, "iterations": 4}}
    changed = tmp_path / "override.yaml"
    changed.write_text(yaml.safe_dump(cfg))
    p = smk(workdir, TABLE, "--dry-run", config=changed)
    assert "Nothing to be done" in p.stdout + p.stderr, p.stdout[-2000:]
    p = smk(workdir, target, "--dry-run", config=changed)
    assert planned_rules(p) == {"train", "decode_test", "evaluate"}, p.stdout[-3000:]
    smk(workdir, target, config=changed)
    ck = torch.load(workdir / "results/clevr_dc/dirl/seed0/checkpoint.pt", map_location="cpu", weights_only=False)
    model = cfg["methods"]["dirl"]["model"]
    assert ck["feat_dim"] == 2048 and {k: ck["model_hparams"][k] for k in model} == model
    run = json.loads((workdir / "results/clevr_dc/dirl/seed0/run.json").read_text())
    assert (run["backbone"], run["config"]["train"]["lr"]) == ("resnet101_layer4", 2e-3)


def test_spot_the_diff_data_stages_run_through_the_dag(workdir):
    """Spot-the-Diff's data stages (issue 14): synthetic parking lot -> manifest -> text and features through the
    generic rules; one record per distinct img_id, every sentence of its entries a reference."""
    smk(workdir, "results/spot_the_diff/manifest.jsonl", "results/spot_the_diff/text/vocab.json",
        "results/spot_the_diff/features/resnet101_layer3.h5")
    recs = [json.loads(line) for line in (workdir / "results/spot_the_diff/manifest.jsonl").read_text().splitlines()]
    assert len(recs) == 30 and {r["change_type"] for r in recs} == {"change"}
    assert recs[0]["before"] == f"resized_images/{recs[0]['pair_id']}.png"
    report = inspect_tree("spot_the_diff", workdir / "resources/raw/spot_the_diff/synthetic")
    meta = json.loads((workdir / "resources/raw/spot_the_diff/synthetic/SYNTHETIC.json").read_text())
    for split, counts in meta["counts"].items():
        assert report["splits"][split]["distinct_pairs"] == counts["distinct_pairs"] == report["splits"][split]["pairs"]
        assert report["splits"][split]["captions"] == counts["sentences"] - counts["empty_sentences"]
    assert {"car", "person", "gone"} <= set(json.loads((workdir / "results/spot_the_diff/text/vocab.json").read_text())["itow"])
    with h5py.File(workdir / "results/spot_the_diff/features/resnet101_layer3.h5") as f:
        assert f["features"].shape[0] == 60 and f.attrs["complete"]


def test_image_editing_request_data_stages_run_through_the_dag(workdir):
    """Image Editing Request's data stages (issue 15, data half): synthetic photo edits -> manifest -> text and
    features through the generic rules; one record per entry, the valid pair repeated in test kept in both."""
    smk(workdir, "results/image_editing_request/manifest.jsonl", "results/image_editing_request/text/vocab.json",
        "results/image_editing_request/features/resnet101_layer3.h5")
    recs = [json.loads(line) for line in
            (workdir / "results/image_editing_request/manifest.jsonl").read_text().splitlines()]
    assert [sum(r["split"] == s for r in recs) for s in ("train", "val", "test")] == [31, 4, 5 + 1]
    assert {r["change_type"] for r in recs} == {"change"} and len({r["pair_id"] for r in recs}) == 41
    assert all(r["before"].startswith("images/") and r["after"].startswith("images/") for r in recs)
    val = {(r["before"], r["after"]) for r in recs if r["split"] == "val"}
    assert sum((r["before"], r["after"]) in val for r in recs if r["split"] == "test") == 1
    assert {len(r["captions"]) for r in recs if r["split"] == "train"} == {1}
    report = inspect_tree("image_editing_request", workdir / "resources/raw/image_editing_request/synthetic")
    assert report["splits"]["test"]["pairs_also_in_val"] == 1 and report["n_warnings"] == 1
    vocab = set(json.loads((workdir / "results/image_editing_request/text/vocab.json").read_text())["itow"])
    assert {"the", "image"} <= vocab
    with h5py.File(workdir / "results/image_editing_request/features/resnet101_layer3.h5") as f:
        # every distinct image once: 40 pairs' two, less the original a test pair shares with a valid one
        assert f["features"].shape[0] == 80 - 1 and f.attrs["complete"]


def test_image_editing_request_official_offline_says_what_to_place_where(tmp_path):
    _, log = _official_offline(tmp_path, "image_editing_request")
    assert "place it at resources/raw/image_editing_request/official/images.zip" in log
    for split in ("train", "valid", "test"):
        assert f"place it at resources/raw/image_editing_request/official/data/{split}.json" in log


def _plain_table(workdir, dataset, methods):
    """The table of a dataset of plain pairs, every pair changed (Spot-the-Diff, IER), and its test pair count;
    checks each method's run and metrics: plain pairing, no distractor pairs, the one type `change`."""
    n_test = sum(json.loads(line)["split"] == "test"
                 for line in (workdir / f"results/{dataset}/manifest.jsonl").read_text().splitlines())
    runs = {}
    for m in methods:
        runs[m] = json.loads((workdir / f"results/{dataset}/{m}/seed0/run.json").read_text())
        assert runs[m]["pairing"] == "plain" and runs[m]["dataset"] == dataset
        metrics = json.loads((workdir / f"results/{dataset}/{m}/seed0/metrics.json").read_text())
        assert list(metrics["by_type"]["subset_idf"]) == ["change"] and metrics["distractor"]["n_pairs"] == 0
        assert metrics["by_type"]["subset_idf"]["change"]["n_pairs"] == n_test
    return pd.read_csv(workdir / f"results/tables/{dataset}.csv", dtype=str), n_test, runs


def test_spot_the_diff_table_through_the_generic_rules(workdir):
    """Issue 14: the Spot-the-Diff table (here two of its methods, .test config) from the synthetic parking lot:
    plain pairs through train / decode_test / evaluate, the one type `change`, and the papers' Spot-the-Diff rows
    (DDLA as a paper-only row) beside ours."""
    smk(workdir, "results/tables/spot_the_diff.csv")
    t, n_test, _ = _plain_table(workdir, "spot_the_diff", ("scorer_cbr", "dirl_ccr"))
    assert list(zip(t["method"], t["kind"])) == [
        ("scorer_cbr", "reproduced"), ("dirl_ccr", "reproduced"), ("most_frequent", "sanity"),
        ("nearest_neighbour", "sanity"), ("scorer_cbr", "paper"), ("dirl_ccr", "paper"), ("ddla", "paper")]
    ours = t[t["kind"] != "paper"]
    assert set(ours["source"]) == {"synthetic Spot-the-Diff"} and set(ours["n_pairs"]) == {str(n_test)}
    paper = t[t["kind"] == "paper"].set_index("method")
    assert (paper.loc["ddla", "CIDEr"], paper.loc["ddla", "source"]) == ("34.0", "aux-task-duda-tirg-cvpr2021.md Table 3")
    assert (paper.loc["dirl_ccr", "CIDEr"], paper.loc["dirl_ccr", "source"]) == ("40.9", "dirl-ccr-eccv2024.md Table 1")
    assert paper.loc["scorer_cbr", "source"] == "scorer-cbr-iccv2023.md Table 5 (ROUGE-L: Table 12)"
    bt = pd.read_csv(workdir / "results/tables/spot_the_diff_by_type.csv", dtype=str)
    assert "change" in bt.columns and "Color" not in bt.columns and set(bt["kind"]) == {"reproduced", "sanity"}
    assert (workdir / "results/spot_the_diff/plots/spot_the_diff_val_cider.png").stat().st_size > 0


def test_image_editing_request_table_through_the_generic_rules(workdir):
    """Issue 15, table half: the IER table (here three of its six methods, .test config) and the CLIP4IDC retrieval
    table from the synthetic photo edits: plain pairs through train / decode_test / evaluate, the one type
    `change`, the papers' IER loss weights (datasets.image_editing_request.overrides of config/config.yaml) in the
    runs, and the papers' IER rows beside ours."""
    smk(workdir, "results/tables/image_editing_request.csv", "results/tables/image_editing_request_retrieval.csv")
    t, n_test, runs = _plain_table(workdir, "image_editing_request", ("scorer_cbr", "dirl_ccr", "clip4idc"))
    assert list(zip(t["method"], t["kind"])) == [
        ("scorer_cbr", "reproduced"), ("dirl_ccr", "reproduced"), ("clip4idc", "reproduced"), ("most_frequent", "sanity"),
        ("nearest_neighbour", "sanity"), ("scorer_cbr", "paper"), ("dirl_ccr", "paper"), ("clip4idc", "paper")]
    ours = t[t["kind"] != "paper"]
    assert set(ours["source"]) == {"synthetic Image Editing Request"} and set(ours["n_pairs"]) == {str(n_test)}
    paper = t[t["kind"] == "paper"].set_index("method")
    assert (paper.loc["dirl_ccr", "CIDEr"], paper.loc["dirl_ccr", "source"]) == ("34.1", "dirl-ccr-eccv2024.md Table 5")
    assert (paper.loc["clip4idc", "CIDEr"], paper.loc["clip4idc", "source"]) == ("32.2", "clip4idc-aacl2022.md Table 4")
    assert paper.loc["scorer_cbr", "source"] == "scorer-cbr-iccv2023.md Table 4 (SPICE: Table 11)"
    weights = {"scorer_cbr": {"sim_weight": 0.003, "cbr_weight": 0.06}, "dirl_ccr": {"dirl_weight": 0.001},
               "clip4idc": {"encoder_lr_mult": 1.0e-3}}  # the paper's encoder/captioner ratio, IER only
    for m, want in weights.items():
        assert {k: runs[m]["config"]["model"][k] for k in want} == want
    # the same methods on CLEVR-Change keep their own weights
    assert json.loads((workdir / "results/clevr_change/scorer_cbr/seed0/run.json").read_text())["config"]["model"][
        "sim_weight"] == 0.1
    assert json.loads((workdir / "results/clevr_change/clip4idc/seed0/run.json").read_text())["config"]["model"][
        "encoder_lr_mult"] == 1.0
    r = pd.read_csv(workdir / "results/tables/image_editing_request_retrieval.csv", dtype=str,
                    keep_default_na=False).set_index("kind")
    assert r.loc["reproduced", "method"] == r.loc["paper", "method"] == "clip4idc_adapt"
    assert (r.loc["paper", "P2T R@1"], r.loc["paper", "T2P R@10"], r.loc["paper", "P2T MdR"]) == ("17.1", "41.9", "n/a")
    assert "P2T R@50" not in r.columns
    assert (workdir / "results/image_editing_request/plots/image_editing_request_val_cider.png").stat().st_size > 0


def test_spot_the_diff_official_offline_says_what_to_place_where(tmp_path):
    _, log = _official_offline(tmp_path, "spot_the_diff")
    assert "place it at resources/raw/spot_the_diff/official/resized_images.zip" in log
    for split in ("train", "val", "test"):
        assert f"place it at resources/raw/spot_the_diff/official/data/annotations/{split}.json" in log
    assert not (tmp_path / "resources/raw/spot_the_diff/official/verified.json").exists()


def test_clevr_dc_official_offline_says_what_to_place_where(tmp_path):
    _, log = _official_offline(tmp_path, "clevr_dc")
    root = "resources/raw/clevr_dc/official"
    for name, dest in (("split.json", "data/split.json"), ("captions.json", "data/captions.json"),
                       ("bef.tar.gz", "bef.tar.gz"), ("aft.tar.gz", "aft.tar.gz")):
        assert f"- {name}: download it from " in log and f"place it at {root}/{dest}" in log, log
    assert not (tmp_path / root / "verified.json").exists() and not (tmp_path / root / "data").exists()


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["methods"]["idc_pcl"].update(init_from="idc_pcl_pretrainn"),
     "methods.idc_pcl.init_from: 'idc_pcl_pretrainn' is not a run under pretraining"),
    (lambda c: c["tables"]["clevr_change"]["methods"].append("dudaa"),
     "tables.clevr_change.methods: unknown method 'dudaa' (not under methods)"),
    (lambda c: c.update(seeds=[0, 0]), "seeds: [0, 0] has non-unique elements"),
])
def test_config_references_fail_when_the_snakefile_loads(workdir, tmp_path, edit, message):
    """Against finished results (where a wrong init_from used to give "Nothing to be done"): one message, no job."""
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    edit(cfg)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    p = smk(workdir, TABLE, "--dry-run", config=bad, check=False)
    assert p.returncode != 0 and message in p.stdout + p.stderr, (p.stdout + p.stderr)[-2000:]
    assert not planned_rules(p) and "Nothing to be done" not in p.stdout + p.stderr


def test_feature_extraction_takes_the_cores_it_is_given(tmp_path):
    p = smk(tmp_path, "results/clevr_change/features/resnet101_layer3.h5", "--dry-run", "--printshellcmds",
            "--cores", "1")
    cmd = [line for line in (p.stdout + p.stderr).splitlines() if "extract-features" in line]
    assert cmd and all("--threads 1 " in line for line in cmd), cmd


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_cores_above_the_machine_s_run_one_training_process_per_core(tmp_path):
    """`--cores 4` where the machine shows one core (as the README's `--cores 8` on a 2-core laptop): the
    training jobs take the `cpu_jobs` resource, limited to the cores, and so never run side by side."""
    one_core = {min(os.sched_getaffinity(0))}
    targets = [f"results/clevr_change/{m}/seed0/checkpoint.pt" for m in ("duda", "scorer", "dirl")]
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(tmp_path),
           "--configfile", str(TEST_CONFIG), "--cores", "4", *targets]
    p = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=lambda: os.sched_setaffinity(0, one_core))
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-4000:]
    # (where a GPU is, the gpu token orders the training jobs instead, and no cpu_jobs limit is registered)
    assert shutil.which("nvidia-smi") or 'cpu_jobs=Resource("cpu_jobs", 1)' in log, log[:3000]
    running = peak = 0
    for line in log.splitlines():  # Snakemake logs each job's start and end in order, from its one process
        if re.fullmatch(r"(local)?rule train:", line.strip()):
            running += 1
            peak = max(peak, running)
        elif re.search(r"Finished jobid: \d+ \(Rule: train\)", line):
            running -= 1
    assert peak == 1 and running == 0, log[-4000:]


def test_training_jobs_are_scheduled_longest_chain_first(tmp_path):
    """A run's priority is its expected length (samples x its method's ms per sample); a first stage counts the
    longest method after it."""
    from snakemake.utils import update_config

    from pipeline.config import run_config
    from pipeline.utils.scheduling import ms_per_sample

    # As Snakemake merges --configfile over the Snakefile's config (YAML aliases not shared: the JSON round trip)
    cfg = json.loads(json.dumps(yaml.safe_load((ROOT / "config" / "config.yaml").read_text())))
    update_config(cfg, yaml.safe_load(TEST_CONFIG.read_text()))
    cost = lambda n: (lambda t: round(t["iterations"] * t.get("batch_size", 1) * ms_per_sample(n)))(
        run_config(cfg, "clevr_change", n)["train"])
    p = smk(tmp_path, TABLE, "--dry-run")
    jobs = re.findall(r"^(?:local)?rule (train|pretrain_idc_pcl|clip4idc_adapt):\n(.*?)(?=\n\n|\Z)",
                      p.stdout + p.stderr, flags=re.M | re.S)
    assert len(jobs) >= 10
    for rule, body in jobs:
        name = re.search(r"(?:method|name|adapt)=(\w+)", body).group(1)
        after = [cost(m) for m, b in cfg["methods"].items() if b.get("init_from") == name]
        assert f"priority: {cost(name) + max(after, default=0)}" in body, (rule, name, body)
        assert f"cpu_jobs={0 if shutil.which('nvidia-smi') else 1}" in body, body  # no limit where a GPU is
    # A feature file's job takes a lane too, with the priority of the longest chain reading it (a first stage
    # without a backbone reads what its methods read); in the default config, IDC-PCL's layer4 grid comes first.
    names = list(cfg["methods"]) + list(cfg["pretraining"])
    chain = lambda n: cost(n) + max([cost(m) for m, b in cfg["methods"].items() if b.get("init_from") == n], default=0)
    reads = lambda n: ({run_config(cfg, "clevr_change", n)["backbone"]} if "backbone" in run_config(cfg, "clevr_change", n)
                       else {run_config(cfg, "clevr_change", m)["backbone"] for m, b in cfg["methods"].items()
                             if b.get("init_from") == n})
    feats = re.findall(r"^(?:local)?rule (?:extract_features|cache_pixels):\n(.*?)(?=\n\n|\Z)", p.stdout + p.stderr,
                       flags=re.M | re.S)
    assert len(feats) == 3
    for body in feats:
        backbone = re.search(r"features/(\w+)\.h5", body).group(1)
        assert f"priority: {max(chain(n) for n in names if backbone in reads(n))}\n" in body, body
        assert f"cpu_jobs={0 if shutil.which('nvidia-smi') else 1}" in body, body


def test_feature_extraction_stores_the_grid_the_models_read(tmp_path):
    """The embedded default stores layer3 pooled to the 7x7 its CPU-sized models read, layer4 as it is; the
    paper configuration stores the papers' 14x14."""
    for config, want in ((ROOT / "config" / "config.yaml", {"layer3": "--pool 7 ", "layer4": "--pool 0 "}),
                         (ROOT / "config" / "paper.yaml", {"layer3": "--pool 0 "})):
        targets = [f"results/clevr_change/features/resnet101_{k}.h5" for k in want]
        p = smk(tmp_path / config.stem, *targets, "--dry-run", "--printshellcmds", "--replace-workflow-config",
                config=config)
        cmd = [line for line in (p.stdout + p.stderr).splitlines() if "extract-features" in line]
        for layer, flag in want.items():
            assert [c for c in cmd if f"--backbone resnet101_{layer} " in c and flag in c], (config.name, cmd)


# ---------------------------------------------------------------------------------------------------------------
# Interruptions through the DAG. A training job is killed at 90 % of its steps, as a user or the machine kills
# Snakemake (SIGINT: Ctrl-C to the terminal's process group; SIGKILL: the whole group, then `--unlock`); the rerun
# must resume at that step and end with the outputs of an uninterrupted run, byte for byte.
# To kill at a known step, the jobs run with a `sitecustomize` (test-only, on PYTHONPATH) that blocks the engine
# right after it saved the resume state of the step named in IDC_TEST_HOLD.
HOLD_HOOK = """
import importlib.abc, importlib.machinery, json, os, sys, time
from pathlib import Path

HOLD = json.loads(os.environ["IDC_TEST_HOLD"])


def _patch(engine):
    original = engine.save

    def save(path, obj):
        original(path, obj)
        name = Path(path).parent.parent.name  # results/<dataset>/<run>/seed<k>/resume.pt
        if Path(path).name == "resume.pt" and obj["state"]["step"] == HOLD.get(name):
            (Path(os.environ["IDC_TEST_HELD"]) / name).touch()
            time.sleep(3600)  # until the test kills us

    engine.save = save


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "pipeline.engine":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
"""
# run dir -> (its outputs, the step it is killed at: 90 % of the .test configuration's iterations)
KILLED = {"duda": (["checkpoint.pt", "predictions_val.json", "run.json"], 18),
          "idc_pcl_pretrain": (["checkpoint.pt", "pretrain.json"], 9),
          "clip4idc_adapt": (["checkpoint.pt", "retrieval_val.json", "retrieval_test.json", "run.json"], 9)}
TIMING = {"train_seconds", "steps_per_s", "elapsed_s"}


def _run_dir(workdir, name):
    return workdir / "results/clevr_change" / name / "seed0"


def _targets():
    return [f"results/clevr_change/{name}/seed0/{outs[-1]}" for name, (outs, _) in KILLED.items()]


def _without_timing(obj):
    if isinstance(obj, dict):
        return {k: _without_timing(v) for k, v in obj.items() if k not in TIMING}
    if isinstance(obj, list):
        return [_without_timing(v) for v in obj]
    return obj


def _outputs(workdir):
    out = {}
    for name, (files, _) in KILLED.items():
        for f in files:
            data = (_run_dir(workdir, name) / f).read_bytes()
            out[f"{name}/{f}"] = _without_timing(json.loads(data)) if f.endswith(".json") else data
    return out


@pytest.fixture(scope="module")
def uninterrupted(workdir):
    return _outputs(workdir)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_training_killed_at_90_percent_resumes_and_ends_as_if_uninterrupted(workdir, uninterrupted, tmp_path, sig):
    iterations = {"duda": 20, "idc_pcl_pretrain": 10, "clip4idc_adapt": 10}
    for name, (_, step) in KILLED.items():
        assert step >= 0.9 * iterations[name]
        shutil.rmtree(_run_dir(workdir, name))
    hook, held = tmp_path / "hook", tmp_path / "held"
    hook.mkdir(), held.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_HOOK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]),
           "IDC_TEST_HOLD": json.dumps({n: step for n, (_, step) in KILLED.items()}), "IDC_TEST_HELD": str(held)}
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(TEST_CONFIG), "--cores", "3", *_targets(), "--resources", "cpu_jobs=3"]
    # (the three runs held at once: more training processes than a 2-core machine's cpu_jobs limit allows)
    with open(tmp_path / "killed.out", "w") as out:
        # SIGINT as a terminal delivers it: a suite started in the background (`cmd &` in a script, as some CI
        # runners do) inherits SIGINT ignored, and the jobs would then never see the interrupt.
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.time() + 300
            while len(list(held.iterdir())) < len(KILLED):
                assert proc.poll() is None and time.time() < deadline, (tmp_path / "killed.out").read_text()[-3000:]
                time.sleep(0.2)
            for name in KILLED:  # what a kill during an atomic save leaves beside its target
                for target in ("checkpoint.pt", "resume.pt"):
                    (_run_dir(workdir, name) / f".{target}.k1ll3d_9.tmp").write_bytes(b"half an archive")
        finally:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=120)
    if sig == signal.SIGKILL:
        smk(workdir, "--unlock")  # Snakemake, killed outright, could not release its lock
    smk(workdir, "--cores", "3", *_targets())
    for name, (_, step) in KILLED.items():
        log = [json.loads(line) for line in (_run_dir(workdir, name) / "train_log.jsonl").read_text().splitlines()]
        events = [r for r in log if "event" in r]
        assert [r["event"] for r in events] == ["started", "resumed"] and events[1]["step"] == step, (name, events)
        steps = [r["step"] for r in log if "val_score" in r]
        assert steps == sorted(set(steps)) and steps[-1] == iterations[name], (name, steps)
    assert _outputs(workdir) == uninterrupted  # checkpoints byte for byte, the rest but its timings
    left = [p for p in (workdir / "results").rglob("*") if p.name.endswith(".tmp") or p.name == "resume.pt"]
    assert not left


def test_bird_datasets_data_stages_run_through_the_dag(tmp_path):
    """Birds-to-Words, CUB and NABirds (issue 16, data half): synthetic worlds -> manifests through the generic
    rules; Birds-to-Words gives plain changed pairs, CUB and NABirds single-image records (docs/contracts.md)."""
    smk(tmp_path, *(f"results/{d}/manifest.jsonl" for d in ("birds_to_words", "cub", "nabirds")))
    recs = {d: [json.loads(line) for line in (tmp_path / f"results/{d}/manifest.jsonl").read_text().splitlines()]
            for d in ("birds_to_words", "cub", "nabirds")}
    b2w = recs["birds_to_words"]
    assert len(b2w) == 30 and {r["change_type"] for r in b2w} == {"change"}
    assert {r["split"] for r in b2w} == {"train", "val", "test"} and all("animal" in r["captions"][0] for r in b2w)
    assert len(recs["cub"]) == 40 and {r["split"] for r in recs["cub"]} == {"train", "val"}
    assert all(len(r["captions"]) == 10 and r["image"].startswith("CUB_200_2011/images/") for r in recs["cub"])
    assert len(recs["nabirds"]) == 40 and all(r["labels"]["ancestors"][-1] == 0 for r in recs["nabirds"])


def test_bird_datasets_official_offline_say_what_to_place_where(tmp_path):
    (tmp_path / "b2w").mkdir()
    (tmp_path / "nabirds").mkdir()
    _, log = _official_offline(tmp_path / "b2w", "birds_to_words")
    assert "place it at resources/raw/birds_to_words/official/data/birds-to-words-v1.0.tsv" in log
    _, log = _official_offline(tmp_path / "nabirds", "nabirds")
    assert "place it at resources/raw/nabirds/official/nabirds.tar.gz" in log and "dl.allaboutbirds.org" in log


def test_birds_to_words_table_plans_the_expansion_runs(tmp_path):
    """Issue 16: the Birds-to-Words table (IDC-PCL Tables 1 and 5) plans IDC-PCL without pre-training and pre-trained on
    Birds-to-Words alone, + CUB, + NABirds and + both: the expansion runs read CUB's and NABirds' manifests and
    features (through the generic feature rule), and CUB's negatives; fine-tuning selects on ROUGE-L."""
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    cfg["tables"]["birds_to_words"].update(  # the default configuration's rows
        methods=["idc_pcl_no_pretrain", "idc_pcl", "idc_pcl_cub", "idc_pcl_nabirds", "idc_pcl_cub_nabirds"],
        sanity=["most_frequent", "nearest_neighbour"], sanity_backbone="resnet101_layer3")
    five = tmp_path / "five.yaml"
    five.write_text(yaml.safe_dump(cfg))
    p = smk(tmp_path, "results/tables/birds_to_words.csv", "--dry-run", "--printshellcmds", config=five)
    out = p.stdout + p.stderr
    jobs = dict(re.findall(r"^\s*(\w+)\s+(\d+)$", out.split("Job stats:")[1].split("Reasons:")[0], flags=re.M))
    assert (jobs["pretrain_idc_pcl"], jobs["train"], jobs["negatives"], jobs["extract_features"]) == ("4", "5", "2", "4")
    for d in ("cub", "nabirds", "birds_to_words"):
        assert f"results/{d}/features/resnet101_layer4.h5" in out
    assert "results/cub/text/negatives.jsonl" in out and "results/nabirds/text" not in out
    cmds = [line for line in out.splitlines() if "python -m pipeline pretrain-idc-pcl" in line]
    by_name = {re.search(r"--name (\w+)", c).group(1): c for c in cmds}
    assert set(by_name) == {"idc_pcl_pretrain", "idc_pcl_pretrain_cub", "idc_pcl_pretrain_nabirds",
                            "idc_pcl_pretrain_cub_nabirds"}
    assert "--cross-task" not in by_name["idc_pcl_pretrain"]
    assert '"gic"' in by_name["idc_pcl_pretrain_cub"] and '"fgvc"' not in by_name["idc_pcl_pretrain_cub"]
    assert '"fgvc"' in by_name["idc_pcl_pretrain_nabirds"] and '"gic"' not in by_name["idc_pcl_pretrain_nabirds"]
    assert '"gic"' in by_name["idc_pcl_pretrain_cub_nabirds"] and '"fgvc"' in by_name["idc_pcl_pretrain_cub_nabirds"]
    assert all('\\"mlm\\": 9' in c or '"mlm": 9' in c for c in cmds)  # Birds-to-Words' task ratio (§3.1)
    trains = [line for line in out.splitlines() if "python -m pipeline train " in line]
    assert len(trains) == 5 and all("ROUGE_L" in c for c in trains)


def test_birds_to_words_table_through_the_expansion(workdir):
    """The tiny Birds-to-Words table built: IDC-PCL without pre-training and pre-trained with CUB then Birds-to-Words
    mixed with NABirds, beside the sanity row and IDC-PCL's Table 1 / Table 5 rows (ROUGE-L its main metric)."""
    smk(workdir, "results/tables/birds_to_words.csv")
    t, n_test, runs = _plain_table(workdir, "birds_to_words", ("idc_pcl_no_pretrain", "idc_pcl_cub_nabirds"))
    assert list(zip(t["method"], t["kind"]))[:3] == [
        ("idc_pcl_no_pretrain", "reproduced"), ("idc_pcl_cub_nabirds", "reproduced"), ("most_frequent", "sanity")]
    paper = t[t["kind"] == "paper"].set_index("method")
    assert (paper.loc["idc_pcl_cub_nabirds", "ROUGE-L"], paper.loc["l2c_cub", "CIDEr"]) == ("49.1", "16.3")
    # no paper number without pre-training on Birds-to-Words, no METEOR for L2C: cells left n/a, never filled
    assert pd.isna(paper.loc["idc_pcl_no_pretrain", "ROUGE-L"]) and pd.isna(paper.loc["l2c", "METEOR"])  # "n/a"
    assert all(r["selection"] == "greedy decoding, validation ROUGE_L" and r["val_CIDEr"] is None and
               r["val_ROUGE_L"] is not None for r in runs.values())
    pre = json.loads((workdir / "results/birds_to_words/idc_pcl_pretrain_cub_nabirds/seed0/pretrain.json").read_text())
    ct = pre["cross_task"]
    assert ct["gic_steps"] == 4 and ct["fgvc_classes"] >= 2 and ct["gic_train_images"] > 0
    log = [json.loads(line) for line in
           (workdir / "results/birds_to_words/idc_pcl_pretrain_cub_nabirds/seed0/train_log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "train_steps" in r]
    assert any("gic_mlm" in r for r in steps[:4]) and not any("gic_mlm" in r for r in steps[4:])
    assert any("fgvc_match" in r for r in steps[4:])
    # the table says whether the addition helps here (config: contrasts)
    (c,) = json.loads((workdir / "results/tables/birds_to_words.meta.json").read_text())["contrasts"]
    assert (c["method"], c["base"]) == ("idc_pcl_cub_nabirds", "idc_pcl_no_pretrain") and c["helps"] in (True, False, None)
    assert set(c["here"]) == {"ROUGE-L", "CIDEr"} and "validation ROUGE-L at the selected step" in c["statement"]
    assert c["statement"] in (workdir / "results/tables/birds_to_words.md").read_text()


def test_train_devices_2_runs_two_processes_in_the_one_job_and_takes_the_one_process_steps(workdir, tmp_path):
    """``train.devices: 2`` on a CPU: the train rule's job starts 2 gloo processes (torchrun) at batch 4 each;
    rank 0 writes the outputs, and the logged losses are those of 1 process at batch 8 (dropout off and fp32 in
    both runs, rounding apart: pipeline.distributed), in a copy of the DAG's folder."""
    wd = tmp_path / "wd"
    shutil.copytree(workdir, wd, symlinks=True)
    target = "results/clevr_change/duda/seed0/run.json"
    losses = {}
    for n in (1, 2):
        cfg = yaml.safe_load(TEST_CONFIG.read_text())
        cfg["methods"]["duda"]["model"]["dropout"] = 0.0
        # fp32: under bf16 autocast (the default's `precision: fast` on a CPU with native bf16) the two runs agree
        # to bf16 rounding only (1e-5 of the loss, measured)
        cfg["methods"]["duda"]["train"].update(devices=n, iterations=4, precision="fp32")
        cfg["datasets"]["clevr_change"]["overrides"]["duda"]["train"]["iterations"] = 4  # the tiny override's 20
        path = tmp_path / f"devices{n}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        smk(wd, target, config=path)
        run = json.loads((wd / target).read_text())
        assert run["devices"] == n and run["config"]["train"]["devices"] == n
        log = (wd / "logs/clevr_change/duda/seed0/train.log").read_text()
        assert ("launching 2 processes" in log) == (n == 2)
        records = [json.loads(line) for line in (wd / "results/clevr_change/duda/seed0/train_log.jsonl").open()]
        losses[n] = [r["loss"] for r in records if "loss" in r]
        assert not (wd / "results/clevr_change/duda/seed0/resume.pt").exists()
    assert len(losses[2]) == len(losses[1]) == 2
    for a, b in zip(losses[2], losses[1]):
        assert abs(a - b) <= 1e-5 * abs(b), (losses[2], losses[1])
