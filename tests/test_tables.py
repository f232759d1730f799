"""Tables: mean ± std over seeds, n/a for missing SPICE, paper rows separate and equal to the seed files."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from pipeline import paper_numbers as pn
from pipeline import tables
from pipeline.__main__ import main
from pipeline.errors import PipelineError
from pipeline.utils.io import write_json

TYPES = ("color", "material", "add", "drop", "move", "no_change")
SEEDS_DIR = Path(__file__).resolve().parents[2] / "shared" / "seeds"


def _block(cider, bleu4=0.5, spice=None, n=10):
    return {"Bleu_1": 0.9, "Bleu_2": 0.8, "Bleu_3": 0.7, "Bleu_4": bleu4, "METEOR": 0.3, "ROUGE_L": 0.6,
            "CIDEr": cider, "SPICE": spice, "n_pairs": n}


def _metrics(cider, bleu4=0.5):
    return {
        "split": "test", "n_pairs": 20, "spice": "not available: no --spice-jars directory given",
        "total": _block(cider, bleu4, n=20), "semantic": _block(cider - 0.1, n=10), "distractor": _block(cider + 0.1, n=10),
        "by_type": {
            "subset_idf": {t: _block(cider + i / 10, n=2) for i, t in enumerate(TYPES)},
            "global_idf": {t: {"CIDEr": cider / 2, "n_pairs": 2} for t in TYPES},
        },
    }


def _run(root: Path, method, seed, kind, cider, bleu4=0.5, dataset="clevr_change") -> Path:
    d = root / method / f"seed{seed}"
    write_json(d / "run.json", {"method": method, "dataset": dataset, "seed": seed, "kind": kind, "source": "synthetic",
                                "backbone": "resnet101_layer3", "weights": "random(seed=0)", "selected_step": 10,
                                "val_CIDEr": 0.1, "config": {}})
    write_json(d / "metrics.json", _metrics(cider, bleu4))
    return d


@pytest.fixture()
def written(tmp_path):
    runs = [
        _run(tmp_path, "duda", 0, "reproduced", cider=1.00, bleu4=0.40),
        _run(tmp_path, "duda", 1, "reproduced", cider=1.20, bleu4=0.44),
        _run(tmp_path, "most_frequent", 0, "sanity", cider=0.30),
    ]
    out = tmp_path / "tables" / "clevr_change.csv"
    assert main(["table", "--dataset", "clevr_change", "--runs", *map(str, runs), "--out", str(out)]) == 0
    return out.parent


def _read(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_mean_std_over_seeds_and_na(written):
    rows = _read(written / "clevr_change.csv")
    duda = [r for r in rows if r["method"] == "duda" and r["kind"] == "reproduced"]
    assert len(duda) == 1
    d = duda[0]
    assert d["CIDEr"] == "110.0" and d["CIDEr std"] == "14.1"  # mean/sample std of 100 and 120
    assert d["BLEU-4"] == "42.0" and d["BLEU-4 std"] == "2.8"
    assert d["seeds"] == "0,1" and d["source"] == "synthetic CLEVR-Change" and d["weights"] == "random(seed=0)"
    assert d["SPICE"] == "n/a" and d["SPICE std"] == ""
    assert "not comparable to the paper rows" in d["note"] and "random" in d["note"]
    sanity = [r for r in rows if r["kind"] == "sanity"]
    assert [r["method"] for r in sanity] == ["most_frequent"] and sanity[0]["CIDEr std"] == ""
    md = (written / "clevr_change.md").read_text()
    assert "110.0 ± 14.1" in md and "| n/a |" in md


def test_paper_rows_separate_and_pinned(written):
    rows = _read(written / "clevr_change.csv")
    kinds = [r["kind"] for r in rows]
    assert kinds == sorted(kinds, key=["reproduced", "sanity", "paper"].index)  # reproduced, sanity, then paper
    paper = {r["method"]: r for r in rows if r["kind"] == "paper"}
    assert set(pn.SPINE_METHODS) <= set(paper)  # spine methods always shown
    assert paper["duda"]["CIDEr"] == "112.3" and paper["duda"]["BLEU-4"] == "47.3" and paper["duda"]["ROUGE-L"] == "n/a"
    assert "aux-task-duda-tirg-cvpr2021.md Table 1" == paper["duda"]["source"]
    assert paper["clip4idc"]["CIDEr"] == "150.7" and paper["clip4idc"]["SPICE"] == "n/a"
    assert paper["idc_pcl"]["CIDEr"] == "128.9" and paper["scorer_cbr"]["SPICE"] == "33.3"
    # the reproduced duda row keeps its own numbers
    assert [r["CIDEr"] for r in rows if r["method"] == "duda"] == ["110.0", "112.3"]

    bt = _read(written / "clevr_change_by_type.csv")
    bt_paper = {r["method"]: r for r in bt if r["kind"] == "paper"}
    # IDC-PCL and CLIP4IDC print C, T, M, A, D, DI: Move and Add must not be swapped
    assert (bt_paper["idc_pcl"]["Move"], bt_paper["idc_pcl"]["Add"], bt_paper["idc_pcl"]["Distractor"]) == ("81.7", "133.3", "145.0")
    assert (bt_paper["clip4idc"]["Move"], bt_paper["clip4idc"]["Add"]) == ("91.0", "132.4")
    assert bt_paper["duda"]["Texture"] == "86.7" and bt_paper["duda"]["Color (global IDF)"] == "n/a"
    dd = [r for r in bt if r["method"] == "duda" and r["kind"] == "reproduced"][0]
    assert dd["Color"] == "110.0" and dd["Distractor"] == "160.0" and dd["Color (global IDF)"] == "55.0"
    assert "global IDF" in (written / "clevr_change_by_type.md").read_text()

    pairs = _read(written / "clevr_change_pairs.csv")
    got = {(r["subset"], r["method"], r["kind"]): r for r in pairs}
    assert got[("changed pairs only", "duda", "paper")]["CIDEr"] == "94.6"
    assert got[("distractor pairs only", "duda", "paper")]["CIDEr"] == "110.8"
    assert got[("distractor pairs only", "duda_aux", "paper")]["ROUGE-L"] == "53.9"
    assert got[("changed pairs only", "duda", "reproduced")]["CIDEr"] == "100.0"
    assert got[("distractor pairs only", "duda", "reproduced")]["CIDEr"] == "120.0"
    assert got[("changed pairs only", "dirl_ccr", "paper")]["CIDEr"] == "123.6"


def test_ablation_rows_only_when_asked(tmp_path):
    run = _run(tmp_path, "rr", 0, "reproduced", cider=1.0)
    out = tmp_path / "t" / "clevr_change.csv"
    assert main(["table", "--dataset", "clevr_change", "--runs", str(run), "--out", str(out), "--paper-methods"]) == 0
    paper = [r for r in _read(out) if r["kind"] == "paper"]
    assert [(r["method"], r["CIDEr"], r["source"]) for r in paper] == [("rr", "123.8", "scorer-cbr-iccv2023.md Table 6")]


def test_wrong_dataset_rejected(tmp_path):
    run = _run(tmp_path, "duda", 0, "reproduced", cider=1.0, dataset="clevr_dc")
    with pytest.raises(PipelineError, match="clevr_dc"):
        tables.load_runs([run], "clevr_change")


def test_duplicate_seed_rejected(tmp_path):
    run = _run(tmp_path, "duda", 0, "reproduced", cider=1.0)
    with pytest.raises(PipelineError, match="seed 0"):
        tables.load_runs([run, run], "clevr_change")


def test_mean_std_missing_value():
    assert tables.mean_std([0.5, None]) == (None, None)
    assert tables.mean_std([0.5]) == (50.0, None)


def test_paper_numbers_pinned_and_cited():
    assert pn.lookup("clevr_change", "total", "duda").value("CIDEr") == 112.3
    assert pn.lookup("clevr_change", "total", "duda_aux").value("SPICE") == 31.1
    assert pn.lookup("clevr_change", "total", "scorer").value("ROUGE-L") == 74.0
    assert pn.lookup("clevr_change", "changed", "scorer_cbr").value("CIDEr") == 122.4
    assert pn.lookup("clevr_change", "distractor", "duda_aux").value("BLEU-4") == 62.4
    assert pn.lookup("clevr_change", "by_type", "scorer", metric="CIDEr").value("Move") == 91.6
    assert pn.lookup("clevr_change", "total", "idc_pcl").value("SPICE") is None
    assert all(v is None for v in pn.lookup("clevr_change", "total", "dirl").values.values())
    assert pn.lookup("clevr_dc", "total", "transformer_dirl").value("CIDEr") == 81.8  # alias of dirl
    files = {"aux-task-duda-tirg-cvpr2021.md", "idc-pcl-pretraining-aaai2022.md", "scorer-cbr-iccv2023.md",
             "dirl-ccr-eccv2024.md", "clip4idc-aacl2022.md"}
    for r in pn.PAPER_ROWS:
        assert r.source.split()[0] in files, r
        assert r.block in pn.BLOCKS and (r.metric is not None) == (r.block == "by_type"), r
        for v in r.values.values():
            assert v is None or 0 < v < 200, r
    keys = [(r.method, r.dataset, r.block, r.metric) for r in pn.PAPER_ROWS]
    assert len(keys) == len(set(keys))


@pytest.mark.skipif(not SEEDS_DIR.is_dir(), reason="shared/seeds not present")
def test_paper_numbers_appear_in_seed_files():
    """Every transcribed value occurs in the cited seed file (a guard against typos)."""
    import re

    for r in pn.PAPER_ROWS:
        text = re.sub(r"</?[a-z]+>", "", (SEEDS_DIR / r.source.split()[0]).read_text(encoding="utf-8"))
        numbers = {f"{float(x):.1f}" for x in re.findall(r"\d+\.\d+|\d+", text)}
        for k, v in r.values.items():
            if v is not None:
                assert f"{v:.1f}" in numbers, (r.method, r.block, k, v)
