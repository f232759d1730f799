"""IDC-PCL's cross-task expansion (pipeline/cross_task.py, pipeline/models/idc_pcl_fgvc.py): the batch schedule
(GIC stage, then pair : FGVC batches at the stated ratio), GIC pseudo pairs with the empty image left out of
attention and MVCL masking the real image only, GIC negatives without Confuse, the FGVC losses by hand."""

import argparse
import math
import types
from collections import Counter

import numpy as np
import pytest
import torch

from pipeline import cross_task as ct
from pipeline import negatives as ng
from pipeline.datasets import cub as cub_parser
from pipeline.models.idc_pcl import IDCPCL, TASKS
from pipeline.models.idc_pcl_fgvc import FGVCHeads, fgvc_loss, label_contrastive
from pipeline.pos_tagging import make_tagger
from pipeline.synth import birds
from pipeline.synth import cub as cub_synth
from pipeline.text import tokenize


class _Source:
    """A batch source that records which of its batches were asked for."""

    def __init__(self, name, cycle=("mlm",)):
        self.name, self.cycle, self.pairs, self.asked = name, list(cycle), [0], []

    def task(self, k):
        return self.cycle[k % len(self.cycle)]

    def batch(self, k, stream=0):
        self.asked.append(k)
        return {"src": self.name, "k": k, "img1": torch.zeros(3, 1)}


def test_schedule_gic_stage_then_pairs_and_fgvc_at_the_ratio():
    pair, gic, fgvc = _Source("pair", ("mlm",) * 9 + ("mvcl", "fda", "fda")), _Source("gic"), _Source("fgvc")
    b = ct.ExpansionBatches(pair, gic, fgvc, gic_steps=7, mix={"pair": 4, "fgvc": 1})
    got = [b.batch(s)["src"] for s in range(7 + 5 * 12)]
    assert got[:7] == ["gic"] * 7 and gic.asked == list(range(7))
    for p in range(12):  # every period after the GIC stage: 4 pair batches, 1 FGVC batch
        assert Counter(got[7 + 5 * p: 12 + 5 * p]) == {"pair": 4, "fgvc": 1}
    # each source's batches are consecutive indices of its own stream, so its task ratio holds as without mixing
    assert pair.asked == list(range(48)) and fgvc.asked == list(range(12))
    assert Counter(b.task(s) for s in range(7, 7 + 5 * 12)) == {"mlm": 36, "mvcl": 4, "fda": 8, "fgvc": 12}
    assert all(b.batch(s)["img2_empty"].all() for s in range(7))  # GIC batches are pseudo pairs
    assert not any("img2_empty" in b.batch(s) for s in range(7, 20))
    # without FGVC data the pair batches follow the GIC stage alone
    only = ct.ExpansionBatches(_Source("pair"), _Source("gic"), None, gic_steps=3, mix={"pair": 4, "fgvc": 1})
    assert [only.batch(s)["src"] for s in range(6)] == ["gic"] * 3 + ["pair"] * 3
    assert ct.spread({"pair": 4, "fgvc": 1}) == ["pair", "pair", "fgvc", "pair", "pair"]


def _tiny(**kw):
    torch.manual_seed(0)
    return IDCPCL(vocab_size=20, feat_dim=6, hidden=16, heads=2, ff=32, layers=1, dropout=0.0, **kw)


def _gic_batch(task, img2, empty=True, b=8):
    g = torch.Generator().manual_seed(1)
    text = torch.randint(4, 20, (b, 7), generator=g)
    text[:, 0], text[:, -1] = 2, 3
    if task == "fda":
        text = text.view(b // 4, 4, 7)
        b = b // 4
    batch = {"task": torch.tensor(TASKS.index(task)), "img1": torch.randn(b, 6, 3, 3, generator=g),
             "img2": img2[:b], "text": text}
    if empty:
        batch["img2_empty"] = torch.ones(b, dtype=torch.bool)
    return batch


@pytest.mark.parametrize("task", ["mlm", "mvcl"])
def test_pseudo_pairs_leave_the_empty_image_out(task):
    """With ``img2_empty`` nothing depends on the second image's values: its cells are out of every attention,
    and MVCL masks (and scores) only the real image. Without the flag the same batch does depend on them."""
    model = _tiny()
    with torch.no_grad():
        model.img_proj.weight.mul_(100)  # at init (std 0.02) image values barely move the losses
        model.mlm.weight.mul_(50)
    zeros, noise = torch.zeros(8, 6, 3, 3), torch.randn(8, 6, 3, 3) * 3

    def loss(img2, empty):
        torch.manual_seed(5)
        return model.pretraining_loss(_gic_batch(task, img2, empty))

    (l0, p0), (l1, _) = loss(zeros, True), loss(noise, True)
    assert abs(l0.item() - l1.item()) < 2e-6 and all(k.startswith("gic_") for k in p0)
    assert abs(loss(zeros, False)[0].item() - loss(noise, False)[0].item()) > 5e-4


def test_empty_image_cells_are_out_of_the_pair_and_cross_modal_attention():
    """What FDA reads ([IMG1], [IMG2], [CLS]) and every other token but the empty cells themselves does not
    depend on the empty image's values, through the pair encoder and the cross-modal transformer."""
    model = _tiny()
    with torch.no_grad():
        model.img_proj.weight.mul_(100)
    model.eval()
    g = torch.Generator().manual_seed(3)
    img1, noise = torch.randn(4, 6, 3, 3, generator=g), torch.randn(4, 6, 3, 3, generator=g)
    text = torch.tensor([[model.cls_id, 2, 5, 6, 3]] * 4)
    empty = torch.tensor([True, True, False, False])

    def states(img2):
        v = model.visual(img1, img2, empty)
        return model.cross(torch.cat([v, model.embed_text(text)], 1), model.padding_mask(v.size(1), text, empty))

    a, b = states(torch.zeros_like(noise)), states(noise)
    nv = 2 * 10
    keep = torch.ones(a.size(1), dtype=torch.bool)
    keep[nv // 2 + 1:nv] = False  # the empty image's own cells
    assert torch.allclose(a[:2][:, keep], b[:2][:, keep], atol=1e-5)
    assert not torch.allclose(a[2:][:, keep], b[2:][:, keep], atol=1e-3)  # real second images do count


def test_empty_padded_store_and_pseudo_pairs():
    class Store:
        shape = (2, 1, 1)

        def get_many(self, keys):
            return np.stack([np.full(self.shape, float(len(k)), np.float32) for k in keys])

    s = ct.EmptyPadded(Store())
    got = s.get_many(["abc", ct.EMPTY_IMAGE, "a"])
    assert got[:, 0, 0, 0].tolist() == [3.0, 0.0, 1.0]
    rec = {"image_id": "x1", "index": 1, "split": "train", "image": "images/x1.jpg", "captions": ["a bird"],
           "labels": {}}
    pp = ct.pseudo_pairs([rec])[0]
    assert (pp["pair_id"], pp["before"], pp["after"]) == ("x1", "images/x1.jpg", ct.EMPTY_IMAGE)


def test_gic_negatives_are_retrieve_and_replace_only(tmp_path):
    assert cub_synth.generate(tmp_path / "cub", n_images=60, n_species=6, seed=0, size=64, progress=False)
    recs = cub_parser.parse(tmp_path / "cub" / "data", source="synthetic")
    manifest = tmp_path / "manifest.jsonl"
    from pipeline.utils.io import read_jsonl, write_jsonl

    write_jsonl(manifest, recs)
    out, stats = tmp_path / "neg.jsonl", tmp_path / "stats.json"
    ng.run(argparse.Namespace(manifest=str(manifest), dataset="cub", out=str(out), stats=str(stats), tagger="lexicon",
                              stanza_dir="x", per_kind=[2, 2, 2], replace_fraction=0.5, min_df=2, seed=0))
    negs = read_jsonl(out)
    assert len(negs) == sum(len(r["captions"]) for r in recs if r["split"] in ("train", "val"))
    kinds = Counter(k for r in negs for k in r["neg_kinds"])
    assert "confuse" not in kinds and kinds["replace"] > len(negs)  # 3 replace slots per caption, most filled
    assert all(len(r["neg_samples"]) == 6 and r["img2"] == ct.EMPTY_IMAGE for r in negs)
    assert {r["pair_id"] for r in negs} <= {r["image_id"] for r in recs}
    # the birds' lexicon tags every word the bird worlds write
    tagger = make_tagger("lexicon", "cub", "x")
    assert tagger.tag([tokenize(c) for r in recs for c in r["captions"]])
    assert set(birds.POS_LEXICON) >= {"animal1", "animal2", "larger", "whereas"}


def test_fgvc_pairs_half_same_class():
    class Store:
        def get_many(self, keys):
            return np.zeros((len(keys), 1, 1, 1), np.float32)

    recs = [{"image": f"{c}/{i}", "labels": {"label": c}} for c in range(5) for i in range(3)]
    fb = ct.FGVCBatches(recs, Store(), batch_size=8, seed=0)
    for step in range(5):
        b = fb.batch(step)
        assert b["same"].tolist() == [True] * 4 + [False] * 4
        assert (b["label1"] == b["label2"]).tolist() == b["same"].tolist()
    assert not torch.equal(fb.batch(0)["label1"], fb.batch(1)["label1"])
    assert torch.equal(fb.batch(3)["label1"], fb.batch(3)["label1"])  # a pure function of the step


def test_fgvc_losses_hand_computed():
    z = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.8, 0.6]])
    y = torch.tensor([0, 0, 1])
    # same label: 1 - cos for (0,1), (1,0); different: max(cos - 0.4, 0) for (0,2), (2,0) = 0.4, (1,2), (2,1) = 0.56
    assert label_contrastive(z, y, 0.4).item() == pytest.approx((2 * 0.4 + 2 * 0.4 + 2 * 0.56) / 9, abs=1e-6)

    heads = FGVCHeads(2, 2)
    with torch.no_grad():
        heads.classify.weight.copy_(torch.eye(2)), heads.classify.bias.zero_()
        heads.match.weight.copy_(torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])), heads.match.bias.zero_()
    s1 = torch.tensor([[[1.0, 0.0]], [[1.0, 2.0]]])  # [B=2, 1 token, d=2]: each image's [IMG] output
    s2 = torch.tensor([[[1.0, 0.0]], [[2.0, 0.0]]])
    model = types.SimpleNamespace(single_image=lambda f, w: s1 if w == 0 else s2,
                                  pair_images=lambda a, b: torch.cat([a, b], 1))
    batch = {"img1": None, "img2": None, "label1": torch.tensor([0, 1]), "label2": torch.tensor([0, 0]),
             "same": torch.tensor([True, False])}
    loss, parts = fgvc_loss(model, heads, batch, 0.4)

    def ce(logits, k):
        return math.log(sum(math.exp(v) for v in logits)) - logits[k]

    cls = (ce([1, 0], 0) + ce([1, 2], 1) + ce([1, 0], 0) + ce([2, 0], 0)) / 4
    # z: img1 [1, 0], [1, 2] then img2 [1, 0], [2, 0], labels 0, 1, 0, 0: the label-0 images point the same
    # way (1 - cos = 0); image 1 is at cos 1/sqrt(5) of each (> margin 0.4): 6 ordered pairs of 1/sqrt(5) - 0.4
    con = 6 * (1 / math.sqrt(5) - 0.4) / 16
    match = (ce([0, 1], 1) + ce([0, 1], 0)) / 2  # match logits [0, first feature of [IMG1]]
    assert parts["fgvc_cls"] == pytest.approx(cls, abs=1e-6)
    assert parts["fgvc_con"] == pytest.approx(con, abs=1e-6)
    assert parts["fgvc_match"] == pytest.approx(match, abs=1e-6)
    assert loss.item() == pytest.approx(cls + con + match, abs=1e-5)
    assert parts["fgvc_acc"] == 1.0 and parts["fgvc_match_acc"] == 0.5  # the second pair is called "same"


def test_fgvc_task_trains_the_heads_and_fine_tuning_drops_them():
    model = _tiny(fgvc_classes=5)
    g = torch.Generator().manual_seed(0)
    batch = {"task": torch.tensor(TASKS.index("fgvc")), "img1": torch.randn(4, 6, 3, 3, generator=g),
             "img2": torch.randn(4, 6, 3, 3, generator=g), "label1": torch.tensor([0, 1, 2, 3]),
             "label2": torch.tensor([0, 1, 4, 4]), "same": torch.tensor([True, True, False, False])}
    loss, parts = model.training_loss(batch)
    loss.backward()
    assert model.fgvc.classify.weight.grad.abs().sum() > 0 and model.single.layers[0].qkv.weight.grad.abs().sum() > 0
    assert model.pair.layers[0].qkv.weight.grad.abs().sum() > 0 and model.word.weight.grad is None
    ft = _tiny()
    copied = ft.init_from(model.state_dict())
    assert not any(k.startswith("fgvc.") for k in copied) and "single.layers.0.qkv.weight" in copied
