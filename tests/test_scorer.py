import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.models import build_model
from pipeline.models.scorer import CBR, view_invariance_loss
from pipeline.models.token_matching import (info_nce, info_nce_both_ways, multihead_token_matching,
                                            naive_multihead_token_matching, token_matching)
from pipeline.text import END, START

# ----------------------------------------------------------------------------- token-wise matching


def test_token_matching_hand_computed():
    # One head, d = 2. Query item 0 has tokens (1,0), (0,1); key item 0 has tokens (1,0), (0,2), (1,1).
    q = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]], [[[1.0, 1.0], [0.0, 0.0]]]])  # [A=2, h=1, N=2, d=2]
    k = torch.tensor([[[[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]], [[[-1.0, 0.0], [0.0, -1.0], [0.5, 0.5]]]])  # [B=2, 1, M=3, 2]
    t2v, v2t = token_matching(q, k)
    # q0 vs k0: similarities [[1,0,1],[0,2,1]]: row maxima 1, 2 -> 1.5; column maxima 1, 2, 1 -> 4/3.
    # q0 vs k1: [[-1,0,.5],[0,-1,.5]]: rows .5, .5 -> .5; columns 0, 0, .5 -> 1/6.
    # q1 vs k0: [[1,2,2],[0,0,0]]: rows 2, 0 -> 1; columns 1, 2, 2 -> 5/3.
    # q1 vs k1: [[-1,-1,1],[0,0,0]]: rows 1, 0 -> .5; columns 0, 0, 1 -> 1/3.
    assert torch.allclose(t2v[..., 0], torch.tensor([[1.5, 0.5], [1.0, 0.5]]))
    assert torch.allclose(v2t[..., 0], torch.tensor([[4 / 3, 1 / 6], [5 / 3, 1 / 3]]))
    mtm = multihead_token_matching(q, k)
    assert torch.allclose(mtm, (torch.tensor([[1.5, 0.5], [1.0, 0.5]]) + torch.tensor([[4 / 3, 1 / 6], [5 / 3, 1 / 3]])) / 2)


def test_multihead_matching_averages_per_head_matching():
    # Two heads of d = 1: each head matches its own subspace; the official "sum the heads, then max" differs.
    q = torch.tensor([[[[1.0], [-1.0]], [[2.0], [0.0]]]])  # [1, h=2, N=2, 1]
    k = torch.tensor([[[[3.0], [-2.0]], [[1.0], [-1.0]]]])  # [1, 2, M=2, 1]
    # head 0: [[3,-2],[-3,2]] -> t2v (3+2)/2 = 2.5, v2t (3+2)/2 = 2.5; head 1: [[2,-2],[0,0]] -> t2v 1, v2t 1.
    assert torch.allclose(multihead_token_matching(q, k), torch.tensor([[(2.5 + 1.0) / 2]]))
    summed = torch.einsum("ahld,bhmd->ablm", q, k)  # the official single-head-on-concatenation form
    official = (summed.max(-1).values.mean(-1) + summed.max(-2).values.mean(-1)) / 2
    assert not torch.allclose(official, multihead_token_matching(q, k))
    assert torch.allclose(official, multihead_token_matching(q, k, per_head=False))  # the comparison option


@pytest.mark.parametrize("threads", [1, 3])  # 3: the chunk loops split over worker threads, unevenly
@pytest.mark.parametrize("chunk", [None, 1, 64, 1 << 11, 1 << 12])  # 1 << 11: backward groups of 3 + 2 items
def test_chunked_matching_and_its_gradient_equal_the_naive_formula(chunk, threads, monkeypatch):
    real = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # the split follows torch's thread count
    try:
        _check_chunked_matching(chunk)
    finally:
        torch.set_num_threads(real)  # the code under test restores "its" count (the fake one)


def _check_chunked_matching(chunk):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 3, 7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(6, 3, 9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 6, generator=g, dtype=torch.float64)
    got = multihead_token_matching(q, k, chunk)
    want = naive_multihead_token_matching(q, k)
    assert torch.allclose(got, want, atol=1e-12)
    g_got = torch.autograd.grad((got * w).sum(), (q, k))
    g_want = torch.autograd.grad((want * w).sum(), (q, k))
    for a, b in zip(g_got, g_want):
        assert torch.allclose(a, b, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exact_ties_pick_the_same_token_as_torch_max(dtype):
    # Integer-valued features make every product exact, and duplicated tokens make exact ties in both the
    # rows and the columns: the winner (and so the gradient) must be torch.max's.
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-2, 3, (3, 2, 6, 3), generator=g).to(dtype)
    k = torch.randint(-2, 3, (4, 2, 5, 3), generator=g).to(dtype)
    q[:, :, 3] = q[:, :, 1]
    k[:, :, 4] = k[:, :, 0]
    q.requires_grad_(True)
    k.requires_grad_(True)
    w = torch.randn(3, 4, generator=g, dtype=torch.float64).to(dtype)
    got = multihead_token_matching(q, k)
    want = naive_multihead_token_matching(q, k)
    assert torch.equal(got, want)
    for a, b in zip(torch.autograd.grad((got * w).sum(), (q, k)), torch.autograd.grad((want * w).sum(), (q, k))):
        assert torch.allclose(a, b, atol=1e-6)


def test_matching_gradcheck():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(3, 2, 4, 2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: token_matching(a, b, 8), (q, k))


# ----------------------------------------------------------------------------- InfoNCE


def test_info_nce_hand_computed():
    logits = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    # row 0: -log(e^2 / (e^2 + 1)) = log(1 + e^-2); row 1: -log(1/2).
    want_rows = (math.log(1 + math.exp(-2)) + math.log(2)) / 2
    assert math.isclose(info_nce(logits).item(), want_rows, rel_tol=1e-6)
    # columns: col 0 = (2, 1) target 0 -> log(1 + e^-1); col 1 = (0, 1) target 1 -> log(1 + e^-1).
    want_cols = math.log(1 + math.exp(-1))
    assert math.isclose(info_nce_both_ways(logits).item(), (want_rows + want_cols) / 2, rel_tol=1e-6)
    other = torch.tensor([[0.0, 0.0], [0.0, 0.0]])  # a second matrix: log 2 per row
    assert math.isclose(info_nce_both_ways(logits, other).item(), (want_rows + math.log(2)) / 2, rel_tol=1e-6)


def test_view_invariance_loss_is_both_directions_of_mtm():
    g = torch.Generator().manual_seed(1)
    qb, kb, qa, ka = (torch.randn(4, 2, 5, 3, generator=g) for _ in range(4))
    scale = torch.tensor(2.0)
    got = view_invariance_loss(qb, kb, qa, ka, scale)
    s_ba = 2.0 * naive_multihead_token_matching(qb, ka)
    s_ab = 2.0 * naive_multihead_token_matching(qa, kb)
    want = (F.cross_entropy(s_ba, torch.arange(4)) + F.cross_entropy(s_ab, torch.arange(4))) / 2
    assert torch.allclose(got, want, atol=1e-6)


# ----------------------------------------------------------------------------- CBR


def test_cbr_hallucination_is_conv_over_the_concatenation_and_loss_is_mtm_infonce():
    torch.manual_seed(0)
    cbr = CBR(dim=8, heads=2)
    bef, aft = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    sentence = torch.randn(3, 8)
    x = torch.cat([bef, sentence[:, None].expand(3, 5, 8)], -1)  # broadcast, then 1x1 conv
    want_h = cbr.conv2(cbr.self_attn(cbr.conv1(x)))
    assert torch.allclose(cbr.hallucinate(bef, sentence), want_h, atol=1e-5)
    split = lambda t: t.view(3, 5, 2, 4).transpose(1, 2)
    sim = math.e * naive_multihead_token_matching(split(cbr.query(want_h)), split(cbr.key(aft)))
    want = (F.cross_entropy(sim, torch.arange(3)) + F.cross_entropy(sim.t(), torch.arange(3))) / 2
    assert torch.allclose(cbr(bef, sentence, aft), want, atol=1e-5)


# ----------------------------------------------------------------------------- whole models

HP = dict(dim=16, heads=4, layers=2, word_dim=8, decoder_heads=4, decoder_ffn_dim=32, cbr_heads=4)


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


@pytest.mark.parametrize("method", ["subtraction", "rr", "rr_cbr", "scorer", "scorer_cbr"])
def test_gradients_reach_every_trained_module(method):
    m = make(method)
    loss, parts = m.training_loss(small_batch())
    loss.backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing
    assert ("sim" in parts) == method.startswith("scorer")
    assert ("cbr" in parts) == method.endswith("cbr")
    if method.endswith("cbr"):  # the paper trains CBR (the official optimiser leaves it out)
        assert any(n.startswith("cbr.") for n, _ in m.named_parameters())


def test_cbr_loss_trains_cbr_and_reaches_decoder_and_embedding():
    m = make("scorer_cbr", sim_weight=0.0)
    batch = small_batch()
    m.eval()
    _, parts = m.training_loss(batch)
    m.cbr_weight = 1.0
    loss_with, parts_with = m.training_loss(batch)
    m.cbr_weight = 0.0
    loss_without, _ = m.training_loss(batch)
    assert math.isclose(loss_with.item() - loss_without.item(), parts_with["cbr"], rel_tol=1e-4)
    m.zero_grad()
    m.cbr_weight = 1.0
    (loss_with - loss_without).backward()  # the CBR term alone
    for prefix in ("cbr.conv1", "cbr.self_attn", "cbr.query", "decoder.layers.1", "embed.proj"):
        grads = [p.grad for n, p in m.named_parameters() if n.startswith(prefix)]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads), prefix


def test_loss_is_the_weighted_sum_of_its_parts():
    m = make("scorer_cbr", sim_weight=0.1, cbr_weight=0.001).eval()
    loss, p = m.training_loss(small_batch())
    want = 0.5 * p["ce_pos"] + 0.5 * p["ce_neg"] + 0.1 * p["sim"] + 0.001 * p["cbr"]
    assert math.isclose(loss.item(), want, rel_tol=1e-5)


def test_logit_scale_starts_at_e_and_is_capped_at_100():
    m = make("scorer")
    _, parts = m.training_loss(small_batch())
    assert math.isclose(parts["logit_scale"], math.e, rel_tol=1e-6)
    with torch.no_grad():
        m.logit_scale.fill_(10.0)
    loss, parts = m.training_loss(small_batch())
    assert math.isclose(parts["logit_scale"], 100.0, rel_tol=1e-5)
    loss.backward()
    assert m.logit_scale.grad.abs().item() == 0.0


def test_subtraction_uses_the_difference_of_the_embedded_images():
    m = make("subtraction").eval()
    x = torch.randn(2, 12, 16)
    diff, qk = m.encode(x[:, :6], x[:, 6:])
    assert qk is None and torch.allclose(diff, m.fuse(x[:, 6:] - x[:, :6]))


def test_same_seed_same_training_and_decoding():
    outs = []
    for _ in range(2):
        m = make("scorer_cbr")
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
    m = make("scorer_cbr", dropout=0.0)
    batch = small_batch(b=2)
    opt = torch.optim.Adam(m.parameters(), 3e-3)
    for _ in range(60):
        loss, _ = m.training_loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    m.eval()
    out = m.generate(batch["before"], batch["after"], max_len=9)
    assert torch.equal(out[:, :5], batch["labels"][:, 1:6])  # four words then <END>
    assert (out[:, 5:] == 0).all()


def test_grid_positions_start_at_xavier_scale_below_the_content():
    """The row / column tables start xavier-uniform, as the official code's weight matrices (not nn.Embedding's
    N(0, 1), under which position outweighed content and the RR ablation never left the constant caption)."""
    from pipeline.models.attention import GridEmbedding

    torch.manual_seed(0)
    emb = GridEmbedding(feat_dim=1024, dim=128, pool=7)
    bound = math.sqrt(6 / (7 + 64))  # xavier-uniform of a [7, 64] table
    for table in (emb.col_embed.weight.detach(), emb.row_embed.weight.detach()):
        assert table.abs().max() <= bound and table.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.15)
    with torch.no_grad():
        grid = torch.randn(4, 1024, 7, 7).relu()  # a CNN grid's scale: non-negative, unit-variance pre-activation
        content = emb.proj(grid.flatten(2).transpose(1, 2))
        assert emb.positions(7, 7).std() < 0.5 * content.std()
