import argparse

import h5py
import numpy as np
import pytest

from pipeline import text
from pipeline.errors import PipelineError
from pipeline.utils.io import write_jsonl


def test_tokenize_follows_the_duda_preprocessing():
    assert text.tokenize("The red cube, behind the ball; moved.") == [
        "the", "red", "cube", ",", "behind", "the", "ball", ";", "moved"]
    assert text.tokenize("Is it gone?") == ["is", "it", "gone"]


def test_vocab_encode_decode_round_trip_and_truncation():
    v = text.Vocab.build(["the cube moved", "the ball is gone"])
    assert v.itow[:4] == text.SPECIALS and len(v) == 4 + 6
    ids, trunc = v.encode("the cube is gone", max_words=6)
    assert not trunc and ids[0] == text.START and list(ids).count(text.END) == 1 and len(ids) == 8
    assert v.decode(ids) == "the cube is gone"
    ids, trunc = v.encode("the cube is gone", max_words=2)
    assert trunc and v.decode(ids) == "the cube"
    assert v.decode(v.encode("the sphere", 4)[0]) == "the <UNK>"
    with pytest.raises(PipelineError):
        text.Vocab(["a", "b"])


def test_text_stage_vocab_from_train_only_and_labels_file(tmp_path):
    recs = [
        {"pair_id": "000000.png", "split": "train", "captions": ["the cube moved", "the block moved"]},
        {"pair_id": "000000.png_n", "split": "train", "captions": ["nothing has changed"]},
        {"pair_id": "000001.png", "split": "test", "captions": ["the ball is gone"]},
    ]
    write_jsonl(tmp_path / "m.jsonl", recs)
    text.run(argparse.Namespace(manifest=str(tmp_path / "m.jsonl"), out_dir=str(tmp_path / "t"), max_words=5, min_count=1))
    v = text.Vocab.load(tmp_path / "t" / "vocab.json")
    assert "ball" not in v.wtoi and "block" in v.wtoi  # the vocabulary never sees test captions
    lab = text.Labels(tmp_path / "t" / "labels.h5")
    assert [v.decode(r) for r in lab.of("000000.png")] == ["the cube moved", "the block moved"]
    assert v.decode(lab.of("000001.png")[0]) == "the <UNK> <UNK> <UNK>"
    with h5py.File(tmp_path / "t" / "labels.h5") as f:
        assert f["labels"].shape == (4, 7) and f["labels"].dtype == np.int32
    with pytest.raises(PipelineError, match="nope"):
        lab.of("nope")
