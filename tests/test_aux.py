"""DUDA + TIRG auxiliary task (Hosseinzadeh & Wang, CVPR 2021 §4): losses, soft selection, curriculum,
gradient paths between the two networks, determinism, and the retrieval stage."""

import math

import numpy as np
import pytest
import torch

from pipeline.errors import PipelineError
from pipeline.models import build_model
from pipeline.models.aux_training import (AuxiliaryTraining, batch_classification_loss, candidate_loss,
                                          candidate_sets, caption_lengths, loss_and_distributions, soft_select,
                                          word_distributions)
from pipeline.text import END, START
from tests.test_duda import small_batch

DUDA_HP = {"att_hidden": 32, "embed_dim": 8, "hidden": 16, "dropout": 0.5}


def tiny(**kw):
    hp = dict(primary_model=DUDA_HP, embed_dim=16, word_dim=8, img_hidden=8)
    hp.update(kw)
    return AuxiliaryTraining(vocab_size=12, feat_dim=16, **hp)


def aux_batch(step=0, epoch=0, b=4):
    batch = small_batch(b=b)
    batch["step"], batch["epoch"] = torch.tensor(step), torch.tensor(epoch)
    return batch


# ------------------------------------------------------------------------------------------------------ Eq. 6
def test_eq6_batch_classification_loss_by_hand():
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    t = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    # <q_i, t_j> = [[1, 1], [0, 1]]: sample 1 ties its target (-log 1/2), sample 2 wins by 1 (-log e/(1+e)).
    want = (math.log(2.0) + math.log(1.0 + math.exp(-1.0))) / 2
    assert abs(batch_classification_loss(q, t).item() - want) < 1e-6
    assert abs(want - 0.5032045) < 1e-6


def test_easy_candidate_set_of_the_whole_batch_is_eq6():
    torch.manual_seed(0)
    q, t = torch.randn(5, 3), torch.randn(5, 3)
    pool = torch.cat([torch.randn(5, 3), t])  # [A_1..A_5, B_1..B_5]
    sets = candidate_sets(5, 5, hard=False)
    torch.testing.assert_close(candidate_loss(q, pool, sets), batch_classification_loss(q, t))


# -------------------------------------------------------------------------------------------- Eq. 9-10
def test_eq9_10_soft_selection_by_hand():
    cands = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # Ĩ_1..Ĩ_3
    r = torch.tensor([math.log(3.0), 0.0])  # S̃·R = (ln 3, 0, ln 3) → ω = (3, 1, 3) / 7
    omega = torch.softmax(cands @ r, 0)
    torch.testing.assert_close(omega, torch.tensor([3 / 7, 1 / 7, 3 / 7]))
    b_hat = soft_select(omega.unsqueeze(0), torch.tensor([[0, 1, 2]]), cands)
    torch.testing.assert_close(b_hat, torch.tensor([[6 / 7, 4 / 7]]))
    # On feature maps: the weights select maps; a one-hot ω returns the candidate's map itself.
    maps = torch.randn(4, 3, 2, 2)
    sets = torch.tensor([[2, 0, 3], [1, 3, 0]])
    w = torch.tensor([[1.0, 0.0, 0.0], [0.25, 0.75, 0.0]])
    out = soft_select(w, sets, maps)
    torch.testing.assert_close(out[0], maps[2])
    torch.testing.assert_close(out[1], 0.25 * maps[1] + 0.75 * maps[3])


# ----------------------------------------------------------------------------------------- Eq. 13 curriculum
def test_candidate_sets_easy_and_hard():
    torch.manual_seed(0)
    b, n = 6, 4
    easy, hard = candidate_sets(b, n, hard=False), candidate_sets(b, n, hard=True)
    for sets, is_hard in ((easy, False), (hard, True)):
        assert sets.shape == (b, n)
        for i, row in enumerate(sets.tolist()):
            assert row[0] == b + i  # B_i, the target
            assert len(set(row)) == n  # no repeats
            assert (i in row) == is_hard  # A_i only in the hard set
            rest = row[2:] if is_hard else row[1:]
            assert all(b <= j < 2 * b and j != b + i for j in rest)  # other samples' B_j
    with pytest.raises(ValueError):
        candidate_sets(3, 5, hard=False)


def test_curriculum_switches_exactly_at_xi():
    torch.manual_seed(0)
    m = tiny(xi=3, n_candidates=3)
    b = 4

    def has_a(epoch):
        sets = m.sets_for(b, epoch, "cpu")
        return [i in row for i, row in enumerate(sets.tolist())]

    for epoch in (0, 1, 2):
        assert not any(has_a(epoch)) and not m.hard_set(epoch)
    for epoch in (3, 4, 50):
        assert all(has_a(epoch)) and m.hard_set(epoch)
    easy = tiny(xi=3, candidates="easy")
    assert not any(easy.hard_set(e) for e in range(100))
    # The training step reads the epoch from the batch.
    for epoch, want in ((2, 0), (3, 1)):
        for step in (0, 1):
            _, parts = m.training_loss(aux_batch(step, epoch))
            assert parts["hard_set"] == want and parts["stage"] == 1 + step


def test_too_many_candidates_for_the_batch_is_a_clear_error():
    m = tiny(n_candidates=9)
    with pytest.raises(PipelineError, match="n_candidates"):
        m.training_loss(aux_batch())
    with pytest.raises(PipelineError, match="candidates"):
        tiny(candidates="medium")


# ---------------------------------------------------------------------------------------- gradient paths
def test_l_aux_reaches_the_captioner_through_the_soft_embeddings():
    torch.manual_seed(0)
    m = tiny()
    batch = aux_batch(step=0)
    loss_pri, l_aux, _ = m.primary_to_auxiliary(batch, epoch=0)
    l_aux.backward()
    speaker, detector = m.primary.speaker, m.primary.detector
    for name, p in [("speaker.logit.weight", speaker.logit.weight), ("speaker.lang_lstm.weight_hh", speaker.lang_lstm.weight_hh),
                    ("detector.embed_conv.weight", detector.embed_conv.weight), ("aux W_emb", m.aux.text.embedding.weight)]:
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    # The soft embeddings are the only link: cut them and the captioner gets nothing from L_aux.
    m.zero_grad(set_to_none=True)
    probs, lengths = word_distributions(m.primary, batch["before"], batch["after"], 6)
    phi = m.aux.encode_images(torch.cat([batch["before"], batch["after"]]))
    q = m.aux.compose(phi[:4], m.aux.text.soft_embed(probs.detach()), lengths)
    candidate_loss(q, m.aux.candidates(phi), m.sets_for(4, 0, "cpu")).backward()
    assert all(p.grad is None for p in m.primary.parameters())


def test_soft_embedding_path_matches_finite_differences():
    """d L_aux / d (captioner's output bias), analytic vs numeric, in float64 with dropout off."""
    torch.manual_seed(0)
    m = tiny(primary_model={**DUDA_HP, "dropout": 0.0}, text_dropout=0.0).double()
    m.eval()  # BatchNorm on running statistics: a fixed function of its input
    batch = {k: (v.double() if v.is_floating_point() else v) for k, v in aux_batch(step=0).items()}
    bias = m.primary.speaker.logit.bias

    def l_aux():
        torch.manual_seed(1)  # the same candidate draw every call
        return m.primary_to_auxiliary(batch, epoch=0)[1]

    loss = l_aux()
    (grad,) = torch.autograd.grad(loss, bias)
    assert grad.abs().max() > 0
    eps = 1e-6
    for k in (4, 7, 11):
        with torch.no_grad():
            bias[k] += eps
        up = l_aux().item()
        with torch.no_grad():
            bias[k] -= 2 * eps
        down = l_aux().item()
        with torch.no_grad():
            bias[k] += eps
        assert abs((up - down) / (2 * eps) - grad[k].item()) < 1e-6 * max(1.0, abs(grad[k].item()))


def test_captioning_loss_on_b_hat_trains_the_auxiliary_network():
    torch.manual_seed(0)
    m = tiny()  # b_hat_min_omega 0: B̂ always fed
    loss_pri, _, parts = m.auxiliary_to_primary(aux_batch(step=1), epoch=0)  # stage 2, captioning loss alone
    assert parts["b_hat_fed"] == 1
    loss_pri.backward()
    for name, p in [("composition gate", m.aux.compose_fn.gate[2].weight), ("image encoder", m.aux.image.conv1.weight),
                    ("text LSTM", m.aux.text.lstm.weight_ih_l0), ("scale", m.aux.norm.scale),
                    ("captioner", m.primary.speaker.logit.weight)]:
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_straight_through_selection_feeds_the_argmax_candidate_with_the_soft_gradient():
    torch.manual_seed(0)
    omega = torch.softmax(torch.randn(3, 4, dtype=torch.float64), 1).requires_grad_()
    sets = torch.tensor([[3, 0, 4, 5], [4, 1, 3, 5], [5, 2, 3, 4]])  # pool [A_0..A_2, B_0..B_2]
    maps = torch.randn(6, 2, 3, 3, dtype=torch.float64)
    soft, st = tiny(), tiny(selection="straight_through")
    picked = st.selection_weights(omega)
    b_hat = soft_select(picked, sets, maps[:3], maps[3:])
    want = maps[sets[torch.arange(3), omega.argmax(1)]]
    assert torch.equal(b_hat, want)  # exactly the arg-max candidate's map, no blend
    g_st = torch.autograd.grad((b_hat * maps[0]).sum(), omega)[0]
    b_soft = soft_select(soft.selection_weights(omega), sets, maps[:3], maps[3:])
    g_soft = torch.autograd.grad((b_soft * maps[0]).sum(), omega)[0]
    torch.testing.assert_close(g_st, g_soft)  # the gradient reaching ω (and the retrieval net) is the soft one
    assert not torch.equal(b_soft, want)
    with pytest.raises(PipelineError, match="model.selection"):
        tiny(selection="hard")


def test_stage2_feeds_b_hat_only_once_retrieval_weighs_b_enough():
    batch = aux_batch(step=1)
    for threshold, fed in ((0.0, 1), (1.0, 0)):  # ω_B < 1 always (4 candidates, finite logits)
        torch.manual_seed(0)
        m = tiny(b_hat_min_omega=threshold).eval()
        torch.manual_seed(3)
        loss_pri, l_aux, parts = m.auxiliary_to_primary(batch, epoch=0)
        assert parts["b_hat_fed"] == fed and 0 < parts["omega_b"] < 1
        on_true_pair = m.primary.training_loss(batch)[0].item()
        assert (abs(loss_pri.item() - on_true_pair) < 1e-6) == (not fed)
        # Stage 2's L_aux is Eq. 6 for the ground-truth query: −log ω_B, trained whether or not B̂ is fed.
        assert l_aux.item() > 0 and l_aux.requires_grad
    with pytest.raises(PipelineError, match="b_hat_min_omega"):
        tiny(b_hat_min_omega=1.5)


def test_final_loss_is_the_gamma_weighted_sum():
    torch.manual_seed(0)
    m = tiny(gamma=0.3).eval()
    batch = aux_batch(step=0)
    torch.manual_seed(5)
    loss, parts = m.training_loss(batch)
    assert abs(loss.item() - (0.7 * parts["l_pri"] + 0.3 * parts["l_aux"])) < 1e-5
    # L_pri of stage 1 is DUDA's own objective on the real pairs.
    assert abs(parts["l_pri"] - m.primary.training_loss(batch)[0].item()) < 1e-5
    # Stage 2: Eq. 14 too, L_aux = −mean log ω_B for the ground-truth query.
    loss2, parts2 = m.training_loss(aux_batch(step=1))
    assert abs(loss2.item() - (0.7 * parts2["l_pri"] + 0.3 * parts2["l_aux"])) < 1e-5
    assert parts2["l_aux"] >= -math.log(parts2["omega_b"]) - 1e-5  # Jensen: mean −log ω ≥ −log mean ω


def test_stage1_reuses_duda_detector_pass_and_matches_a_fresh_caption():
    torch.manual_seed(0)
    m = tiny().eval()
    batch = aux_batch()
    calls = []
    h = m.primary.detector.register_forward_hook(lambda *a: calls.append(1))
    loss, _, probs, lengths = loss_and_distributions(m.primary, batch, 6)
    h.remove()
    assert len(calls) == 1  # the detector ran once, inside DUDA's own loss
    assert abs(loss.item() - m.primary.training_loss(batch)[0].item()) < 1e-6
    p2, l2 = word_distributions(m.primary, batch["before"], batch["after"], 6)
    torch.testing.assert_close(probs, p2)
    assert torch.equal(lengths, l2)
    # P is the distribution of the greedy caption: its argmax is DUDA's decoded caption.
    words = m.generate(batch["before"], batch["after"], 6)
    for i in range(4):
        n = int(lengths[i])
        assert torch.equal(probs[i, :n].argmax(1), words[i, :n])
    assert abs(probs.sum(2) - 1).max() < 1e-5


def test_word_distributions_in_training_mode_are_those_of_the_greedy_caption():
    """Eq. 3 while training: P's argmax is Ĉ (the speaker's dropout is off in both passes, on again after)."""
    from pipeline.models.aux_training import _duda_caption

    torch.manual_seed(0)
    m = tiny(primary_model={**DUDA_HP, "dropout": 0.9}).train()
    batch = aux_batch()
    with torch.no_grad():
        l_bef, l_aft, l_diff = m.primary.detector(batch["before"], [batch["after"]])[0][:3]
    probs, lengths = _duda_caption(m.primary, l_bef, l_aft, l_diff, 6)
    assert m.primary.speaker.training
    m.primary.speaker.eval()
    words = m.primary.speaker.greedy(l_bef, l_diff, l_aft, 6)
    for i in range(4):
        n = int(lengths[i])
        assert torch.equal(probs[i, :n].argmax(1), words[i, :n])


def test_caption_lengths_stop_at_the_first_end():
    toks = torch.tensor([[5, 6, END, 0, 0], [5, 6, 7, 8, 9], [END, 0, 0, 0, 0]])
    assert caption_lengths(toks).tolist() == [3, 5, 1]


# ------------------------------------------------------------------------------------------- determinism
def run_steps(seed, steps=4):
    torch.manual_seed(seed)
    m = tiny(xi=1)
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    losses = []
    for s in range(steps):
        loss, _ = m.training_loss(aux_batch(step=s, epoch=s // 2))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, m.state_dict()


def test_same_seed_twice_is_identical():
    l1, s1 = run_steps(0)
    l2, s2 = run_steps(0)
    assert l1 == l2
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    l3, _ = run_steps(1)
    assert l3 != l1


def test_built_through_the_registry_and_decodes_like_its_primary():
    torch.manual_seed(0)
    m = build_model("duda_aux_easy", 12, 16, {"primary_model": DUDA_HP, "candidates": "easy", "embed_dim": 16,
                                              "word_dim": 8, "img_hidden": 8}).eval()
    batch = aux_batch()
    torch.testing.assert_close(m.generate(batch["before"], batch["after"], 8), m.primary.generate(batch["before"], batch["after"], 8))
    with pytest.raises(PipelineError, match="auxiliary-training"):
        build_model("duda_aux", 12, 16, {"primary": "duda_aux"})


# --------------------------------------------------------------------------------------- retrieval stage
class FakeStore:
    def __init__(self, maps):
        self.maps = maps

    def get_many(self, keys):
        return np.stack([self.maps[k] for k in keys])


class FakeLabels:
    def __init__(self, caps):
        self.caps = caps

    def of(self, pair_id):
        return self.caps[pair_id]


def test_retrieval_stage_scores_changed_pairs_against_every_image():
    from pipeline.aux_retrieval import retrieval_scores

    torch.manual_seed(0)
    m = tiny()
    rng = np.random.default_rng(0)
    records, maps, caps = [], {}, {}
    for i in range(3):
        a, s, n = f"img/{i}.png", f"sc/{i}.png", f"nsc/{i}.png"
        for k in (a, s, n):
            maps[k] = rng.standard_normal((16, 4, 4)).astype(np.float32)
        records.append({"pair_id": f"{i}", "before": a, "after": s, "change_type": "color"})
        records.append({"pair_id": f"{i}_n", "before": a, "after": n, "change_type": "no_change"})
        c = np.zeros((2, 7), np.int64)
        c[:, 0], c[:, 1:4], c[:, 4] = START, rng.integers(4, 12, (2, 3)), END
        caps[f"{i}"], caps[f"{i}_n"] = c, c[:1]
    out = retrieval_scores(m, records, FakeLabels(caps), FakeStore(maps), torch.device("cpu"), 4, 6)
    assert out["n_gallery"] == 9
    assert out["gt_caption"]["n"] == 6 and out["generated_caption"]["n"] == 3  # 2 captions × 3 changed pairs
    for block in ("gt_caption", "generated_caption"):
        r = out[block]
        assert 0 <= r["R@1"] <= r["R@5"] <= r["R@10"] == 1.0  # 9 images: the target is always in the top 10
        assert 1 <= r["MeanR"] <= 9


# ------------------------------------------------------------------------------------------------------ plain pairs
def plain_batch(changed, step=0, epoch=0):
    """A batch of plain pairs (no distractor partner, ``pipeline.data``'s plain-pair mode); ``changed`` per row."""
    batch = aux_batch(step, epoch, b=len(changed))
    del batch["distractor"], batch["distractor_labels"]
    batch["changed"] = torch.tensor(changed)
    return batch


def rows_of(batch, rows):
    """The plain batch of the given rows only."""
    return {k: (v[rows] if v.dim() else v) for k, v in batch.items()}


@pytest.mark.parametrize("step", [0, 1])
def test_plain_pairs_pose_the_retrieval_task_on_their_changed_pairs_only(step):
    """On plain pairs (CLEVR-DC) the no_change pairs train the captioner only: L_aux is the one of the batch of
    the changed pairs alone, and stage 2 feeds B̂ in the changed rows, the other pairs' after images untouched."""
    changed = [True, False, True, True, False, True]
    rows = [i for i, c in enumerate(changed) if c]
    batch = plain_batch(changed, step=step)
    torch.manual_seed(0)
    m = tiny().eval()  # no dropout: the only draws are the candidate sets
    fed = []
    inner = m.primary.training_loss
    m.primary.training_loss = lambda b: (fed.append(b["after"]), inner(b))[1]
    torch.manual_seed(3)
    _, parts_all = m.training_loss(batch)
    torch.manual_seed(3)
    _, parts_changed = m.training_loss(rows_of(batch, rows))
    assert parts_all["l_aux"] == pytest.approx(parts_changed["l_aux"], abs=1e-6)
    assert parts_all["l_pri"] != pytest.approx(parts_changed["l_pri"], abs=1e-6)  # all six pairs are captioned
    if step == 1:
        assert parts_all["b_hat_fed"] == 1
        others = [i for i, c in enumerate(changed) if not c]
        assert torch.equal(fed[0][others], batch["after"][others])
        torch.testing.assert_close(fed[0][rows], fed[1])
        assert not torch.equal(fed[0][rows], batch["after"][rows])


def test_plain_batch_without_enough_changed_pairs_skips_l_aux():
    torch.manual_seed(0)
    m = tiny(gamma=0.3, xi=0).eval()  # the hard set from epoch 0: a candidate set needs 2 changed pairs
    batch = plain_batch([False, True, False, False], step=0)
    loss, parts = m.training_loss(batch)
    assert "l_aux" not in parts
    assert loss.item() == pytest.approx(0.7 * parts["l_pri"], abs=1e-6)
    assert parts["l_pri"] == pytest.approx(m.primary.training_loss(batch)[0].item(), abs=1e-6)
