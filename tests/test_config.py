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
