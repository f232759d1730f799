import math

import pytest
import torch

from pipeline.models import build_model
from pipeline.models.dirl import channel_correlation, ccr_loss, decorrelation_loss
from pipeline.models.transformer_decoder import masked_mean
from pipeline.text import END, START


def test_channel_correlation_hand_computed():
    y_a = torch.tensor([[1.0, 1.0], [-1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]])
    y_b = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0]])
    # a0 = b0 = b1 = (1,-1,1,-1); a1 = (1,1,-1,-1) is orthogonal to them.
    assert torch.allclose(channel_correlation(y_a, y_b), torch.tensor([[1.0, 1.0], [0.0, 0.0]]), atol=1e-6)
    assert torch.allclose(channel_correlation(y_a, y_a), torch.eye(2), atol=1e-6)
    # A correlation: invariant to shifting and (positively) scaling a channel over the samples.
    shifted = y_b * torch.tensor([3.0, 0.5]) + torch.tensor([7.0, -2.0])
    assert torch.allclose(channel_correlation(y_a, shifted), channel_correlation(y_a, y_b), atol=1e-6)


def test_channel_correlation_equals_pearson():
    g = torch.Generator().manual_seed(0)
    y_a, y_b = torch.randn(50, 3, generator=g), torch.randn(50, 4, generator=g)
    c = channel_correlation(y_a, y_b)
    want = torch.corrcoef(torch.cat([y_a, y_b], 1).t())[:3, 3:]
    assert torch.allclose(c, want, atol=1e-5)


def test_decorrelation_loss_hand_computed():
    c = torch.tensor([[0.5, 0.2], [-0.1, 1.0]])
    # diagonal: (1-0.5)^2 + (1-1)^2 = 0.25; off-diagonal: 0.2^2 + 0.1^2 = 0.05.
    assert math.isclose(decorrelation_loss(c, alpha=0.003).item(), 0.25 + 0.003 * 0.05, rel_tol=1e-6)
    assert math.isclose(decorrelation_loss(torch.eye(3)).item(), 0.0, abs_tol=1e-7)
    y_a = torch.tensor([[1.0, 1.0], [-1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]])
    y_b = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0]])
    # C = [[1, 1], [0, 0]]: diagonal (0)^2 + (1)^2, off-diagonal 1^2 + 0^2.
    assert math.isclose(decorrelation_loss(channel_correlation(y_a, y_b), 0.003).item(), 1.003, rel_tol=1e-5)
    # DIRL Table 7: one term at a time, alpha unchanged.
    assert math.isclose(decorrelation_loss(c, 0.003, discrimination=False).item(), 0.25, rel_tol=1e-6)
    assert math.isclose(decorrelation_loss(c, 0.003, non_perturbation=False).item(), 0.003 * 0.05, rel_tol=1e-6)


def test_ccr_loss_hand_computed():
    words = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    attended = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    # sim / tau = [[2, 2], [0, 2]]. t2v rows: log 2 and log(1 + e^-2); v2t (columns): log(1 + e^-2) and log 2.
    want = (math.log(2) + math.log(1 + math.exp(-2))) / 2
    assert math.isclose(ccr_loss(words, attended, 0.5).item(), want, rel_tol=1e-6)
    # Temperature 1: sim = [[1, 1], [0, 1]].
    want1 = ((math.log(2) + math.log(1 + math.exp(-1))) / 2 + (math.log(1 + math.exp(-1)) + math.log(2)) / 2) / 2
    assert math.isclose(ccr_loss(words, attended, 1.0).item(), want1, rel_tol=1e-6)


def test_statistics_stay_float32_under_bf16_autocast():
    # Under CPU bf16 autocast a plain float32 matmul runs in bf16 (~3 significant digits); the correlation over
    # every token of a batch and CCR's similarities must not.
    g = torch.Generator().manual_seed(0)
    y_a, y_b = torch.randn(784, 32, generator=g), torch.randn(784, 32, generator=g)
    words, attended = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
    want_c, want_ccr = channel_correlation(y_a, y_b), ccr_loss(words, attended)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (y_a @ y_b.t()).dtype == torch.bfloat16  # what autocast does to a bare product
        c, ccr = channel_correlation(y_a, y_b), ccr_loss(words, attended)
    assert c.dtype == torch.float32 and torch.allclose(c, want_c, atol=1e-6)
    assert math.isclose(ccr.item(), want_ccr.item(), rel_tol=1e-6)


HP = dict(dim=16, heads=4, layers=2, mlp_dim=32, word_dim=8, decoder_heads=4, decoder_ffn_dim=32)


def small_batch(b=4, c=12, vocab=13, length=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(4, vocab, (2, b, length), generator=g)
    labels[:, :, 0] = START
    labels[:, :, 5] = END
    labels[:, :, 6:] = 0
    return {"before": torch.randn(b, c, 3, 4, generator=g), "after": torch.randn(b, c, 3, 4, generator=g),
            "distractor": torch.randn(b, c, 3, 4, generator=g), "labels": labels[0], "distractor_labels": labels[1],
            "type": torch.zeros(b, dtype=torch.long), "step": torch.tensor(0), "epoch": torch.tensor(0)}


def make(method, **kw):
    torch.manual_seed(0)
    return build_model(method, 13, 12, {**HP, **kw})


@pytest.mark.parametrize("method", ["transformer", "dirl", "transformer_ccr", "dirl_ccr", "dirl_nonpert", "dirl_discrim"])
def test_gradients_reach_every_trained_module(method):
    m = make(method)
    loss, parts = m.training_loss(small_batch())
    loss.backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing
    assert ("dirl" in parts) == method.startswith("dirl")
    assert ("ccr" in parts) == method.endswith("ccr")
    assert (m.mlp is not None) == method.startswith("dirl")


def test_loss_is_the_weighted_sum_and_the_parts_are_the_papers_losses():
    m = make("dirl_ccr", dirl_weight=0.5, ccr_weight=0.3).eval()
    batch = small_batch()
    loss, p = m.training_loss(batch)
    assert math.isclose(loss.item(), 0.5 * p["ce_pos"] + 0.5 * p["ce_neg"] + 0.5 * p["dirl"] + 0.3 * p["ccr"], rel_tol=1e-5)
    # Recompute both auxiliary losses from the model's pieces.
    b = 4
    x = m.embed(torch.cat([batch["before"], batch["after"], batch["distractor"]]))
    y = m.mlp(x).reshape(3, b * x.size(1), -1)
    dirl = 0.5 * decorrelation_loss(channel_correlation(y[0], y[1])) + 0.5 * decorrelation_loss(channel_correlation(y[0], y[2]))
    assert math.isclose(p["dirl"], dirl.item(), rel_tol=1e-5)
    diff = m.encode(torch.cat([x[:b], x[:b]]), x[b:])
    labels = torch.cat([batch["labels"], batch["distractor_labels"]])
    out = m.decoder(labels[:, :-1], diff)
    # V-hat is the cross-attention output itself (no residual): recompute it from the last layer's words.
    layer = m.decoder.layers[-1]
    kv = layer.cross_attn.project_kv(diff)
    assert torch.allclose(out.attended, layer.cross_attn.attend(layer.cross_attn.project_q(out.words), *kv), atol=1e-5)
    w, v = masked_mean(out.words, labels[:, :-1]), masked_mean(out.attended, labels[:, :-1])
    ccr = 0.5 * ccr_loss(w[:b], v[:b]) + 0.5 * ccr_loss(w[b:], v[b:])
    assert math.isclose(p["ccr"], ccr.item(), rel_tol=1e-5)


@pytest.mark.parametrize("method, on, off", [("dirl", True, True), ("dirl_nonpert", True, False),
                                             ("dirl_discrim", False, True)])
def test_table7_rows_keep_their_terms_of_eq4(method, on, off):
    m = make(method, dirl_weight=0.5).eval()
    batch = small_batch()
    _, p = m.training_loss(batch)
    y = m.mlp(m.embed(torch.cat([batch["before"], batch["after"], batch["distractor"]]))).reshape(3, -1, HP["dim"])
    cs = [channel_correlation(y[0], y[1]), channel_correlation(y[0], y[2])]
    diag = [(1 - torch.diagonal(c)).pow(2).sum().item() for c in cs]
    offd = [(c.pow(2).sum() - torch.diagonal(c).pow(2).sum()).item() for c in cs]
    want = sum(on * d + 0.003 * off * o for d, o in zip(diag, offd)) / 2
    assert min(diag) > 0.1 and min(offd) > 0.1  # both terms are far from zero at initialisation
    assert math.isclose(p["dirl"], want, rel_tol=1e-5)


def test_mlp_is_trained_only_by_the_decorrelation_loss():
    m = make("dirl_ccr", dirl_weight=0.0)
    loss, parts = m.training_loss(small_batch())
    loss.backward()
    assert "dirl" not in parts
    assert all(p.grad is None for p in m.mlp.parameters())


def test_difference_features_remove_the_shared_features():
    m = make("transformer").eval()
    bef, aft = torch.randn(2, 12, 16), torch.randn(2, 12, 16)
    xb, xa = bef, aft
    for layer in m.layers[:-1]:
        xb, xa = layer(xb, xa)
    sb, sa = m.layers[-1].shared(xb, xa)  # Eq. 5: the last layer's cross-attention outputs
    assert torch.allclose(m.encode(bef, aft), m.fuse(torch.cat([bef - sb, aft - sa], -1)))  # Eq. 6


def test_same_seed_same_training_and_decoding():
    outs = []
    for _ in range(2):
        m = make("dirl_ccr")
        opt = torch.optim.Adam(m.parameters(), 1e-3)
        torch.manual_seed(5)
        for step in range(2):
            loss, _ = m.training_loss(small_batch(seed=step))
            opt.zero_grad()
            loss.backward()
            opt.step()
        m.eval()
        outs.append((loss.item(), m.generate(small_batch()["before"], small_batch()["after"], 9)))
    assert outs[0][0] == outs[1][0] and torch.equal(outs[0][1], outs[1][1])


def test_learns_to_copy_a_caption_and_greedy_stops_at_end():
    m = make("dirl_ccr", dropout=0.0)
    batch = small_batch(b=2)
    opt = torch.optim.Adam(m.parameters(), 3e-3)
    for _ in range(60):
        loss, _ = m.training_loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    m.eval()
    out = m.generate(batch["before"], batch["after"], max_len=9)
    assert torch.equal(out[:, :5], batch["labels"][:, 1:6])
    assert (out[:, 5:] == 0).all()
