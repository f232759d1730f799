import math

import torch

from pipeline.models.transformer_decoder import TransformerDecoder, masked_mean, sinusoid_table
from pipeline.text import END, START, UNK


def tiny(vocab=11, **kw):
    torch.manual_seed(0)
    return TransformerDecoder(vocab, dim=16, word_dim=6, heads=4, layers=2, ffn_dim=32, **kw)


def tokens(b=3, length=7, vocab=11):
    g = torch.Generator().manual_seed(2)
    t = torch.randint(4, vocab, (b, length), generator=g)
    t[:, 0] = START
    t[0, 5], t[0, 6] = END, 0
    return t


def test_shapes_of_every_output():
    dec = tiny().eval()
    mem = torch.randn(3, 9, 16)
    out = dec(tokens(), mem)
    assert out.logits.shape == (3, 7, 11)
    assert out.hidden.shape == out.words.shape == out.attended.shape == (3, 7, 16)


def test_sinusoid_table_values():
    t = sinusoid_table(4, 6)
    assert torch.allclose(t[0], torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0]))
    assert math.isclose(t[2, 0].item(), math.sin(2.0), rel_tol=1e-6)
    assert math.isclose(t[3, 3].item(), math.cos(3.0 / 10000 ** (2 / 6)), rel_tol=1e-6)


def test_causal_and_padding_do_not_leak():
    dec = tiny().eval()
    mem = torch.randn(3, 9, 16)
    t = tokens()
    ref = dec(t, mem).logits
    t2 = t.clone()
    t2[:, 4:] = 7  # change only the later positions (of the padded row too)
    out = dec(t2, mem).logits
    assert torch.allclose(out[:, :4], ref[:, :4], atol=1e-6)
    assert not torch.allclose(out[:, 4:], ref[:, 4:])


def test_greedy_with_cache_equals_full_recomputation():
    dec = tiny().eval()
    mem = torch.randn(4, 9, 16)
    got = dec.greedy(mem, max_len=8)
    # Reference: re-run the whole decoder on the prefix at every step (what the official code does).
    seq = torch.full((4, 1), START)
    want = torch.zeros(4, 8, dtype=torch.long)
    done = torch.zeros(4, dtype=torch.bool)
    for t in range(8):
        logits = dec(seq, mem).logits[:, -1]
        logits[:, UNK] = -math.inf
        w = logits.argmax(-1).masked_fill(done, 0)
        want[:, t] = w
        done |= w == END
        seq = torch.cat([seq, w[:, None]], 1)
    assert torch.equal(got, want)


def test_greedy_never_emits_unk_and_pads_after_end():
    dec = tiny().eval()
    with torch.no_grad():
        dec.head.bias.zero_()
        dec.head.bias[UNK] = 100.0  # UNK would win everywhere
        dec.head.bias[END] = 50.0  # then END
    out = dec.greedy(torch.randn(2, 9, 16), max_len=5)
    assert (out[:, 0] == END).all() and (out[:, 1:] == 0).all()


def test_masked_mean_ignores_padding():
    x = torch.arange(12, dtype=torch.float32).view(2, 3, 2)
    t = torch.tensor([[START, 5, 0], [START, 5, 6]])
    m = masked_mean(x, t)
    assert torch.allclose(m[0], torch.tensor([1.0, 2.0]))  # mean of rows 0 and 1
    assert torch.allclose(m[1], torch.tensor([8.0, 9.0]))
