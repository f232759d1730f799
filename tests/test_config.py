import copy
from pathlib import Path

import pytest
import yaml

from pipeline.config import load, validate
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
