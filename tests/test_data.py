"""The training data layer (``pipeline.data``): pairs with optional distractor partners, the mode read from the
manifest records (never from the dataset's name), batches a pure function of (seed, step)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from pipeline.data import PARTNER, PLAIN, TrainBatches, pairing, type_ids
from pipeline.errors import PipelineError

L = 5  # label length


class FakeStore:
    """Features [2, 1, 1] that name their image: (image number, 0.5)."""

    def __init__(self, keys):
        self.code = {k: i + 1 for i, k in enumerate(sorted(keys))}
        self.key = {v: k for k, v in self.code.items()}

    def get_many(self, keys):
        return np.stack([np.array([self.code[k], 0.5], np.float32).reshape(2, 1, 1) for k in keys])

    def keys_of(self, feats: torch.Tensor) -> list[str]:
        return [self.key[int(v)] for v in feats[:, 0, 0, 0]]


class FakeLabels:
    """Pair p has ``n_caps`` captions; caption c is [2, 100·p + c, 3, 0, 0] (p: the pair's number)."""

    def __init__(self, pair_ids, n_caps=3):
        self.num = {p: i for i, p in enumerate(sorted(pair_ids))}
        self.caps = {p: np.array([[2, 100 * i + c, 3, 0, 0] for c in range(n_caps)], np.int32)
                     for p, i in self.num.items()}

    def of(self, pair_id):
        return self.caps[pair_id]

    def pair_of(self, row: torch.Tensor) -> str:
        num = int(row[1]) // 100
        return next(p for p, i in self.num.items() if i == num)


def clevr_change_records(n=3, types=("move", "color", "add")):
    """CLEVR-Change-shaped: each index a changed pair and its distractor (``_n``), listed distractor first."""
    recs = []
    for i in range(n):
        common = {"index": i, "split": "train", "before": f"images/CLEVR_default_{i:06d}.png", "captions": ["x"]}
        recs.append({"pair_id": f"{i:06d}.png_n", **common, "after": f"nsc_images/CLEVR_nonsemantic_{i:06d}.png",
                     "change_type": "no_change"})
        recs.append({"pair_id": f"{i:06d}.png", **common, "after": f"sc_images/CLEVR_semantic_{i:06d}.png",
                     "change_type": types[i % len(types)]})
    return recs[::-1]


def clevr_dc_records(types=("color", "no_change", "add", "drop", "no_change", "move", "material")):
    """CLEVR-DC-shaped: one pair per before image, changed or ``no_change``, no partner."""
    return [{"pair_id": f"{n}", "index": n, "split": "train", "before": f"images/{n}.png", "after": f"sc_images/{n}.png",
             "change_type": t, "captions": ["x"]} for n, t in zip(range(8000 * 3, 8000 * 3 + len(types)), types)][::-1]


def setup(records, batch_size, seed, swap=0.5, **kw):
    store = FakeStore({k for r in records for k in (r["before"], r["after"])})
    labels = FakeLabels([r["pair_id"] for r in records])
    return TrainBatches(records, labels, store, batch_size, seed, swap, **kw), store, labels


def former_triplet_batch(records, labels, store, batch_size, seed, swap, step):
    """The batch the triplet data layer built before issue 13 (its algorithm, written out), in its keys:
    triplets sorted by before image; epoch permutation from default_rng([seed, epoch]); per item, from
    default_rng([seed, step, j]): the change caption, the distractor caption, then the swap draw."""
    by_before = collections.defaultdict(dict)
    for r in records:
        by_before[r["before"]]["neg" if r["change_type"] == "no_change" else "pos"] = r
    trip = [(b, g["pos"], g["neg"]) for b, g in sorted(by_before.items())]
    n = len(trip)
    out = collections.defaultdict(list)
    for j, pos in enumerate(range(step * batch_size, (step + 1) * batch_size)):
        before, p, q = trip[np.random.default_rng([seed, pos // n]).permutation(n)[pos % n]]
        rng = np.random.default_rng([seed, step, j])
        out["pos_labels"].append(labels.of(p["pair_id"])[rng.integers(3)])
        out["neg_labels"].append(labels.of(q["pair_id"])[rng.integers(3)])
        bef, nsc = (q["after"], before) if rng.random() < swap else (before, q["after"])
        out["before"].append(bef), out["nsc"].append(nsc), out["sc"].append(p["after"])
        out["type"].append(p["change_type"])
    return out


class RowStore(FakeStore):
    """A store that also gives each image's row, as ``FeatureStore.index_of`` does."""

    def index_of(self, key):
        return self.code[key] - 1


def test_batches_from_a_feature_file_name_each_images_row():
    for recs, groups in ((clevr_change_records(), ("before", "after", "distractor")),
                         (clevr_dc_records(), ("before", "after"))):
        store = RowStore({k for r in recs for k in (r["before"], r["after"])})
        batches = TrainBatches(recs, FakeLabels([r["pair_id"] for r in recs]), store, 4, 3, 0.5)
        for step in range(4):
            b = batches.batch(step)
            assert {k for k in b if k.endswith("_row")} == {f"{g}_row" for g in groups}
            for g in groups:  # the row names the very image whose features the batch holds
                assert [store.key[int(r) + 1] for r in b[f"{g}_row"]] == store.keys_of(b[g]), (step, g)
                assert b[f"{g}_row"].dtype == torch.int64


def test_clevr_change_shape_gives_partner_batches_equal_to_the_former_triplets():
    recs = clevr_change_records()
    batches, store, labels = setup(recs, batch_size=2, seed=7)
    assert batches.mode == PARTNER and len(batches) == 3
    ids = {"add": 0, "color": 1, "move": 2}  # the manifest's changed types, sorted (no no_change item here)
    assert batches.type_ids == ids
    swaps = 0
    for step in range(6):  # 12 items: four epochs of 3, with batches across the epoch boundaries
        b = batches.batch(step)
        want = former_triplet_batch(recs, labels, store, 2, 7, 0.5, step)
        assert set(b) == {"before", "after", "distractor", "labels", "distractor_labels", "type", "changed",
                          "step", "epoch"}
        for new, old in (("before", "before"), ("after", "sc"), ("distractor", "nsc")):
            assert torch.equal(b[new], torch.from_numpy(store.get_many(want[old]))), (step, new)
        assert torch.equal(b["labels"], torch.from_numpy(np.stack(want["pos_labels"]).astype(np.int64)))
        assert torch.equal(b["distractor_labels"], torch.from_numpy(np.stack(want["neg_labels"]).astype(np.int64)))
        assert b["labels"].dtype == b["distractor_labels"].dtype == torch.int64
        assert b["before"].dtype == torch.float32
        assert b["type"].tolist() == [ids[t] for t in want["type"]]
        assert b["changed"].tolist() == [True, True]
        assert int(b["step"]) == step and int(b["epoch"]) == step * 2 // 3
        swaps += sum(k.startswith("nsc_images") for k in want["before"])
    assert 0 < swaps < 12  # the distractor view did play "before" some of the time


def test_plain_pairs_each_pair_once_per_epoch_without_distractor_keys():
    recs = clevr_dc_records()
    batches, store, labels = setup(recs, batch_size=3, seed=1)
    assert batches.mode == PLAIN and len(batches) == 7
    # types from the manifest: sorted, no_change last
    assert batches.type_ids == {"add": 0, "color": 1, "drop": 2, "material": 3, "move": 4, "no_change": 5}
    by_after = {r["after"]: r for r in recs}
    seen = []
    for step in range(7):  # 21 items = 3 epochs of 7
        b = batches.batch(step)
        assert set(b) == {"before", "after", "labels", "type", "changed", "step", "epoch"}
        afters = store.keys_of(b["after"])
        for k, bef, lab, t, ch in zip(afters, store.keys_of(b["before"]), b["labels"], b["type"], b["changed"]):
            r = by_after[k]
            assert bef == r["before"]  # no swap: there is no distractor view
            assert labels.pair_of(lab) == r["pair_id"]  # one of the pair's own captions
            assert int(t) == batches.type_ids[r["change_type"]]
            assert bool(ch) == (r["change_type"] != "no_change")
        seen += afters
    for e in range(3):
        assert sorted(seen[7 * e:7 * (e + 1)]) == sorted(by_after), e
    assert seen[:7] != seen[7:14]  # a new order each epoch


def test_plain_batches_are_a_function_of_seed_and_step_and_resume():
    recs = clevr_dc_records()
    run, _, _ = setup(recs, batch_size=3, seed=5)
    straight = [run.batch(s) for s in range(6)]
    resumed, _, _ = setup(recs[::-1], batch_size=3, seed=5)  # another manifest order, a resumed run at step 4
    for s in (4, 5):
        got = resumed.batch(s)
        assert all(torch.equal(got[k], straight[s][k]) for k in straight[s]), s
    other, _, _ = setup(recs, batch_size=3, seed=6)
    assert not torch.equal(other.batch(0)["after"], straight[0]["after"])


def test_a_split_mixing_partnered_and_plain_before_images_is_one_clear_error():
    recs = clevr_change_records(2) + [{"pair_id": "solo", "index": 9, "split": "train", "before": "images/solo.png",
                                       "after": "sc_images/solo.png", "change_type": "add", "captions": ["x"]}]
    with pytest.raises(PipelineError) as e:
        pairing(recs)
    msg = str(e.value)
    assert "images/solo.png" in msg and "images/CLEVR_default_000000.png" in msg and "distractor" in msg
    with pytest.raises(PipelineError, match="images/solo.png"):
        setup(recs, batch_size=2, seed=0)


def test_shapes_other_than_one_changed_and_one_distractor_pair_are_plain():
    two_changed = [{"pair_id": p, "before": "images/a.png", "after": f"b/{p}.png", "change_type": t}
                   for p, t in (("x", "add"), ("y", "move"))]
    assert pairing(two_changed) == PLAIN  # e.g. two edits of one image
    assert pairing(clevr_change_records()) == PARTNER
    assert pairing(clevr_dc_records()) == PLAIN
    # a changed pair with two distractors is not a partner pair either
    odd = clevr_change_records(1) + [dict(clevr_change_records(1)[1], pair_id="000000.png_m", after="c.png")]
    assert pairing(odd) == PLAIN


def test_changed_only_drops_plain_no_change_pairs_and_keeps_every_partner_item():
    plain, store, _ = setup(clevr_dc_records(), batch_size=2, seed=0, changed_only=True)
    assert len(plain) == 5 and all(it.change_type != "no_change" for it in plain.items)
    assert "no_change" not in plain.type_ids
    partner, _, _ = setup(clevr_change_records(), batch_size=2, seed=0, changed_only=True)
    assert partner.mode == PARTNER and len(partner) == 3


def test_type_ids_sorted_with_no_change_last():
    assert type_ids(["no_change", "move", "add", "move"]) == {"add": 0, "move": 1, "no_change": 2}
    assert type_ids(["b", "a"]) == {"a": 0, "b": 1}
