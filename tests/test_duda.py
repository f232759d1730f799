import torch

from pipeline.models import duda_reference as reference
from pipeline.models.duda import DUDA, ChangeDetector, usage_entropy
from pipeline.text import END, START


def test_detector_equals_official_concatenated_conv():
    torch.manual_seed(0)
    det = ChangeDetector(dim=16 + 2, hidden=32, groups=8).eval()
    bef, sc, nsc = (torch.randn(3, 16, 5, 4) for _ in range(3))
    fast = det(bef, [sc, nsc])
    for aft, got in zip([sc, nsc], fast):
        want = reference.detector(det, bef, aft)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def small_batch(b=4, c=16, vocab=12, length=7):
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(4, vocab, (2, b, length), generator=g)
    labels[:, :, 0] = START
    for i in range(b):  # captions of different lengths (the speaker packs them), one filling the whole row
        end = (6, 2, 5, 3)[i % 4]
        labels[:, i, end] = END
        labels[:, i, end + 1:] = 0
    return {"before": torch.randn(b, c, 4, 4, generator=g), "after": torch.randn(b, c, 4, 4, generator=g),
            "distractor": torch.randn(b, c, 4, 4, generator=g), "labels": labels[0], "distractor_labels": labels[1],
            "type": torch.zeros(b, dtype=torch.long)}


def tiny(**kw):
    return DUDA(vocab_size=12, feat_dim=16, att_hidden=32, embed_dim=8, hidden=16, **kw)


def test_loss_is_the_official_weighted_sum():
    torch.manual_seed(0)
    m = tiny(l1_weight=0.0).eval()
    batch = small_batch()
    loss, parts = m.training_loss(batch)
    assert abs(loss.item() - (0.5 * parts["ce_pos"] + 0.5 * parts["ce_neg"])) < 1e-5
    m.l1_weight = 0.5
    loss2, parts2 = m.training_loss(batch)
    assert abs(loss2.item() - loss.item() - 0.5 * parts2["att_l1"]) < 1e-4
    # The L1 term is the sum of both sigmoid maps, so it lies in (0, 2*H*W).
    assert 0 < parts2["att_l1"] < 2 * 16


def test_logged_attention_use_is_the_mean_alpha_over_the_changed_pairs_words():
    torch.manual_seed(0)
    batch = small_batch()
    m = tiny(diff_prior=30.0).eval()  # the prior alone puts every word on l_diff
    parts = m.training_loss(batch)[1]
    assert abs(parts["alpha_diff"] - 1) < 1e-6 and parts["alpha_bef"] < 1e-6 and parts["alpha_aft"] < 1e-6
    m = tiny().eval()
    parts = m.training_loss(batch)[1]
    l_bef, l_aft, l_diff, _, _ = m.detector(batch["before"], [batch["after"]])[0]
    _, alphas = m.speaker(l_bef, l_diff, l_aft, batch["labels"])
    words = batch["labels"][:, 1:] > 0
    want = alphas[words].mean(0)  # the changed pairs' words only, not their distractor partners'
    got = torch.tensor([parts["alpha_bef"], parts["alpha_diff"], parts["alpha_aft"]])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert abs(got.sum().item() - 1) < 1e-5


def test_gradients_reach_every_parameter():
    torch.manual_seed(0)
    m = tiny(entropy_weight=0.1)
    loss, _ = m.training_loss(small_batch())
    loss.backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing


def test_learns_to_copy_a_caption_and_greedy_stops_at_end():
    torch.manual_seed(0)
    m = tiny(l1_weight=0.0)
    m.speaker.drop.p = 0.0
    batch = small_batch(b=2)
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    for _ in range(150):
        loss, _ = m.training_loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    m.eval()
    out = m.generate(batch["before"], batch["after"], max_len=10)
    for row, labels in zip(out, batch["labels"]):  # its words then <END>, nothing after it
        n = int((labels[1:] > 0).sum())
        assert torch.equal(row[:n], labels[1:n + 1]) and labels[n] == END and (row[n:] == 0).all()


def test_speaker_equals_plain_lstm_cells_fed_the_concatenations():
    """The precomputed input projections are an optimisation only: compare with nn.LSTMCell calls."""
    torch.manual_seed(0)
    m = tiny().eval()
    sp = m.speaker
    batch = small_batch()
    l_bef, l_aft, l_diff, _, _ = m.detector(batch["before"], [batch["after"]])[0]
    labels = batch["labels"]
    got, got_alpha = sp(l_bef, l_diff, l_aft, labels)
    want, want_alpha = reference.speaker(sp, l_bef, l_diff, l_aft, labels)
    read = labels[:, 1:] > 0  # the positions a loss reads; after a caption's end the packed speaker stops
    assert read.sum(1).unique().numel() > 1 and not read.all()
    torch.testing.assert_close(got[read], want[read], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_alpha[read], want_alpha[read], rtol=1e-4, atol=1e-6)
    assert (got[~read] == 0).all() and (got_alpha[~read] == 0).all()


def test_training_loss_equals_the_official_formulation():
    torch.manual_seed(0)
    m = tiny(l1_weight=0.01).eval()
    batch = small_batch()
    torch.testing.assert_close(m.training_loss(batch)[0], reference.training_loss(m, batch), rtol=1e-5, atol=1e-6)


def test_gradients_equal_the_official_formulation():
    # The speaker's restructured backward (projections once per sequence, the h_lang weight sliced once, the
    # word projections unbound once) must give the plain LSTMCell computation's gradients, parameter by parameter.
    torch.manual_seed(0)
    m = tiny(l1_weight=0.01).eval()
    batch = small_batch()
    got = torch.autograd.grad(m.training_loss(batch)[0], list(m.parameters()))
    want = torch.autograd.grad(reference.training_loss(m, batch), list(m.parameters()))
    for (name, _), g, w in zip(m.named_parameters(), got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6, msg=name)


def test_pool_and_mean_reduce_are_the_stated_rescalings():
    """pool: the detector sees the average-pooled grid; reduce=mean: the attended features (and the L1 term)
    are the summed ones divided by the number of cells, with the same maps."""
    torch.manual_seed(0)
    det = ChangeDetector(dim=16 + 2, hidden=32, groups=8).eval()
    pooled = ChangeDetector(dim=16 + 2, hidden=32, groups=8, pool=2).eval()
    mean = ChangeDetector(dim=16 + 2, hidden=32, groups=8, reduce="mean").eval()
    pooled.load_state_dict(det.state_dict())
    mean.load_state_dict(det.state_dict())
    bef, aft = torch.randn(3, 16, 4, 4), torch.randn(3, 16, 4, 4)
    pool = torch.nn.functional.avg_pool2d
    for g, w in zip(pooled(bef, [aft])[0], det(pool(bef, 2), [pool(aft, 2)])[0]):
        torch.testing.assert_close(g, w)
    summed, averaged = det(bef, [aft])[0], mean(bef, [aft])[0]
    for g, w in zip(averaged[:3], summed[:3]):
        torch.testing.assert_close(g, w / 16)
    for g, w in zip(averaged[3:], summed[3:]):  # the maps themselves are unchanged
        torch.testing.assert_close(g, w)
    m_sum, m_mean = tiny(l1_weight=0.5).eval(), tiny(l1_weight=0.5, reduce="mean").eval()
    m_mean.load_state_dict(m_sum.state_dict())
    batch = small_batch()
    assert abs(m_mean.training_loss(batch)[1]["att_l1"] - m_sum.training_loss(batch)[1]["att_l1"] / 16) < 1e-5


def test_diff_prior_opens_the_dynamic_attention_on_l_diff_and_zero_is_the_official_init():
    # diff_prior only shifts the initial logit of l_diff: every other parameter, and with 0 the whole model, is
    # the seed's official initialisation; at +6 the speaker starts reading l_aft - l_bef (alpha_diff > 0.99).
    torch.manual_seed(0)
    base = tiny()
    torch.manual_seed(0)
    same = tiny(diff_prior=0.0)
    torch.manual_seed(0)
    prior = tiny(diff_prior=6.0)
    for (n, a), b, c in zip(base.state_dict().items(), same.state_dict().values(), prior.state_dict().values()):
        assert torch.equal(a, b), n
        if n != "speaker.dyn_att.2.bias":
            assert torch.equal(a, c), n
    torch.testing.assert_close(prior.speaker.dyn_att[2].bias - base.speaker.dyn_att[2].bias, torch.tensor([0.0, 6.0, 0.0]))
    batch = small_batch()
    for m, lo, hi in ((prior.eval(), 0.99, 1.0), (base.eval(), 0.0, 0.9)):
        with torch.no_grad():
            l_bef, l_aft, l_diff, _, _ = m.detector(batch["before"], [batch["after"]])[0]
            _, alphas = m.speaker(l_bef, l_diff, l_aft, batch["labels"])
        assert lo <= alphas[:, 0, 1].min().item() and alphas[:, 0, 1].max().item() <= hi


def test_own_difference_gives_each_map_what_its_image_has_and_the_other_lacks():
    # With own_difference the before map reads [X_bef; X_bef - X_aft]: exactly the after map of the swapped pair,
    # so one conv finds a dropped object in the before image as it finds an added one in the after image. The
    # after map and the official before map (the reference formulation) are unchanged.
    torch.manual_seed(0)
    off = ChangeDetector(dim=16 + 2, hidden=32, groups=8).eval()
    own = ChangeDetector(dim=16 + 2, hidden=32, groups=8, own_difference=True).eval()
    own.load_state_dict(off.state_dict())
    bef, aft = torch.randn(3, 16, 4, 4), torch.randn(3, 16, 4, 4)
    l_bef, l_aft, l_diff, att_bef, att_aft = own(bef, [aft])[0]
    s_bef, s_aft, _, s_att_bef, s_att_aft = own(aft, [bef])[0]
    torch.testing.assert_close(att_bef, s_att_aft)
    torch.testing.assert_close(l_bef, s_aft)
    torch.testing.assert_close(l_diff, l_aft - l_bef)
    o_bef, o_aft, _, o_att_bef, o_att_aft = off(bef, [aft])[0]
    torch.testing.assert_close(att_aft, o_att_aft)
    assert (att_bef - o_att_bef).abs().max() > 1e-3  # the official before map reads X_aft - X_bef
    for g, w in zip(off(bef, [aft])[0], reference.detector(off, bef, aft)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_usage_entropy_is_the_entropy_of_the_mean_weights_over_the_words():
    # Every word reads one input, and over the words each input once: per word entropy 0, usage ln 3.
    # The masked word (no target) counts for nothing.
    alphas = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], [[0.0, 0.0, 1.0], [0.2, 0.8, 0.0]]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert abs(usage_entropy(alphas, mask).item() - torch.log(torch.tensor(3.0)).item()) < 1e-6
    # All words on one input: 0. Half the words on l_bef, half on l_aft: ln 2.
    assert usage_entropy(torch.tensor([[[0.0, 0.0, 1.0]] * 2]), torch.ones(1, 2)).abs().item() < 1e-6
    half = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]])
    assert abs(usage_entropy(half, torch.ones(1, 2)).item() - torch.log(torch.tensor(2.0)).item()) < 1e-6
    # In the loss: - usage_weight * H(usage), logged as usage_entropy.
    torch.manual_seed(0)
    m = tiny(l1_weight=0.0).eval()
    batch = small_batch()
    loss0, parts = m.training_loss(batch)
    m.usage_weight = 0.5
    loss1, _ = m.training_loss(batch)
    assert 0 < parts["usage_entropy"] <= torch.log(torch.tensor(3.0)).item() + 1e-6
    assert abs(loss0.item() - loss1.item() - 0.5 * parts["usage_entropy"]) < 1e-5
