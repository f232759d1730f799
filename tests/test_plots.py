"""Learning-curve figures: which log records are read, and that both figures are written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import plots
from pipeline.__main__ import main
from pipeline.utils.io import write_json


def _log(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def _rec(step, loss, score, **parts):
    return {"step": step, "loss": loss, **parts, "train_steps": 5, "lr": 1e-3, "val_score": score, "elapsed_s": step}


def _captioning_run(root: Path, method="duda", seed=0, selected=10) -> Path:
    d = root / method / f"seed{seed}"
    write_json(d / "run.json", {"method": method, "kind": "reproduced", "seed": seed, "selected_step": selected,
                                "config": {"train": {"iterations": 15}}})
    _log(d / "train_log.jsonl", [
        {"event": "started", "step": 0},
        _rec(5, 3.0, 0.2, ce_pos=2.0, hard_set=0.0), _rec(10, 2.0, 0.5, ce_pos=1.5, hard_set=1.0),
        _rec(15, 1.5, 0.4, ce_pos=1.0, hard_set=1.0),
    ])
    return d


def test_read_log_keeps_the_last_run_and_splices_resumed_sessions(tmp_path):
    log = tmp_path / "train_log.jsonl"
    _log(log, [{"event": "started"}, _rec(5, 9.0, 0.9), _rec(10, 9.0, 0.9)])  # an older configuration's run
    _log(log, [{"event": "started", "step": 0}, _rec(5, 3.0, 0.1), _rec(10, 2.0, 0.2)])
    _log(log, [{"event": "resumed", "step": 5}, _rec(10, 2.5, 0.3), _rec(15, 1.0, 0.4)])  # interrupted at 5..10
    recs = plots.read_log(log)
    assert [(r["step"], r["loss"]) for r in recs] == [(5, 3.0), (10, 2.5), (15, 1.0)]


def test_pretraining_validation_records_merge_into_their_step(tmp_path):
    d = tmp_path / "idc_pcl_pretrain" / "seed0"
    write_json(d / "pretrain.json", {"name": "idc_pcl_pretrain", "steps": 8, "config": {"train": {"iterations": 8}}})
    _log(d / "train_log.jsonl", [
        {"event": "started", "step": 0},
        {"validation": 1, "val_mlm": 4.0, "val_mlm_acc": 0.1}, _rec(4, 5.0, 1.0, mlm=5.0, mlm_acc=0.05),
        {"validation": 2, "val_mlm": 3.0, "val_mlm_acc": 0.2}, _rec(8, 4.0, 2.0, mlm=4.0, mlm_acc=0.1),
    ])
    run = plots.load_run(d)
    assert run.stage == "pre-training" and run.selected_step == 8  # no selection: the last step is kept
    assert [r["val_mlm"] for r in run.records] == [4.0, 3.0]
    assert plots.loss_keys(run.records) == ["loss", "mlm"]
    assert plots.diagnostic_keys(run.records) == ["mlm_acc"]
    assert plots.validation_keys(run.records) == ["val_mlm", "val_mlm_acc"]


def test_method_and_table_figures_are_written(tmp_path, monkeypatch):
    first = tmp_path / "idc_pcl_pretrain" / "seed0"
    write_json(first / "pretrain.json", {"name": "idc_pcl_pretrain", "steps": 4})
    _log(first / "train_log.jsonl", [{"validation": 1, "val_mlm": 4.0}, _rec(4, 5.0, 1.0, mlm=5.0)])
    run = _captioning_run(tmp_path, "idc_pcl")
    other = _captioning_run(tmp_path, "duda", selected=15)
    out = tmp_path / "plots"
    assert main(["plots", "--method", "idc_pcl", "--runs", str(run), "--first-stage", str(first),
                 "--out", str(out / "idc_pcl.png")]) == 0
    assert (out / "idc_pcl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    sanity = tmp_path / "most_frequent" / "seed0"
    write_json(sanity / "run.json", {"method": "most_frequent", "kind": "sanity", "seed": 0})
    write_json(sanity / "predictions_val.json", [{"image_id": "a", "caption": "no change"}])
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text(json.dumps({"pair_id": "a", "split": "val", "captions": ["no change"]}) + "\n")
    seen = {}

    def fake_score(refs, preds, metrics=None):  # the scorer itself is tested in test_evaluate.py
        seen.update(refs=refs, preds=preds, metrics=metrics)
        return {"CIDEr": 0.7}

    monkeypatch.setattr("pipeline.evaluate.score", fake_score)
    assert plots.sanity_val_cider([sanity], manifest) == {"most_frequent": pytest.approx(70.0)}
    assert seen == {"refs": {"a": ["no change"]}, "preds": {"a": "no change"}, "metrics": ("CIDEr",)}
    assert main(["plots", "--table", "clevr_change", "--runs", str(run), str(other), "--sanity", str(sanity),
                 "--manifest", str(manifest), "--out", str(out / "clevr_change_val_cider.png")]) == 0
    assert (out / "clevr_change_val_cider.png").stat().st_size > 1000
    assert not list(out.glob(".*tmp"))  # atomic: no temporary left behind


def test_curves_of_one_panel_have_distinct_colours_beyond_the_palette(tmp_path, monkeypatch):
    """IDC-PCL's figure: its pre-training logs more keys (losses, validation, diagnostics) than the palette's 10
    colours; its fine-tuning's ``mlm`` and ``dj`` were drawn in one colour."""
    first = tmp_path / "idc_pcl_pretrain" / "seed0"
    write_json(first / "pretrain.json", {"name": "idc_pcl_pretrain", "steps": 8})
    val = {"val_mlm": 4.0, "val_mlm_acc": 0.1, "val_fda": 1.9, "val_fda_acc": 0.2, "val_mvcl": 6.0}
    _log(first / "train_log.jsonl", [{"validation": 1, **val}, _rec(4, 5.0, 1.0, mlm=5.0, fda=1.9, mvcl=6.0,
                                                                     mlm_acc=0.1, fda_acc=0.2),
                                     {"validation": 2, **val}, _rec(8, 4.0, 1.0, mlm=4.0, fda=1.8, mvcl=5.9,
                                                                     mlm_acc=0.2, fda_acc=0.3)])
    run = tmp_path / "idc_pcl" / "seed0"
    write_json(run / "run.json", {"method": "idc_pcl", "kind": "reproduced", "seed": 0, "selected_step": 10})
    _log(run / "train_log.jsonl", [_rec(5, 3.0, 0.2, mlm=2.0, dj=1.0, dj_acc=0.5),
                                   _rec(10, 2.0, 0.5, mlm=1.5, dj=0.5, dj_acc=0.7)])
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, out: figures.append(fig))
    plots.method_figure("idc_pcl", [plots.load_run(run)], [plots.load_run(first)], tmp_path / "f.png")
    (fig,) = figures
    for ax in fig.axes:
        curves = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
        colours = [line.get_color() for line in curves]
        assert len(colours) == len(set(colours)), (ax.get_title(), [(c.get_label(), c.get_color()) for c in curves])
    mlm = [line.get_color() for ax in fig.axes if "train losses" in ax.get_title()
           for line in ax.get_lines() if line.get_label() == "mlm"]
    assert len(mlm) == 2 and mlm[0] == mlm[1]  # a key keeps its colour across the stages


def test_a_run_without_a_log_is_drawn_not_fatal(tmp_path):
    d = tmp_path / "duda" / "seed0"
    write_json(d / "run.json", {"method": "duda", "kind": "reproduced", "seed": 0, "selected_step": 5})
    assert main(["plots", "--method", "duda", "--runs", str(d), "--out", str(tmp_path / "duda.png")]) == 0
    assert plots.load_run(d).records == []


def test_figures_name_the_metric_the_runs_select_on_and_score_the_sanity_rows_with_it(tmp_path, monkeypatch):
    """Birds-to-Words selects on ROUGE-L: its runs' val_score is ROUGE-L, and the axes and the sanity lines say so."""
    runs = []
    for method in ("idc_pcl", "idc_pcl_cub"):
        d = _captioning_run(tmp_path, method)
        info = json.loads((d / "run.json").read_text())
        write_json(d / "run.json", {**info, "val_CIDEr": None, "val_ROUGE_L": 0.5})
        runs.append(d)
    loaded = [plots.load_run(d) for d in runs]
    assert [r.metric for r in loaded] == ["ROUGE_L", "ROUGE_L"]
    assert plots.load_run(_captioning_run(tmp_path / "cc", "duda")).metric == "CIDEr"  # no val_ key: CIDEr
    assert plots._score_axis("captioning", "ROUGE_L")[0] == "validation ROUGE-L (x100)"
    labels = {}
    orig = plots._save

    def spy(fig, out):
        labels[Path(out).name] = [ax.get_ylabel() for ax in fig.axes] + [fig._suptitle.get_text()]
        orig(fig, out)

    monkeypatch.setattr(plots, "_save", spy)
    seen = {}
    monkeypatch.setattr("pipeline.evaluate.score", lambda refs, preds, metrics=None: seen.setdefault("m", metrics) and {"ROUGE_L": 0.2})
    sanity = tmp_path / "most_frequent" / "seed0"
    write_json(sanity / "run.json", {"method": "most_frequent", "kind": "sanity", "seed": 0})
    write_json(sanity / "predictions_val.json", [{"image_id": "a", "caption": "x"}])
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text(json.dumps({"pair_id": "a", "split": "val", "captions": ["x"]}) + "\n")
    assert main(["plots", "--table", "birds_to_words", "--runs", *map(str, runs), "--sanity", str(sanity),
                 "--manifest", str(manifest), "--out", str(tmp_path / "b2w_val_cider.png")]) == 0
    assert seen["m"] == ("ROUGE_L",)
    got = labels["b2w_val_cider.png"]
    assert got[0] == got[1] == "validation ROUGE-L (x100)" and "ROUGE-L" in got[-1] and "CIDEr" not in " ".join(got)
    mixed = plots.load_run(_captioning_run(tmp_path / "cc", "duda"))
    with pytest.raises(plots.PipelineError, match="different metrics"):
        plots.table_metric({"a": loaded, "b": [mixed]})
