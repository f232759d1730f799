import copy
from pathlib import Path

import pytest
import yaml

from pipeline.config import load, merge, run_config, run_section, validate
from pipeline.errors import PipelineError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path", ["config/config.yaml", "config/paper.yaml", ".test/config/config.yaml"])
def test_shipped_configs_are_valid(path):
    load(ROOT / path)


def test_unknown_key_is_named_with_its_place():
    cfg = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    bad = copy.deepcopy(cfg)
    bad["methods"]["duda"]["train"]["learning_rate"] = 1
    with pytest.raises(PipelineError, match=r"unknown key 'learning_rate' under methods\.duda\.train"):
        validate(bad)
    bad = copy.deepcopy(cfg)
    bad["features"]["resnet101_layer3"]["dtype"] = "int8"
    with pytest.raises(PipelineError, match=r"features\.resnet101_layer3\.dtype"):
        validate(bad)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["methods"]["idc_pcl"].update(init_from="idc_pcl_pretrainn"),
     r"methods\.idc_pcl\.init_from: 'idc_pcl_pretrainn' is not a run under pretraining \(configured: .*idc_pcl_pretrain,"),
    (lambda c: c["methods"]["duda"].update(init_from="clip4idc_adapt_typo"), r"methods\.duda\.init_from: 'clip4idc_adapt_typo'"),
    (lambda c: c["tables"]["clevr_change"]["methods"].append("dudaa"),
     r"tables\.clevr_change\.methods: unknown method 'dudaa' \(not under methods\)"),
    (lambda c: c["tables"]["clevr_change"]["methods"].append("duda"), r"tables\.clevr_change\.methods: .*non-unique"),
    (lambda c: c.update(seeds=[0, 0]), r"seeds: \[0, 0\] has non-unique elements"),
    (lambda c: c["tables"].update(clevr_chnage={"methods": ["duda"]}),
     r"tables\.clevr_chnage: dataset 'clevr_chnage' is not under datasets \(set tables\.clevr_chnage\.dataset\)"),
    # paper-only rows: a typo, a row of another dataset, a trained method
    (lambda c: c["tables"]["spot_the_diff"]["paper_only"].append("dlda"),
     r"tables\.spot_the_diff\.paper_only: no paper row of 'dlda' for dataset 'spot_the_diff'"),
    (lambda c: c["tables"]["clevr_change"].update(paper_only=["ddla"]),
     r"tables\.clevr_change\.paper_only: no paper row of 'ddla' for dataset 'clevr_change'"),
    (lambda c: c["tables"]["spot_the_diff"]["paper_only"].append("dirl"),
     r"tables\.spot_the_diff\.paper_only: 'dirl' is a method under methods"),
    # contrasts compare two rows of the table
    (lambda c: c["tables"]["birds_to_words"].update(contrasts=[["idc_pcl_cub_nabirds", "duda"]]),
     r"tables\.birds_to_words\.contrasts: 'duda' is not one of tables\.birds_to_words\.methods"),
    # ResNet-D shortcuts are for the random stand-in only
    (lambda c: c["features"]["resnet101_layer4"].update(weights="imagenet"),
     r"features\.resnet101_layer4: shortcut avg_down needs weights random"),
])
def test_references_between_blocks_are_checked(edit, message):
    cfg = yaml.safe_load((ROOT / ".test/config/config.yaml").read_text())
    edit(cfg)
    with pytest.raises(PipelineError, match=message):
        validate(cfg, source="config")


def test_a_method_without_a_model_is_named(monkeypatch):
    """The schema admits the CLIP4IDC sweep ids by pattern; the model factory must resolve each (the CPU-sized
    sweep's intra3..6 ids once had no model, found only when its training job started)."""
    import pipeline.models as models

    monkeypatch.setattr(models, "PATTERNS", [])
    with pytest.raises(PipelineError, match=r"methods\.clip4idc_frozen_intra3_inter3: no model is registered"):
        load(ROOT / "config/config.yaml")


def test_dataset_overrides_merge_over_the_method_block():
    cfg = yaml.safe_load((ROOT / ".test/config/config.yaml").read_text())
    base = copy.deepcopy(cfg["methods"]["dirl"])
    cfg["datasets"]["clevr_dc"]["overrides"] = {"dirl": {"backbone": "resnet101_layer4", "train": {"lr": 0.5}},
                                                "idc_pcl_pretrain": {"train": {"iterations": 7}}}
    validate(cfg)
    dc = run_config(cfg, "clevr_dc", "dirl")
    assert dc["backbone"] == "resnet101_layer4" and dc["train"]["lr"] == 0.5
    # every key the override does not name is the method's own, at every depth
    assert {k: v for k, v in dc["train"].items() if k != "lr"} == {k: v for k, v in base["train"].items() if k != "lr"}
    assert dc["model"] == base["model"]
    assert run_config(cfg, "clevr_dc", "idc_pcl_pretrain")["train"]["iterations"] == 7
    # the other dataset, and the configured blocks themselves, are untouched
    assert run_config(cfg, "image_editing_request", "dirl") is cfg["methods"]["dirl"] and cfg["methods"]["dirl"] == base
    assert merge({"a": {"b": 1, "c": 2}, "d": [1]}, {"a": {"b": 3}, "d": [2]}) == {"a": {"b": 3, "c": 2}, "d": [2]}


def test_dataset_run_defaults_fill_what_a_block_lacks_under_the_overrides():
    cfg = yaml.safe_load((ROOT / ".test/config/config.yaml").read_text())
    base = copy.deepcopy(cfg["methods"]["dirl"])
    assert "precision" not in base["train"] and "lr" in base["train"]
    # a block's own setting wins over the dataset's default (a copy: YAML anchors share the train blocks)
    cfg["methods"]["scorer"]["train"] = {**cfg["methods"]["scorer"]["train"], "precision": "fp32"}
    cfg["datasets"]["clevr_dc"]["run_defaults"] = {"train": {"precision": "fast", "lr": 0.25}}
    cfg["datasets"]["clevr_dc"]["overrides"] = {"dirl": {"train": {"lr": 0.5, "precision": "bf16"}}}
    validate(cfg)
    # the override wins over both; every key neither names is the block's own
    assert run_config(cfg, "clevr_dc", "dirl")["train"] == {**base["train"], "precision": "bf16", "lr": 0.5}
    assert run_config(cfg, "clevr_dc", "scorer")["train"]["precision"] == "fp32"
    for section in ("methods", "pretraining"):
        for name, block in cfg[section].items():
            train = run_config(cfg, "clevr_dc", name)["train"]
            if name not in ("dirl", "scorer"):
                assert train["precision"] == "fast", name  # filled in: no block here sets it
            assert train["lr"] == (0.5 if name == "dirl" else block["train"]["lr"]), name  # every block sets lr
            # other datasets untouched
            assert "precision" not in run_config(cfg, "image_editing_request", name)["train"] or name == "scorer"
    assert cfg["methods"]["dirl"] == base
    # a default that leaves some run's block invalid is named with that run
    cfg["datasets"]["clevr_dc"]["run_defaults"] = {"train": {"learning_rate": 1.0}}
    with pytest.raises(PipelineError, match=r"datasets\.clevr_dc\.run_defaults merged over methods\.\w+: unknown key "
                                            r"'learning_rate'"):
        validate(cfg, source="config")
    cfg["datasets"]["clevr_dc"]["run_defaults"] = {"model": {"dim": 64}}  # model keys differ by method: train only
    with pytest.raises(PipelineError, match=r"unknown key 'model' under datasets\.clevr_dc\.run_defaults"):
        validate(cfg, source="config")


def test_the_tiny_configuration_keeps_every_run_tiny_over_the_default():
    # tests/test_workflow.py passes .test/config/config.yaml with --configfile, which Snakemake merges over
    # config/config.yaml: a default budget the tiny file does not reset reaches the end-to-end test (CLEVR-Change's
    # 1800-step DIRL+CCR override once did, at validation every 2 steps).
    default = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    tiny = yaml.safe_load((ROOT / ".test/config/config.yaml").read_text())
    cfg = merge(default, tiny)
    runs = [n for section in ("methods", "pretraining") for n in tiny.get(section, {})]
    trains = {(d, n): run_config(cfg, d, n)["train"] for d in tiny["datasets"] for n in runs}
    budgets = {k: t["iterations"] for k, t in trains.items()}
    assert max(budgets.values()) <= 20, {k: v for k, v in budgets.items() if v > 20}
    # and every tiny run validates inside its budget (a default val_every of 200 once leaked over 4 steps)
    late = {k: t.get("val_every") for k, t in trains.items() if t.get("val_every", 0) > t["iterations"]}
    assert not late, late
    # and every tiny CLIP keeps the tiny block's size (the default's CLEVR-Change ViT width once leaked)
    own = {n: tiny[run_section(tiny, n)][n]["model"].get("clip") for n in runs}
    sizes = {(d, n): run_config(cfg, d, n)["model"].get("clip") for d in tiny["datasets"] for n in runs}
    wide = {k: c for k, c in sizes.items() if c != own[k[1]]}
    assert not wide, wide
    # the check itself sees a default override that leaks
    default["datasets"]["clevr_change"].setdefault("overrides", {})["scorer"] = {"train": {"iterations": 900}}
    assert run_config(merge(default, tiny), "clevr_change", "scorer")["train"]["iterations"] == 900


@pytest.mark.parametrize("override, message", [
    ({"dirll": {"train": {"lr": 1.0}}}, r"datasets\.clevr_dc\.overrides: 'dirll' is neither under methods nor under pretraining"),
    ({"dirl": {"train": {"learning_rate": 1.0}}},
     r"datasets\.clevr_dc\.overrides\.dirl merged over methods\.dirl: unknown key 'learning_rate' under methods\.dirl\.train"),
    ({"dirl": {"backbone": "resnet50"}}, r"datasets\.clevr_dc\.overrides\.dirl merged over methods\.dirl: methods\.dirl\.backbone"),
    ({"idc_pcl": {"init_from": "idc_pcl_pretrain_mlm"}}, r"datasets\.clevr_dc\.overrides\.idc_pcl"),
])
def test_a_bad_dataset_override_is_named(override, message):
    cfg = yaml.safe_load((ROOT / ".test/config/config.yaml").read_text())
    cfg["datasets"]["clevr_dc"]["overrides"] = override
    with pytest.raises(PipelineError, match=message):
        validate(cfg, source="config")
