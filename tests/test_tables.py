"""Tables: mean ± std over seeds, n/a for missing SPICE, paper rows separate and equal to the seed files."""

from __future__ import annotations

import csv
import json
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


def _run(root: Path, method, seed, kind, cider, bleu4=0.5, dataset="clevr_change", config=None, captions=None,
         selected=10) -> Path:
    d = root / method / f"seed{seed}"
    write_json(d / "run.json", {"method": method, "dataset": dataset, "seed": seed, "kind": kind, "source": "synthetic",
                                "backbone": "resnet101_layer3", "weights": "random(seed=0)",
                                "selected_step": selected if kind == "reproduced" else None,
                                "val_CIDEr": 0.1, "config": config or {}})
    write_json(d / "metrics.json", _metrics(cider, bleu4))
    if captions is not None:
        write_json(d / "predictions_test.json", [{"image_id": f"{i:06d}.png", "caption": c} for i, c in enumerate(captions)])
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
    assert d["seeds"] == "0,1" and d["source"] == "synthetic CLEVR-Change" and d["weights"] == "random"
    assert d["SPICE"] == "n/a" and d["SPICE std"] == ""
    notes = json.loads((written / "clevr_change.meta.json").read_text())["notes"]
    texts = [notes[n] for n in d["notes"].split(",")]
    assert any("not comparable to the paper rows" in t and "synthetic" in t for t in texts)
    assert any("random(seed=0)" in t for t in texts) and any(t.startswith("SPICE not available") for t in texts)
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
    """Every transcribed value occurs in the cited seed file (a guard against typos); a table printed as fractions
    (the aux paper's Spot-the-Diff Table 3: 0.081) is x100 in the file."""
    import re

    for r in list(pn.PAPER_ROWS) + list(pn.RETRIEVAL_ROWS):
        text = re.sub(r"</?[a-z]+>", "", (SEEDS_DIR / r.source.split()[0]).read_text(encoding="utf-8"))
        numbers = {f"{float(x):.1f}" for x in re.findall(r"\d+\.\d+|\d+", text)}
        numbers |= {f"{float(x) * 100:.1f}" for x in re.findall(r"\b0\.\d{3}\b", text)}
        for k, v in r.values.items():
            if v is not None:
                assert f"{v:.1f}" in numbers, (getattr(r, "method", getattr(r, "run", None)), k, v)


def test_spot_the_diff_paper_numbers_pinned_and_cited():
    aux, clip, scorer, dirl = (f"{f} Table {n}" for f, n in ((pn.AUX, 3), (pn.CLIP, 3), (pn.SCORER, 5), (pn.DIRL, 1)))
    sd = "spot_the_diff"
    # aux Table 3 prints B4 C M R as fractions
    assert pn.lookup(sd, "total", "ddla").values == {"BLEU-4": 8.1, "METEOR": 11.5, "ROUGE-L": 28.3, "CIDEr": 34.0, "SPICE": None}
    assert pn.lookup(sd, "total", "duda").values == {"BLEU-4": 8.1, "METEOR": 11.8, "ROUGE-L": 29.1, "CIDEr": 32.5, "SPICE": None}
    assert pn.lookup(sd, "total", "duda_tirg").value("CIDEr") == 34.5  # alias of duda_aux
    assert {pn.lookup(sd, "total", m).source for m in ("ddla", "duda", "duda_aux")} == {aux}
    assert pn.lookup(sd, "total", "clip4idc").source == clip and pn.lookup(sd, "total", "clip4idc").value("ROUGE-L") == 35.0
    assert pn.lookup(sd, "total", "clip_ft").value("CIDEr") == 43.3  # only in Table 5
    assert pn.lookup(sd, "total", "scorer_cbr").source.startswith(scorer)
    assert pn.lookup(sd, "total", "scorer_cbr").values == {"BLEU-4": 10.2, "METEOR": 12.2, "ROUGE-L": 31.9, "CIDEr": 38.9,
                                                           "SPICE": 18.4}
    assert pn.lookup(sd, "total", "dirl_ccr").source == dirl and pn.lookup(sd, "total", "dirl_ccr").value("SPICE") == 19.9
    assert all(v is None for v in pn.lookup(sd, "total", "dirl").values.values())  # Table 1 has DIRL+CCR only
    assert pn.rows(sd, "changed") == pn.rows(sd, "distractor") == pn.rows(sd, "by_type") == []
    (ret,) = pn.retrieval_rows(sd)
    assert ret.values == {"P2T R@10": 3.7, "P2T R@20": 7.3, "P2T R@50": 16.8, "T2P R@10": 6.2, "T2P R@20": 10.5,
                          "T2P R@50": 20.0} and ret.source == f"{pn.CLIP} Table 6"


def _plain_runs(root: Path, dataset: str, specs) -> list[Path]:
    """Runs of a dataset of plain pairs, every pair changed (Spot-the-Diff, IER): no distractor pairs, one type
    `change`. ``specs``: (method, kind, cider) per run."""
    runs = []
    for method, kind, cider in specs:
        d = _run(root, method, 0, kind, cider=cider, dataset=dataset)
        m = json.loads((d / "metrics.json").read_text())
        m["distractor"] = {**{k: None for k in m["distractor"]}, "n_pairs": 0}
        m["by_type"] = {"subset_idf": {"change": _block(cider, n=20)}, "global_idf": {"change": {"CIDEr": cider, "n_pairs": 20}}}
        write_json(d / "metrics.json", m)
        runs.append(d)
    return runs


def test_spot_the_diff_table_puts_the_papers_rows_beside_ours(tmp_path):
    """As the `table` rule builds it: the table's methods and its `paper_only` DDLA as --paper-methods."""
    runs = _plain_runs(tmp_path, "spot_the_diff", (("dirl_ccr", "reproduced", 0.5), ("most_frequent", "sanity", 0.2)))
    out = tmp_path / "tables" / "spot_the_diff.csv"
    assert main(["table", "--dataset", "spot_the_diff", "--runs", *map(str, runs), "--out", str(out),
                 "--paper-methods", "duda", "dirl_ccr", "ddla"]) == 0
    rows = _read(out)
    assert [(r["method"], r["kind"]) for r in rows] == [
        ("dirl_ccr", "reproduced"), ("most_frequent", "sanity"), ("duda", "paper"), ("dirl_ccr", "paper"), ("ddla", "paper")]
    got = {(r["method"], r["kind"]): r for r in rows}
    assert got[("dirl_ccr", "reproduced")]["CIDEr"] == "50.0" and got[("dirl_ccr", "reproduced")]["source"] == "synthetic Spot-the-Diff"
    ours, paper = got[("dirl_ccr", "reproduced")], got[("dirl_ccr", "paper")]
    assert (paper["CIDEr"], paper["SPICE"], paper["source"]) == ("40.9", "19.9", "dirl-ccr-eccv2024.md Table 1")
    assert ours["CIDEr"] != paper["CIDEr"]
    ddla = got[("ddla", "paper")]
    assert (ddla["BLEU-4"], ddla["METEOR"], ddla["ROUGE-L"], ddla["CIDEr"], ddla["SPICE"]) == ("8.1", "11.5", "28.3", "34.0", "n/a")
    assert ddla["source"] == "aux-task-duda-tirg-cvpr2021.md Table 3"
    notes = json.loads(out.with_suffix(".meta.json").read_text())["notes"]
    assert "paper row 'DDLA [13]'" in notes[ddla["notes"]] and "8.5" in notes[ddla["notes"]]  # CLIP4IDC's other DDLA row
    assert got[("duda", "paper")]["CIDEr"] == "32.5"  # Spot-the-Diff's, not CLEVR-Change's 112.3
    md = out.with_suffix(".md").read_text()
    assert "| ddla | paper | aux-task-duda-tirg-cvpr2021.md Table 3 |" in md
    # no paper rows where the papers report none: changed / distractor pairs, change types
    assert [r["kind"] for r in _read(out.parent / "spot_the_diff_pairs.csv")] == ["reproduced", "sanity"] * 2
    assert [r["kind"] for r in _read(out.parent / "spot_the_diff_by_type.csv")] == ["reproduced", "sanity"]
    # without --paper-methods naming it, DDLA (no method of ours) is not shown
    main(["table", "--dataset", "spot_the_diff", "--runs", *map(str, runs), "--out", str(out), "--paper-methods"])
    assert [(r["method"], r["kind"]) for r in _read(out) if r["kind"] == "paper"] == [("dirl_ccr", "paper")]


def test_image_editing_request_paper_numbers_pinned_and_cited():
    """CLIP4IDC Table 4 (B, M, C, R as printed), SCORER's comparison Table 4 with SPICE from its ablation Table 11,
    DIRL Table 5; CLIP-FT and DIRL without CCR are not reported on IER (empty rows); CLIP4IDC Table 6 retrieval."""
    ier = "image_editing_request"
    assert pn.lookup(ier, "total", "clip4idc").values == {"BLEU-4": 8.2, "METEOR": 14.6, "ROUGE-L": 40.4, "CIDEr": 32.2,
                                                          "SPICE": None}
    assert pn.lookup(ier, "total", "clip4idc").source == f"{pn.CLIP} Table 4"
    scorer = f"{pn.SCORER} Table 4 (SPICE: Table 11)"
    assert pn.lookup(ier, "total", "scorer").values == {"BLEU-4": 9.6, "METEOR": 14.6, "ROUGE-L": 39.5, "CIDEr": 31.0,
                                                        "SPICE": 12.6}
    assert pn.lookup(ier, "total", "scorer_cbr").values == {"BLEU-4": 10.0, "METEOR": 15.0, "ROUGE-L": 39.6,
                                                            "CIDEr": 33.4, "SPICE": 12.6}
    assert pn.lookup(ier, "total", "scorer").source == pn.lookup(ier, "total", "scorer_cbr").source == scorer
    assert pn.lookup(ier, "total", "dirl_ccr").values == {"BLEU-4": 10.9, "METEOR": 15.0, "ROUGE-L": 41.0, "CIDEr": 34.1,
                                                          "SPICE": None}
    assert pn.lookup(ier, "total", "transformer_dirl_ccr").source == f"{pn.DIRL} Table 5"  # alias of dirl_ccr
    for m in ("clip_ft", "dirl"):
        row = pn.lookup(ier, "total", m)
        assert all(v is None for v in row.values.values()) and "not reported on Image Editing Request" in row.note
    assert [r.method for r in pn.rows(ier, "total")] == ["scorer", "scorer_cbr", "dirl", "dirl_ccr", "clip_ft", "clip4idc"]
    assert pn.rows(ier, "changed") == pn.rows(ier, "distractor") == pn.rows(ier, "by_type") == []
    (ret,) = pn.retrieval_rows(ier)
    assert ret.values == {"P2T R@1": 17.1, "P2T R@5": 28.4, "P2T R@10": 33.8, "T2P R@1": 17.3, "T2P R@5": 33.7,
                          "T2P R@10": 41.9} and ret.source == f"{pn.CLIP} Table 6" and ret.run == "clip4idc_adapt"


def test_image_editing_request_table_puts_the_papers_rows_beside_ours(tmp_path):
    """As the `table` rule builds it from config/config.yaml's `image_editing_request` block: the reported methods'
    paper rows beside ours, the unreported ones (CLIP-FT, DIRL) as empty paper rows that say so."""
    import yaml

    block = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "config.yaml").read_text())["tables"][
        "image_editing_request"]
    assert block["methods"] == ["clip_ft", "clip4idc", "scorer", "scorer_cbr", "dirl", "dirl_ccr"]
    assert block["sanity"] == ["most_frequent", "nearest_neighbour"] and "paper_only" not in block
    runs = _plain_runs(tmp_path, "image_editing_request", (("scorer_cbr", "reproduced", 0.5), ("nearest_neighbour", "sanity", 0.2)))
    out = tmp_path / "tables" / "image_editing_request.csv"
    assert main(["table", "--dataset", "image_editing_request", "--runs", *map(str, runs), "--out", str(out),
                 "--paper-methods", *block["methods"]]) == 0
    rows = _read(out)
    got = {(r["method"], r["kind"]): r for r in rows}
    assert [(r["method"], r["kind"]) for r in rows if r["kind"] != "paper"] == [("scorer_cbr", "reproduced"),
                                                                                 ("nearest_neighbour", "sanity")]
    assert got[("scorer_cbr", "reproduced")]["source"] == "synthetic Image Editing Request"
    cbr = got[("scorer_cbr", "paper")]
    assert (cbr["BLEU-4"], cbr["METEOR"], cbr["ROUGE-L"], cbr["CIDEr"], cbr["SPICE"]) == ("10.0", "15.0", "39.6", "33.4", "12.6")
    assert cbr["source"] == "scorer-cbr-iccv2023.md Table 4 (SPICE: Table 11)"
    assert (got[("dirl_ccr", "paper")]["CIDEr"], got[("dirl_ccr", "paper")]["SPICE"]) == ("34.1", "n/a")
    assert (got[("clip4idc", "paper")]["ROUGE-L"], got[("clip4idc", "paper")]["source"]) == ("40.4", "clip4idc-aacl2022.md Table 4")
    notes = json.loads(out.with_suffix(".meta.json").read_text())["notes"]
    for m in ("clip_ft", "dirl"):  # an unreported method's paper row is empty and says why
        assert got[(m, "paper")]["CIDEr"] == got[(m, "paper")]["BLEU-4"] == "n/a"
        assert "not reported on Image Editing Request" in notes[got[(m, "paper")]["notes"]]
    # no paper rows where the papers report none: changed / distractor pairs, edit types
    assert {r["kind"] for r in _read(out.parent / "image_editing_request_pairs.csv")} == {"reproduced", "sanity"}
    assert {r["kind"] for r in _read(out.parent / "image_editing_request_by_type.csv")} == {"reproduced", "sanity"}


IDC_PCL_CONFIG = {"backbone": "resnet101_layer4", "init_from": "idc_pcl_pretrain",
                  "model": {"hidden": 512, "heads": 8, "ff": 2048, "layers": 3, "single_layers": 1, "pair_layers": 1},
                  "train": {"iterations": 1200, "batch_size": 32, "lr": 1e-4, "val_every": 40}}


def test_config_summary_is_derived_from_run_json():
    # without the first stage on disk the summary still names it
    assert tables.summarise_config(IDC_PCL_CONFIG, ("first stage", {})) == (
        "d=512, 1+1+3 layers, 1.2k steps, batch 32 + first stage (idc_pcl_pretrain)")
    pre = ("pre-training", {"train": {"iterations": 88, "batch_size": 8}})
    assert tables.summarise_config(IDC_PCL_CONFIG, pre) == ("d=512, 1+1+3 layers, 1.2k steps, batch 32 "
                                                            "+ pre-training (idc_pcl_pretrain) 88 steps, batch 8")
    duda = {"model": {"att_hidden": 128, "embed_dim": 300, "hidden": 512}, "train": {"iterations": 700, "batch_size": 32}}
    assert tables.summarise_config(duda) == "d=512, att 128, 700 steps, batch 32"
    scorer = {"model": {"dim": 512, "layers": 2, "decoder_layers": 2, "grid": 14, "pool": 7},
              "train": {"iterations": 10000, "batch_size": 128}}
    assert tables.summarise_config(scorer) == "d=512, 2+2 layers, 7×7 grid (pooled), 10k steps, batch 128"
    clip = {"model": {"clip": {"vision_width": 32, "vision_layers": 4}, "n_intra": 3, "layers": 1},
            "train": {"iterations": 4, "batch_size": 4}}
    assert tables.summarise_config(clip) == "CLIP w=32, 4 layers, N_intra=3 of 4, 1 layer, 4 steps, batch 4"
    clip["model"].update(cross_cell_bias=4.0, type_embedding=0.3)
    assert tables.summarise_config(clip) == ("CLIP w=32, 4 layers, N_intra=3 of 4, 1 layer, cross-cell attention bias, "
                                             "image type embedding, 4 steps, batch 4")
    aux = {"model": {"primary_model": {"hidden": 512, "att_hidden": 128}, "embed_dim": 256}, "train": {"iterations": 80}}
    assert tables.summarise_config(aux) == "d=512, att 128, aux d=256, 80 steps"
    aux["model"]["primary_model"].update(reduce="mean", own_difference=True, usage_weight=0.1)
    assert tables.summarise_config(aux) == ("d=512, att 128, aux d=256, attended features averaged, each map reads its "
                                            "own difference, balanced attention use, 80 steps")
    biased = {"model": {**IDC_PCL_CONFIG["model"], "cross_cell_bias": 4.0}, "train": {"iterations": 2000}}
    assert tables.summarise_config(biased) == "d=512, 1+1+3 layers, cross-cell attention bias, 2k steps"


def test_new_columns_distinct_captions_and_notes_written_once(tmp_path):
    pre = tmp_path / "idc_pcl_pretrain" / "seed0"
    write_json(pre / "pretrain.json", {"name": "idc_pcl_pretrain", "config": {"train": {"iterations": 88, "batch_size": 8}}})
    runs = [
        _run(tmp_path, "idc_pcl", 0, "reproduced", 1.0, config=IDC_PCL_CONFIG, selected=80,
             captions=["the cube changed color", "no change", "no change", "the cube changed color", "a sphere moved"]),
        _run(tmp_path, "duda", 0, "reproduced", 1.1, config={"model": {"hidden": 64}, "train": {"iterations": 12}},
             captions=["no change"] * 4),
        _run(tmp_path, "most_frequent", 0, "sanity", 0.3, captions=["no change"] * 4),
    ]
    run_json = runs[1] / "run.json"
    write_json(run_json, {**json.loads(run_json.read_text()), "precision": "bf16"})
    plot = tmp_path / "clevr_change" / "plots" / "duda.png"
    out = tmp_path / "tables" / "clevr_change.csv"
    assert main(["table", "--dataset", "clevr_change", "--runs", *map(str, runs), "--out", str(out),
                 "--plots", str(plot), str(plot.with_name("clevr_change_val_cider.png"))]) == 0
    rows = _read(out)
    assert {"config", "selected step", "distinct test captions", "notes"} <= set(rows[0]) and "note" not in rows[0]
    got = {(r["method"], r["kind"]): r for r in rows}
    pcl = got[("idc_pcl", "reproduced")]
    assert pcl["distinct test captions"] == "3" and pcl["selected step"] == "80"
    assert pcl["config"] == "d=512, 1+1+3 layers, 1.2k steps, batch 32 + pre-training (idc_pcl_pretrain) 88 steps, batch 8"
    assert got[("duda", "reproduced")]["distinct test captions"] == "1"
    assert got[("duda", "reproduced")]["config"] == "d=64, 12 steps, bf16"  # the run.json's resolved precision
    assert got[("most_frequent", "sanity")]["config"] == "" and got[("most_frequent", "sanity")]["selected step"] == ""
    assert got[("duda", "paper")]["distinct test captions"] == ""
    # the long notes are nowhere in the CSV cells; each is written once in the sidecar and once in the Markdown
    for r in rows:
        assert all("not comparable" not in v and "random(seed=0)" not in v for v in r.values())
    meta = json.loads((tmp_path / "tables" / "clevr_change.meta.json").read_text())
    texts = list(meta["notes"].values())
    assert len(texts) == len(set(texts))
    # a most-frequent run without a recorded margin keeps the plain note
    assert "sanity baseline: the most frequent training caption for every pair" in texts
    caveat = next(t for t in texts if "not comparable" in t)
    md = (tmp_path / "tables" / "clevr_change.md").read_text()
    assert md.count(caveat) == 1 and md.count("random(seed=0)") == 1
    n = next(k for k, t in meta["notes"].items() if t == caveat)
    assert all(n in r["notes"].split(",") for r in rows if r["kind"] != "paper")
    # the Markdown links the figures relative to itself
    assert "(../clevr_change/plots/duda.png)" in md and "![validation score (the selection metric) vs step](../clevr_change/plots/clevr_change_val_cider.png)" in md
    assert meta["plots"] == ["../clevr_change/plots/duda.png", "../clevr_change/plots/clevr_change_val_cider.png"]
    assert meta["orderings"] == []


def test_most_frequent_note_says_how_near_a_tie_the_caption_won(tmp_path):
    runs = [_run(tmp_path, "duda", 0, "reproduced", 1.1), _run(tmp_path, "most_frequent", 0, "sanity", 0.3)]
    run_json = runs[1] / "run.json"
    margin = {"caption": "there is no change", "count": 559, "runner_up": "no change was made",
              "runner_up_count": 554, "training_references": 10452}
    write_json(run_json, {**json.loads(run_json.read_text()), "config": {"caption_margin": margin}})
    out = tmp_path / "tables" / "clevr_change.csv"
    assert main(["table", "--dataset", "clevr_change", "--runs", *map(str, runs), "--out", str(out)]) == 0
    meta = json.loads((tmp_path / "tables" / "clevr_change.meta.json").read_text())
    note = ("sanity baseline: the most frequent training caption for every pair: 'there is no change' (559 of 10,452 "
            "training references; the next, 'no change was made', 554)")
    assert note in meta["notes"].values() and note in (tmp_path / "tables" / "clevr_change.md").read_text()


def test_ablation_ordering_is_computed_against_the_paper(tmp_path):
    # paper (SCORER Table 6), CIDEr: subtraction 119.7 < rr 123.8 < rr_cbr 125.5
    runs = [_run(tmp_path, "subtraction", 0, "reproduced", 0.70), _run(tmp_path, "rr", 0, "reproduced", 0.90),
            _run(tmp_path, "rr_cbr", 0, "reproduced", 0.80)]
    out = tmp_path / "t" / "ablation.csv"
    assert main(["table", "--dataset", "clevr_change", "--runs", *map(str, runs), "--out", str(out),
                 "--paper-methods", "--orderings"]) == 0
    meta = json.loads((tmp_path / "t" / "ablation.meta.json").read_text())
    total = next(o for o in meta["orderings"] if o["block"] == "total")
    assert [m for m, _ in total["paper"]] == ["subtraction", "rr", "rr_cbr"]
    assert [m for m, _ in total["here"]] == ["subtraction", "rr_cbr", "rr"]
    assert total["holds"] is False and total["inverted"] == [["rr", "rr_cbr"]]
    assert "here: subtraction 70.0 < rr_cbr 80.0 < rr 90.0" in total["statement"]
    assert "first difference at rank 2 from the bottom: paper rr, here rr_cbr" in total["statement"]
    assert total["statement"] in (tmp_path / "t" / "ablation.md").read_text()
    changed = next(o for o in meta["orderings"] if o["block"] == "changed")  # Table 7: 108.0 < 119.1 < 122.4
    assert changed["holds"] is False and changed["statement"] in (tmp_path / "t" / "ablation_pairs.md").read_text()

    same = [_run(tmp_path / "b", m, 0, "reproduced", c) for m, c in (("subtraction", 0.7), ("rr", 0.8), ("rr_cbr", 0.9))]
    main(["table", "--dataset", "clevr_change", "--runs", *map(str, same), "--out", str(tmp_path / "b.csv"), "--paper-methods",
          "--orderings"])
    ok = json.loads((tmp_path / "b.meta.json").read_text())["orderings"][0]
    assert ok["holds"] is True and ok["statement"].endswith("the paper's ordering holds")


def test_ordering_falls_back_to_another_dataset_and_says_so(tmp_path):
    # the DIRL ablation rows have paper numbers on CLEVR-DC only (DIRL Table 6)
    runs = [_run(tmp_path, "transformer", 0, "reproduced", 0.9), _run(tmp_path, "dirl", 0, "reproduced", 0.8)]
    o = tables.ordering(tables.total_rows(tables.load_runs(runs, "clevr_change"), "clevr_change", []), "clevr_change", "total")
    assert o["paper_dataset"] == "clevr_dc" and "reported on CLEVR-DC only" in o["statement"]
    assert o["holds"] is False and [m for m, _ in o["paper"]] == ["transformer", "dirl"]
    single = tables.ordering(tables.total_rows(tables.load_runs(runs[:1], "clevr_change"), "clevr_change", []),
                             "clevr_change", "total")
    assert single["holds"] is None and "no ordering to compare" in single["statement"]


def test_dirl_table7_rows_are_compared_with_their_paper_rows(tmp_path):
    """DIRL Table 7 (CLEVR-DC): the rows with one term of Eq. (4) carry the paper's numbers (CIDEr 79.3, 79.5;
    Transformer 79.6 and DIRL 81.8 from Table 6) and the table says whether their ordering holds."""
    runs = [_run(tmp_path, m, 0, "reproduced", c, dataset="clevr_dc")
            for m, c in (("transformer", 0.5), ("dirl_nonpert", 0.6), ("dirl_discrim", 0.7), ("dirl", 0.8))]
    out = tmp_path / "t" / "clevr_dc_ablation_dirl_terms.csv"
    assert main(["table", "--dataset", "clevr_dc", "--runs", *map(str, runs), "--out", str(out), "--paper-methods",
                 "--orderings"]) == 0
    paper = {r["method"]: r["CIDEr"] for r in _read(out) if r["kind"] == "paper"}
    assert {m: float(paper[m]) for m in ("dirl_nonpert", "dirl_discrim")} == {"dirl_nonpert": 79.3, "dirl_discrim": 79.5}
    total = next(o for o in json.loads(out.with_suffix(".meta.json").read_text())["orderings"] if o["block"] == "total")
    assert [m for m, _ in total["paper"]] == ["dirl_nonpert", "dirl_discrim", "transformer", "dirl"]
    assert total["holds"] is False and total["inverted"]


def test_retrieval_table_shares_the_compact_columns_and_notes(tmp_path):
    d = tmp_path / "clip4idc_adapt" / "seed0"
    config = {"model": {"clip": {"vision_width": 32, "vision_layers": 4}, "n_intra": 3},
              "train": {"iterations": 4, "batch_size": 4}}
    write_json(d / "run.json", {"method": "clip4idc_adapt", "stage": "adapt-clip4idc", "dataset": "clevr_change", "seed": 0,
                                "kind": "reproduced", "source": "synthetic", "backbone": "clip_pixels224",
                                "weights": "CLIP random(seed=0)", "selected_step": 2, "config": config})
    direction = {"R@1": 0.1, "R@5": 0.3, "R@10": 0.5, "MedianR": 9.0, "MeanR": 12.5}
    write_json(d / "retrieval_test.json", {"split": "test", "n_pairs": 6, "pair_to_text": direction, "text_to_pair": direction})
    out = tmp_path / "tables" / "clevr_change_retrieval.csv"
    assert main(["retrieval-table", "--dataset", "clevr_change", "--runs", str(d), "--out", str(out)]) == 0
    rows = {r["kind"]: r for r in _read(out)}
    ours = rows["reproduced"]
    assert ours["config"] == "CLIP w=32, 4 layers, N_intra=3 of 4, 4 steps, batch 4" and ours["selected step"] == "2"
    assert ours["weights"] == "CLIP random" and ours["P2T R@1"] == "10.0" and rows["paper"]["P2T R@1"] == "46.4"
    notes = json.loads(out.with_suffix(".meta.json").read_text())["notes"]
    caveat = notes[ours["notes"]]
    assert "not comparable to the paper rows" in caveat and "CLIP random(seed=0)" in caveat
    assert out.with_suffix(".md").read_text().count(caveat) == 1


def test_retrieval_table_shows_the_recall_levels_its_paper_rows_report(tmp_path):
    """CLIP4IDC Table 6 reports Spot-the-Diff at R@10/20/50: its table gains R@20/R@50, CLEVR-Change's does not; a
    run without them (written before they were computed) shows n/a."""
    direction = {"R@1": 0.1, "R@5": 0.3, "R@10": 0.5, "R@20": 0.7, "R@50": 0.9, "MedianR": 9.0, "MeanR": 12.5}
    cols = {}
    for dataset, keys in (("spot_the_diff", direction), ("clevr_change", direction),
                          ("spot_the_diff", {k: v for k, v in direction.items() if k not in ("R@20", "R@50")})):
        d = tmp_path / dataset / str(len(keys)) / "clip4idc_adapt" / "seed0"
        write_json(d / "run.json", {"method": "clip4idc_adapt", "dataset": dataset, "seed": 0, "kind": "reproduced",
                                    "source": "synthetic", "backbone": "clip_pixels224", "weights": "CLIP random(seed=0)",
                                    "selected_step": 2, "config": {}})
        write_json(d / "retrieval_test.json", {"split": "test", "n_pairs": 6, "pair_to_text": keys, "text_to_pair": keys})
        out = tmp_path / "tables" / f"{dataset}_{len(keys)}_retrieval.csv"
        assert main(["retrieval-table", "--dataset", dataset, "--runs", str(d), "--out", str(out),
                     "--paper-runs", "clip4idc_adapt"]) == 0
        rows = {r["kind"]: r for r in _read(out)}
        cols[(dataset, len(keys))] = [c for c in rows["paper"] if c.startswith(("P2T", "T2P")) and not c.endswith("std")]
        if dataset == "spot_the_diff":
            assert (rows["paper"]["P2T R@10"], rows["paper"]["T2P R@50"], rows["paper"]["P2T R@1"]) == ("3.7", "20.0", "n/a")
            assert rows["paper"]["source"] == "clip4idc-aacl2022.md Table 6"
            assert rows["reproduced"]["T2P R@20"] == ("70.0" if len(keys) == 7 else "n/a")
            assert "| P2T R@50 |" in out.with_suffix(".md").read_text()
    assert cols[("clevr_change", 7)] == list(pn.RETRIEVAL_COLUMNS)
    assert cols[("spot_the_diff", 7)] == cols[("spot_the_diff", 5)] == list(pn.RETRIEVAL_ALL_COLUMNS)


def test_image_editing_request_retrieval_table_beside_clip4idc_table_6(tmp_path):
    """CLIP4IDC Table 6 reports Editing-Request at R@1/5/10 without ranks: the standard columns, MdR/MnR n/a."""
    ier = "image_editing_request"
    d = tmp_path / ier / "clip4idc_adapt" / "seed0"
    write_json(d / "run.json", {"method": "clip4idc_adapt", "dataset": ier, "seed": 0, "kind": "reproduced",
                                "source": "synthetic", "backbone": "clip_pixels224", "weights": "CLIP random(seed=0)",
                                "selected_step": 2, "config": {}})
    direction = {"R@1": 0.1, "R@5": 0.3, "R@10": 0.5, "R@20": 0.7, "R@50": 0.9, "MedianR": 9.0, "MeanR": 12.5}
    write_json(d / "retrieval_test.json", {"split": "test", "n_pairs": 6, "pair_to_text": direction,
                                           "text_to_pair": direction})
    out = tmp_path / "tables" / f"{ier}_retrieval.csv"
    assert main(["retrieval-table", "--dataset", ier, "--runs", str(d), "--out", str(out),
                 "--paper-runs", "clip4idc_adapt"]) == 0
    rows = {r["kind"]: r for r in _read(out)}
    paper = rows["paper"]
    assert [c for c in paper if c.startswith(("P2T", "T2P")) and not c.endswith("std")] == list(pn.RETRIEVAL_COLUMNS)
    assert (paper["P2T R@1"], paper["T2P R@10"], paper["P2T MdR"], paper["T2P MnR"]) == ("17.1", "41.9", "n/a", "n/a")
    assert paper["source"] == "clip4idc-aacl2022.md Table 6" and rows["reproduced"]["P2T R@1"] == "10.0"


def test_by_type_table_of_a_dataset_without_clevr_types(tmp_path):
    """Spot-the-Diff's pairs are all ``change``: one column per type its metrics hold, no paper by-type rows;
    CLEVR's metrics keep the six paper columns."""
    runs = []
    for seed, cider in ((0, 1.0), (1, 1.2)):
        d = _run(tmp_path, "duda", seed, "reproduced", cider=cider, dataset="spot_the_diff")
        m = json.loads((d / "metrics.json").read_text())
        m["by_type"] = {"subset_idf": {"change": _block(cider, n=20)},
                        "global_idf": {"change": {"CIDEr": cider, "n_pairs": 20}}}
        write_json(d / "metrics.json", m)
        runs.append(d)
    out = tmp_path / "tables" / "spot_the_diff.csv"
    assert main(["table", "--dataset", "spot_the_diff", "--runs", *map(str, runs), "--out", str(out)]) == 0
    bt = _read(out.parent / "spot_the_diff_by_type.csv")
    assert [(r["method"], r["kind"]) for r in bt] == [("duda", "reproduced")]
    assert bt[0]["change"] == "110.0" and bt[0]["change (global IDF)"] == "110.0" and "Color" not in bt[0]
    assert bt[0]["n_pairs"] == "change:20"
    md = (out.parent / "spot_the_diff_by_type.md").read_text()
    assert "Texture = `material`" not in md and "| seeds | change | notes |" in md
    assert "| seeds | change (global IDF) | notes |" in md
    groups = tables.load_runs(runs, "spot_the_diff")
    assert tables.type_columns(groups) == {"change": "change"}
    clevr = tables.load_runs([_run(tmp_path / "c", "duda", 0, "reproduced", cider=1.0)], "clevr_change")
    assert tables.type_columns(clevr) == pn.TYPE_TO_CHANGE


def test_contrasts_say_whether_each_addition_helps_here_beside_the_papers_difference(tmp_path):
    """Birds-to-Words (IDC-PCL Table 5): +CUB over IDC-PCL, paper ROUGE-L 48.4 -> 48.5, CIDEr 18.6 -> 23.8."""
    def run(method, rouge, cider, val):
        d = _run(tmp_path, method, 0, "reproduced", cider, dataset="birds_to_words")
        info = json.loads((d / "run.json").read_text())
        write_json(d / "run.json", {**info, "val_CIDEr": None, "val_ROUGE_L": val})
        m = json.loads((d / "metrics.json").read_text())
        m["total"]["ROUGE_L"] = rouge
        write_json(d / "metrics.json", m)
        return d

    runs = [run("idc_pcl", 0.40, 0.20, 0.41), run("idc_pcl_cub", 0.45, 0.18, 0.44), run("idc_pcl_nabirds", 0.46, 0.25, 0.47)]
    out = tmp_path / "t" / "birds_to_words.csv"
    assert main(["table", "--dataset", "birds_to_words", "--runs", *map(str, runs), "--out", str(out), "--paper-methods",
                 "--contrasts", "idc_pcl_cub:idc_pcl", "idc_pcl_nabirds:idc_pcl", "idc_pcl_cub_nabirds:idc_pcl"]) == 0
    got = json.loads((tmp_path / "t" / "birds_to_words.meta.json").read_text())["contrasts"]
    cub, nab, both = got
    assert cub["here"] == pytest.approx({"ROUGE-L": 5.0, "CIDEr": -2.0})
    assert cub["paper"] == pytest.approx({"ROUGE-L": 0.1, "CIDEr": 5.2}) and "Table 5" in cub["paper_source"]
    assert cub["helps"] is None and cub["statement"].endswith("mixed here (ROUGE-L up, CIDEr down)")
    assert "validation ROUGE-L at the selected step 41.0 -> 44.0" in cub["statement"]
    assert nab["helps"] is True and nab["statement"].endswith("— helps here (every metric up)")
    worse = tables.contrast([{"method": "a", "kind": "reproduced", "ROUGE-L": (40.0, None), "CIDEr": (20.0, None)},
                             {"method": "b", "kind": "reproduced", "ROUGE-L": (41.0, None), "CIDEr": (22.0, None)}],
                            [], "birds_to_words", "a", "b")
    assert worse["helps"] is False and worse["statement"].endswith("does not help here (every metric down)")
    assert both["helps"] is None and "idc_pcl_cub_nabirds not in this table" in both["statement"]
    md = (tmp_path / "t" / "birds_to_words.md").read_text()
    assert "Does each addition help here?" in md and cub["statement"] in md and nab["statement"] in md
    with pytest.raises(PipelineError, match="METHOD:BASE"):
        tables.run(tables.argparse.Namespace(dataset="birds_to_words", runs=list(map(str, runs)), out=str(out),
                                             paper_methods=[], plots=[], orderings=False, contrasts=["idc_pcl_cub"]))
