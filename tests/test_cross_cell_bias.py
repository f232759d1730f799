"""The cross-cell attention bias of the single-stream models (IDC-PCL's pair encoder, or its cross-modal stack
without one; CLIP4IDC's inter layers and captioning encoder): a learned scalar added to the attention score
between cell i of one image and cell i of the other. Pinned: its layout, that the attention code adds it (both
CPU paths), that it makes a cell read its counterpart in the other image, that it trains and travels in
checkpoints, and that 0 builds the official model."""

from __future__ import annotations

import pytest
import torch

from pipeline.models.attention import cross_cell_scores
from pipeline.models.clip4idc import Captioner, ClipShape, PairEncoder
from pipeline.models.dropout import attention
from pipeline.models.idc_pcl import IDCPCL

INF = float("-inf")


def test_scores_put_the_bias_between_same_cells_of_the_two_images_only():
    s = cross_cell_scores(torch.tensor(2.5), 3)  # [IMG1, c0, c1, c2, IMG2, c0', c1', c2']
    assert s.shape == (1, 1, 8, 8)
    expect = torch.zeros(8, 8)
    for i in range(3):
        expect[1 + i, 5 + i] = expect[5 + i, 1 + i] = 2.5
    torch.testing.assert_close(s[0, 0], expect, rtol=0, atol=0)
    keep = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    keep[1, 0, 0, 5:] = False  # the second sample's second image is empty: its cells are no key
    m = cross_cell_scores(torch.tensor(2.5), 3, keep)
    assert m.shape == (2, 1, 8, 8)
    torch.testing.assert_close(m[0, 0], expect, rtol=0, atol=0)
    assert torch.isinf(m[1, 0, :, 5:]).all() and torch.isfinite(m[1, 0, :, :5]).all()


def test_attention_adds_a_float_mask_in_both_cpu_paths():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=g) for _ in range(3))
    bias = torch.randn(1, 1, 5, 5, generator=g)
    expect = torch.softmax(q @ k.transpose(-2, -1) / 2.0 + bias, -1) @ v
    torch.testing.assert_close(attention(q, k, v, 0.0, attn_mask=bias), expect)  # the fused path
    # The materialised path (dropout on a CPU): a 0 / -inf float mask gives what the boolean mask gives.
    keep = torch.rand(1, 1, 5, 5, generator=g) > 0.3
    keep[..., 0] = True
    as_float = torch.zeros(1, 1, 5, 5).masked_fill(~keep, INF)
    a = attention(q, k, v, 0.2, attn_mask=keep, generator=torch.Generator().manual_seed(3))
    b = attention(q, k, v, 0.2, attn_mask=as_float, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(a, b)
    # and a finite bias shifts the scores exactly as in the fused path, under the same dropout draw
    ref = attention(q, k, v, 0.2, attn_mask=torch.zeros(1, 1, 5, 5), generator=torch.Generator().manual_seed(4))
    plain = attention(q, k, v, 0.2, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(ref, plain)
    assert not torch.allclose(attention(q, k, v, 0.2, attn_mask=bias, generator=torch.Generator().manual_seed(4)), plain)


def _cell_effect(encode, perturb_cell: int, n_cells: int) -> torch.Tensor:
    """How much each after cell's output moves when one before cell changes: [n_cells]."""
    return encode(perturb_cell).sub(encode(None)).norm(dim=-1).mean(0)[:n_cells]


@pytest.mark.parametrize("difference_encoder", [True, False])
def test_idc_pcl_reads_the_counterpart_cell_with_the_bias_and_not_without(difference_encoder):
    """With the difference encoder the bias acts in the pair encoder; without it, in the cross-modal stack."""
    g = torch.Generator().manual_seed(0)
    before, after = torch.randn(4, 12, 3, 3, generator=g), torch.randn(4, 12, 3, 3, generator=g)
    ratios = {}
    for bias in (0.0, 12.0):
        torch.manual_seed(0)
        m = IDCPCL(vocab_size=20, feat_dim=12, hidden=16, heads=2, ff=32, layers=1, dropout=0.0,
                   difference_encoder=difference_encoder, cross_cell_bias=bias).eval()
        text = m.embed_text(m.text_input(torch.tensor([[1, 5, 6, 2]] * 4)))

        def encode(cell):
            b = before.clone()
            if cell is not None:
                b[:, :, cell // 3, cell % 3] += 3.0
            with torch.no_grad():
                v = m.visual(b, after)  # [B, 2 + 18, d]: [IMG1, 9 cells, IMG2, 9 cells]
                if not difference_encoder:  # the embedded tokens: read them after the cross-modal stack
                    v = m.cross_modal(v, text, None)
            return v[:, 11:20]

        effect = _cell_effect(encode, 4, 9)
        ratios[bias] = (effect[4] / torch.cat([effect[:4], effect[5:]]).mean()).item()
    assert ratios[12.0] > 5.0 * ratios[0.0] and ratios[12.0] > 5.0


def test_idc_pcl_bias_is_trained_and_saved_with_or_without_the_difference_encoder_and_absent_at_zero():
    m = IDCPCL(vocab_size=20, feat_dim=12, hidden=16, heads=2, ff=32, layers=1, dropout=0.0, cross_cell_bias=4.0)
    assert "cross_cell_bias" in m.state_dict() and m.cross_cell_bias.item() == 4.0
    g = torch.Generator().manual_seed(1)
    v = m.visual(torch.randn(2, 12, 2, 2, generator=g), torch.randn(2, 12, 2, 2, generator=g))
    v.pow(2).sum().backward()
    assert m.cross_cell_bias.grad is not None and m.cross_cell_bias.grad.abs() > 0
    official = IDCPCL(vocab_size=20, feat_dim=12, hidden=16, heads=2, ff=32, layers=1, dropout=0.0)
    assert official.cross_cell_bias is None and "cross_cell_bias" not in official.state_dict()
    # Two cross-modal layers: the last one computes only the rows a loss reads (no image cell), so the bias acts
    # through the first (as in the default's 2 layers).
    no_de = IDCPCL(vocab_size=20, feat_dim=12, hidden=16, heads=2, ff=32, layers=2, dropout=0.0,
                   difference_encoder=False, cross_cell_bias=4.0)
    assert "cross_cell_bias" in no_de.state_dict()  # Table 4 line 5: it goes to the cross-modal stack
    no_de.training_loss({"before": torch.randn(2, 12, 2, 2, generator=g), "after": torch.randn(2, 12, 2, 2, generator=g),
                         "labels": torch.tensor([[1, 5, 6, 2], [1, 7, 2, 0]]),
                         "changed": torch.tensor([1, 0])})[0].backward()
    assert no_de.cross_cell_bias.grad is not None and no_de.cross_cell_bias.grad.abs() > 0


def test_idc_pcl_without_difference_encoder_biases_image_cells_only():
    m = IDCPCL(vocab_size=20, feat_dim=12, hidden=16, heads=2, ff=32, layers=1, dropout=0.0,
               difference_encoder=False, cross_cell_bias=12.0)
    # caption tokens get no cross-cell term: every score outside the two images' cells is 0 (or -inf)
    keep = torch.ones(1, 1, 1, 25, dtype=torch.bool)
    keep[..., -1] = False
    scores = m.joint_mask(keep, 20, 25)
    assert scores.shape == (1, 1, 25, 25)
    assert (scores[..., 20:, :24] == 0).all() and (scores[..., :24, 20:24] == 0).all() and torch.isinf(scores[..., -1]).all()
    assert (scores[0, 0, :20, :20] == cross_cell_scores(m.cross_cell_bias, 9)[0, 0]).all()


SMALL = dict(vision_width=32, vision_layers=3, vision_heads=2, embed_dim=16, text_width=16, text_layers=1,
             text_heads=2)


def test_clip_inter_layers_read_the_counterpart_patch_with_the_bias_and_not_without():
    g = torch.Generator().manual_seed(0)
    before, after = (torch.randint(0, 256, (2, 3, 224, 224), generator=g).float() for _ in range(2))
    ratios = {}
    for bias in (0.0, 12.0):
        torch.manual_seed(0)
        enc = PairEncoder(ClipShape(**SMALL), n_intra=0, cross_cell_bias=bias).eval()  # all layers joint

        def encode(patch):
            b = before.clone()
            if patch is not None:
                r, c = divmod(patch, 7)
                b[:, :, 32 * r:32 * r + 32, 32 * c:32 * c + 32] = 255 - b[:, :, 32 * r:32 * r + 32, 32 * c:32 * c + 32]
            with torch.no_grad():
                return enc(b, after)[:, 51:]  # the after image's 49 patches

        effect = _cell_effect(encode, 24, 49)
        ratios[bias] = (effect[24] / torch.cat([effect[:24], effect[25:]]).mean()).item()
    assert ratios[12.0] > 3.0 * ratios[0.0] and ratios[12.0] > 3.0


def test_clip_bias_lives_where_the_two_images_meet():
    shape = ClipShape(**SMALL)
    assert PairEncoder(shape, n_intra=3, cross_cell_bias=4.0).cross_cell_bias is None  # CLIP-FT: no inter layer
    assert PairEncoder(shape, n_intra=2, cross_cell_bias=4.0).cross_cell_bias.item() == 4.0
    assert PairEncoder(shape, n_intra=2).cross_cell_bias is None
    torch.manual_seed(0)
    cap = Captioner(30, dim=16, layers=1, heads=2, ffn=32, dropout=0.0, cross_cell_bias=4.0).eval()
    visual = torch.randn(2, 2 * 50, 16)
    with torch.no_grad():
        a = cap.memory(visual)
        cap.cross_cell_bias.fill_(0.0)
        b = cap.memory(visual)
    assert not torch.allclose(a, b)  # the captioning encoder adds it
    assert Captioner(30, dim=16, layers=1, heads=2, ffn=32).cross_cell_bias is None


@pytest.mark.parametrize("precision", [torch.bfloat16])
def test_bias_follows_autocast_precision(precision):
    m = IDCPCL(vocab_size=20, feat_dim=12, hidden=16, heads=2, ff=32, layers=1, dropout=0.1, cross_cell_bias=4.0)
    g = torch.Generator().manual_seed(2)
    with torch.autocast("cpu", dtype=precision):
        v = m.visual(torch.randn(2, 12, 2, 2, generator=g), torch.randn(2, 12, 2, 2, generator=g))
    assert torch.isfinite(v.float()).all()
