import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.models import build_model
from pipeline.models.attention import MultiHeadAttention
from pipeline.models.dropout import Dropout, attention, dropout, keep_mask


def drop_mask(*args):
    return ~keep_mask(*args)


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- masks


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_drop_rate_is_the_documented_one(p):
    n = 2_000_000
    m = drop_mask((n,), p, gen(0))
    rate = round(p * 65536) / 65536
    sd = math.sqrt(rate * (1 - rate) / n)
    assert abs(m.float().mean().item() - rate) < 5 * sd
    # Elements are independent (also within one 64-bit draw): neighbours are both dropped with rate².
    both = (m[0::2] & m[1::2]).float().mean().item()
    assert abs(both - rate ** 2) < 5 * math.sqrt(rate ** 2 * (1 - rate ** 2) / (n // 2))
    lanes = m.view(-1, 4).float().mean(0)  # each of the four 16-bit lanes of a draw
    assert (lanes - rate).abs().max() < 5 * sd * 2


def test_mask_edge_rates_and_shapes():
    assert not drop_mask((1000,), 0.0, gen(0)).any()
    assert drop_mask((1000,), 1.0, gen(0)).all()
    m = drop_mask((3, 5, 7), 0.5, gen(0))  # 105 elements: not a multiple of the 4 lanes of a draw
    assert m.shape == (3, 5, 7) and m.dtype == torch.bool and 0 < m.sum() < 105
    assert torch.equal(keep_mask((3, 5, 7), 0.5, gen(0)), ~m)
    for p in (-0.1, 1.5):
        with pytest.raises(ValueError):
            drop_mask((4,), p)
        with pytest.raises(ValueError):
            dropout(torch.ones(4), p, True)


def test_masks_follow_the_seed():
    assert torch.equal(drop_mask((999,), 0.3, gen(1)), drop_mask((999,), 0.3, gen(1)))
    assert not torch.equal(drop_mask((999,), 0.3, gen(1)), drop_mask((999,), 0.3, gen(2)))
    torch.manual_seed(4)  # without a generator: torch's global one
    a = drop_mask((999,), 0.3)
    torch.manual_seed(4)
    assert torch.equal(a, drop_mask((999,), 0.3))


# ----------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("shape", [(6, 7, 5), (64,)])
def test_dropout_forward_and_gradient(shape):
    p = 0.3
    x = torch.randn(shape, generator=gen(0), requires_grad=True)
    y = dropout(x, p, True, generator=gen(7))
    keep = keep_mask(shape, p, gen(7))
    assert 0 < keep.sum() < keep.numel()
    assert torch.allclose(y, x * keep / (1 - p), atol=1e-6)
    w = torch.randn(shape, generator=gen(1))
    y.backward(w)
    assert torch.allclose(x.grad, w * keep / (1 - p), atol=1e-6)
    assert not torch.equal(y, dropout(x, p, True, generator=gen(8)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_equals_the_where_formulation_bitwise(dtype):
    """The mask multiplies as its uint8 view for speed: values and gradients must equal, to the bit (as numbers:
    a dropped negative element may be -0.0), those of ``where(keep, x, 0) * s``, which earlier runs used."""
    p, shape = 0.1, (4, 3, 17, 19)
    x = torch.randn(shape, generator=gen(0)).to(dtype).requires_grad_()
    keep = keep_mask(shape, p, gen(3))
    y = dropout(x, p, True, generator=gen(3))
    want = torch.where(keep, x.detach(), 0.0).mul_(1 / (1 - p))
    assert y.dtype == dtype and torch.equal(y, want)  # torch.equal: -0.0 == 0.0, every other bit compared
    w = torch.randn(shape, generator=gen(1)).to(dtype)
    y.backward(w)
    assert torch.equal(x.grad, torch.where(keep, w, 0.0).mul_(1 / (1 - p)))
    q, k, v = (torch.randn(2, 3, 6, 8, generator=gen(i)).to(dtype).requires_grad_() for i in (4, 5, 6))
    out = attention(q, k, v, p, generator=gen(2))
    probs = ((q * 8 ** -0.5) @ k.transpose(-2, -1)).softmax(-1)
    ref = (torch.where(keep_mask(probs.shape, p, gen(2)), probs, 0.0) @ v).mul_(1 / (1 - p))
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)),
                                                  torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))))


def test_dropout_identity_cases():
    x = torch.randn(10, 10)
    assert dropout(x, 0.5, False) is x and dropout(x, 0.0, True) is x
    assert torch.equal(dropout(x, 1.0, True), torch.zeros_like(x))
    d = Dropout(0.25)
    assert d.p == 0.25 and "p=0.25" in repr(d)
    assert not list(d.parameters()) and not list(d.buffers()) and not d.state_dict()
    d.eval()
    assert d(x) is x
    d.train()
    torch.manual_seed(3)
    y = d(x)
    torch.manual_seed(3)
    assert torch.allclose(y, x * keep_mask(x.shape, 0.25) / 0.75, atol=1e-6)


# ----------------------------------------------------------------------------- attention


def heads(b=2, h=3, n=5, s=7, d=4, dtype=torch.float32, seed=0):
    g = gen(seed)
    return (torch.randn(b, h, n, d, generator=g, dtype=dtype), torch.randn(b, h, s, d, generator=g, dtype=dtype),
            torch.randn(b, h, s, d, generator=g, dtype=dtype))


def reference(q, k, v, keep, p, causal):
    """The explicit formula: softmax(q kᵀ/√d + causal mask), dropout with ``keep``, times v."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if causal:
        n, s = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(n, s, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) * keep / (1 - p)) @ v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s", [5, 7])
def test_attention_matches_sdpa_without_drops(causal, s):
    q, k, v = heads(n=5, s=s)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert torch.allclose(attention(q, k, v, 0.0, causal), want, atol=1e-5)
    # p below 2^-17 drops nothing but still takes the explicit CPU path: the same result as SDPA.
    assert torch.allclose(attention(q, k, v, 1e-6, causal), want, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_dropout_and_gradients(causal):
    p = 0.3
    q, k, v = (t.requires_grad_() for t in heads(n=6, s=6))
    keep = keep_mask((2, 3, 6, 6), p, gen(5))
    assert 0 < keep.sum() < keep.numel()
    out = attention(q, k, v, p, causal, generator=gen(5))
    want = reference(q, k, v, keep, p, causal)
    assert torch.allclose(out, want, atol=1e-5)
    w = torch.randn(out.shape, generator=gen(9))
    got = torch.autograd.grad(out, (q, k, v), w)
    ref = torch.autograd.grad(want, (q, k, v), w)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-5)
    torch.manual_seed(11)  # the global generator by default
    a = attention(q, k, v, p, causal)
    torch.manual_seed(11)
    assert torch.equal(a, attention(q, k, v, p, causal))


@pytest.mark.parametrize("causal", [False, True])
def test_attention_gradcheck(causal):
    q, k, v = (t.requires_grad_() for t in heads(b=1, h=2, n=3, s=3, d=2, dtype=torch.float64))
    f = lambda q, k, v: attention(q, k, v, 0.4, causal, generator=gen(2))  # the same mask at every call
    assert torch.autograd.gradcheck(f, (q, k, v))


def test_multihead_attention_uses_it_in_training_only():
    torch.manual_seed(0)
    att = MultiHeadAttention(12, 3, dropout=0.2)
    x = torch.randn(2, 5, 12)
    q, k, v = att.project_qkv(x)
    torch.manual_seed(1)
    a = att.attend(q, k, v, causal=True)
    torch.manual_seed(1)
    want = attention(q, k, v, 0.2, True)
    assert torch.allclose(a, att.out_proj(want.transpose(1, 2).reshape(2, 5, 12)), atol=1e-6)
    att.eval()
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(att.attend(q, k, v, causal=True), att.out_proj(want.transpose(1, 2).reshape(2, 5, 12)),
                          atol=1e-6)


# ----------------------------------------------------------------------------- models


@pytest.mark.parametrize("method,hp", [
    ("scorer_cbr", dict(dim=16, heads=4, layers=2, word_dim=8, decoder_heads=4, decoder_ffn_dim=32, cbr_heads=4)),
    ("dirl_ccr", dict(dim=16, heads=4, layers=2, mlp_dim=32, word_dim=8, decoder_heads=4, decoder_ffn_dim=32)),
])
def test_state_dict_keys_as_with_nn_dropout(method, hp):
    m = build_model(method, 13, 12, hp)
    drops = [(name, mod) for name, mod in m.named_modules() if isinstance(mod, Dropout)]
    assert drops and not any(isinstance(mod, nn.Dropout) for mod in m.modules())
    keys = list(m.state_dict())
    for name, mod in drops:  # back to torch's nn.Dropout: the checkpoint layout must be the same
        parent, _, attr = name.rpartition(".")
        setattr(m.get_submodule(parent), attr, nn.Dropout(mod.p))
    assert list(m.state_dict()) == keys
