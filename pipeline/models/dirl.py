"""DIRL and CCR (Tu et al., ECCV 2024), with the ablations of its Tables 6 and 7 (method ids in parentheses).

Vanilla Transformer (``transformer``): the CNN grids are embedded (1×1 conv + learned positions, Eq. 1);
``layers`` cross-view attention layers extract the features each image shares with the other (Eq. 5), which
are removed to leave per-image difference features (Eq. 6), fused by ReLU(W[d_bef; d_aft] + b) (Eq. 7) and
captioned by the shared transformer decoder (Eqs. 8-11).

DIRL (``dirl`` = Transformer + DIRL, §3.2): a shared two-layer MLP (ReLU; no dropout, as Eq. 2: the released
code's dropout there draws different masks for the before and after tokens, a correlation deficit no training removes)
projects every position's token of both images; the channel correlation matrix C between the before and
after projections, computed over all tokens of the batch (Eq. 3), is pushed to the identity:
L_dirl = Σ_i (1 − C_ii)² + α Σ_{i≠j} C_ij² (Eq. 4, α = 0.003 as released). The MLP is a projection head:
its output feeds only this loss (Eq. 5 uses the embedded tokens). Table 7 keeps one term: the first,
non-perturbation (``dirl_nonpert``), or the second, discrimination (``dirl_discrim``), with λ_d and α unchanged.

CCR (``transformer_ccr``, ``dirl_ccr``, §3.5): in the decoder's last layer the word features Ê[W] (self-
attention sub-layer output) and the attended difference features V̂ (cross-attention output) are mean-pooled
over the caption (Eq. 12); dot-product similarities over the batch (Eq. 13) with temperature τ = 0.5 give an
InfoNCE loss in both directions (Eq. 14).

Objective (official ``train_clevr_change.py``; λ from §4.6 for CLEVR-Change): 0.5·CE(changed) +
0.5·CE(distractor) + λ_d·L_dirl + λ_c·L_ccr, each auxiliary loss averaged over the changed and the distractor
pairs (λ_d = 0.5, λ_c = 0.3 on CLEVR-Change; 0.03 / 0.05 on CLEVR-DC). On plain pairs (CLEVR-DC, a dataset
without distractor partners, ``pipeline.data``): CE(pair) + λ_d·L_dirl + λ_c·L_ccr over the batch of pairs,
whatever their change type; no term needs a partner.

Where the official code departs from the paper we follow the paper:
- CCR's two directions are two InfoNCE losses averaged (Eq. 14); the official code averages the two logit
  matrices and applies one cross-entropy;
- CCR pools over the caption's m words (Eq. 12); the official code averages over the padded length;
- V̂ is the cross-attention output itself (Eq. 9); the official code pools the sub-layer after its residual
  connection, which adds the word features themselves to the "visual" side;
- Eq. (3)'s correlation is computed on batch-centred projections, as in Barlow Twins [48] which Eq. (3)
  reproduces and as the official code does (it z-scores with the n−1 standard deviation and divides by n);
- the input is the 1024-channel grid without the two coordinate channels the official code appends;
- Eqs. 5-6: the shared features are the last cross-attention's output and the difference is F − MHCA(F, F', F');
  the official code subtracts the layer's output LN(F + MHCA(F, F', F')), whose residual cancels F itself at
  initialisation (the tokens are near unit scale), so its difference starts with no direct view of either image
  and, measured here, never leaves the language prior in a CPU budget (1.5k steps); with Eq. 6 as written the
  fused difference sees both images from the first step.

Dropout sits where the official code has it, at its rates; on a CPU its masks come from 16 random bits per
element instead of ``bernoulli_`` (``pipeline.models.dropout``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from pipeline import distributed as ddp
from pipeline.models.attention import CrossViewLayer, GridEmbedding
from pipeline.models.common import CaptionModel, ce_parts, group_slices, pair_groups, pair_mean, sequence_ce
from pipeline.models.dropout import Dropout
from pipeline.models.token_matching import info_nce_both_ways
from pipeline.models.transformer_decoder import TransformerDecoder, masked_mean


def channel_correlation(y_a: torch.Tensor, y_b: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Eq. (3): C[i, j] = correlation over the rows (samples) of channel i of ``y_a`` and channel j of ``y_b``
    (the whole batch's rows when several processes share it)."""
    y_a, y_b = ddp.gather(y_a), ddp.gather(y_b)
    # float32 also under bf16 autocast, which would otherwise run the product below (a sum over every token of
    # the batch) in bf16: 8 mantissa bits for correlations the loss pushes towards exactly 1 and 0.
    with torch.autocast(y_a.device.type, enabled=False):
        y_a = y_a.float() - y_a.float().mean(0)
        y_b = y_b.float() - y_b.float().mean(0)
        y_a = y_a / y_a.norm(dim=0).clamp(min=eps)
        y_b = y_b / y_b.norm(dim=0).clamp(min=eps)
        return y_a.t() @ y_b


def decorrelation_loss(c: torch.Tensor, alpha: float = 0.003, non_perturbation: bool = True,
                       discrimination: bool = True) -> torch.Tensor:
    """Eq. (4): diagonal of C to one (the non-perturbation term), off-diagonal to zero with trade-off ``alpha``
    (the discrimination term); Table 7 keeps one term at a time."""
    diag = torch.diagonal(c)
    on = (1 - diag).pow(2).sum() if non_perturbation else c.new_zeros(())
    off = c.pow(2).sum() - diag.pow(2).sum() if discrimination else c.new_zeros(())
    return on + alpha * off


def ccr_loss(words: torch.Tensor, attended: torch.Tensor, temperature: float = 0.5) -> torch.Tensor:
    """Eqs. (13)-(14): pooled word features [B, D] against pooled attended difference features [B, D]."""
    words, attended = ddp.gather(words), ddp.gather(attended)  # in-batch negatives: the whole batch
    with torch.autocast(words.device.type, enabled=False):  # float32 similarities, as channel_correlation
        sim = words.float() @ attended.float().t() / temperature
    return info_nce_both_ways(sim)  # rows: text→visual (L_t2v); columns: visual→text (L_v2t)


class Transformer(CaptionModel):
    """The vanilla Transformer of DIRL's Table 6; DIRL and CCR switch on below."""

    decorrelation = False
    non_perturbation = discrimination = True  # Eq. (4)'s two terms (DIRL Table 7 drops one)
    use_ccr = False

    def __init__(self, vocab_size: int, feat_dim: int = 1024, dim: int = 512, heads: int = 8, layers: int = 2,
                 grid: int = 14, dropout: float = 0.1, mlp_dim: int = 2048, word_dim: int = 300,
                 decoder_heads: int = 8, decoder_layers: int = 2, decoder_ffn_dim: int = 2048,
                 decoder_activation: str = "relu", dirl_weight: float = 0.5, offdiag_weight: float = 0.003,
                 ccr_weight: float = 0.3, temperature: float = 0.5, pool: int | None = None):
        super().__init__()
        self.embed = GridEmbedding(feat_dim, dim, grid, pool)
        self.mlp = (nn.Sequential(nn.Linear(dim, mlp_dim), nn.ReLU(), nn.Linear(mlp_dim, dim))
                    if self.decorrelation else None)
        self.layers = nn.ModuleList(CrossViewLayer(dim, heads, dropout, out_dropout=dropout, norm=i < layers - 1)
                                    for i in range(layers))
        self.fuse = nn.Sequential(nn.Linear(2 * dim, dim), Dropout(dropout), nn.ReLU())
        self.decoder = TransformerDecoder(vocab_size, dim, word_dim, decoder_heads, decoder_layers, decoder_ffn_dim,
                                          dropout, decoder_activation)
        self.dirl_weight, self.offdiag_weight = dirl_weight, offdiag_weight
        self.ccr_weight, self.temperature = ccr_weight, temperature

    def encode(self, bef: torch.Tensor, aft: torch.Tensor) -> torch.Tensor:
        """Embedded tokens [B, N, D] of both images -> fused difference features [B, N, D]."""
        xb, xa = bef, aft
        for layer in self.layers[:-1]:  # earlier layers refine both images (residual + LayerNorm)
            xb, xa = layer(xb, xa)
        sb, sa = self.layers[-1].shared(xb, xa)  # Eq. 5: the shared features are the attention output
        return self.fuse(torch.cat([bef - sb, aft - sa], -1))  # Eq. 6

    def training_loss(self, batch):
        before = batch["before"]
        b = before.size(0)
        afters, labels = pair_groups(batch)
        groups = group_slices(b, len(afters))
        x_bef = self.embed(before)
        x_afts = [self.embed(a) for a in afters]
        x_aft = torch.cat(x_afts)  # the pairs, then (partner mode) the distractor pairs
        loss_parts = {}
        aux = 0.0
        if self.decorrelation and self.dirl_weight > 0:
            # Tokens as samples (all positions of the batch); the before image's projection serves all its pairs.
            y_bef, *y_afts = (self.mlp(t).flatten(0, 1) for t in (x_bef, *x_afts))
            dirl = pair_mean([decorrelation_loss(channel_correlation(y_bef, y), self.offdiag_weight,
                                                 self.non_perturbation, self.discrimination) for y in y_afts])
            aux = aux + self.dirl_weight * dirl
            loss_parts["dirl"] = dirl.item()
        diff = self.encode(torch.cat([x_bef] * len(afters)), x_aft)
        tokens = labels[:, :-1]
        out = self.decoder(tokens, diff)
        ces = [sequence_ce(out.logits[sl], labels[sl, 1:]) for sl in groups]
        loss = pair_mean(ces) + aux
        if self.use_ccr and self.ccr_weight > 0:
            words, attended = masked_mean(out.words, tokens), masked_mean(out.attended, tokens)
            ccr = pair_mean([ccr_loss(words[sl], attended[sl], self.temperature) for sl in groups])
            loss = loss + self.ccr_weight * ccr
            loss_parts["ccr"] = ccr.item()
        return loss, {**ce_parts(ces), **loss_parts}

    @torch.no_grad()
    def generate(self, before, after, max_len: int):
        return self.decoder.greedy(self.encode(self.embed(before), self.embed(after)), max_len)


class DIRL(Transformer):
    """Transformer + DIRL (Table 6, row 2)."""

    decorrelation = True


class DIRLNonPerturbation(DIRL):
    """DIRL with Eq. (4)'s first term only (Table 7, row 2): C_ii -> 1, no decorrelation between channels."""

    discrimination = False


class DIRLDiscrimination(DIRL):
    """DIRL with Eq. (4)'s second term only (Table 7, row 3): C_ij -> 0 for i != j, weighted by alpha."""

    non_perturbation = False


class TransformerCCR(Transformer):
    """Transformer + CCR (Table 6, row 3)."""

    use_ccr = True


class DIRLCCR(Transformer):
    """DIRL + CCR, the full method."""

    decorrelation = True
    use_ccr = True
