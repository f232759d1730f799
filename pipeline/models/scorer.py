"""SCORER and CBR (Tu et al., ICCV 2023), with the ablations of its Table 6 (method ids in parentheses).

SCORER (``scorer``): the CNN grids of "before" and "after" are embedded (1×1 conv + learned positions,
Eq. 1). ``layers`` cross-view layers reconstruct each image's unchanged objects from the other image by
multi-head cross-attention, integrated with a residual and LayerNorm (Eqs. 5-6); the difference
representation fuses both images, ReLU(W[bef; aft] + b) (Eq. 7), and a transformer decoder captions it.
View-invariant representation learning (§3.2.2): multi-head token-wise matching (MTM, Eqs. 2-3) of the last
layer's per-head queries and keys gives B×B before→after and after→before similarities over the batch, and
an InfoNCE loss in each direction aligns each pair against the other pairs of the batch (Eq. 4), with a
learned logit scale (initialised to e¹ and capped at 100, as in the official code).

CBR (``scorer_cbr``, §3.4): the decoder's hidden states are mean-pooled over the caption into a sentence
feature, broadcast over the grid and concatenated with the embedded "before" tokens; a 1×1 conv, multi-head
self-attention (Eq. 10) and a 1×1 conv give the "hallucination" of the after image, contrasted with the
embedded "after" tokens by MTM and InfoNCE both ways over the batch (Eq. 11).

Ablations: ``subtraction`` (difference by direct subtraction, ReLU(W(X_aft − X_bef) + b), no reconstruction
and no alignment), ``rr`` (vanilla representation reconstruction: SCORER without the contrastive alignment),
``rr_cbr`` (RR + CBR).

Objective (official ``train.py``; weights of the supplementary's trade-off study for CLEVR-Change):
0.5·CE(changed pair) + 0.5·CE(distractor pair) + λ_s·L_sim + λ_c·L_cbr, each contrastive loss averaged over
the changed and the distractor pairs' batches (λ_s = 0.1, λ_c = 0.001 on CLEVR-Change). On plain pairs (a
dataset without distractor partners, ``pipeline.data``): CE(pair) + λ_s·L_sim + λ_c·L_cbr over the batch of
pairs, whatever their change type; no term needs a partner.

Where the official code departs from the paper we follow the paper:
- MTM matches per head (the official einsum sums the heads first, see ``token_matching``);
- CBR's parameters are trained: the official optimiser omits them (issue #3: the author says training them
  "obtains the similar performance"), which leaves CBR a fixed random projection;
- the sentence feature is the mean over the caption's words (the official mean divides by the padded length);
- standard multi-head attention with an output projection (the official SCORER attention has none);
- the input is the 1024-channel grid without the two coordinate channels the official code appends: the
  learned position embedding already carries the location.

Dropout sits where the official code has it, at its rates; on a CPU its masks come from 16 random bits per
element instead of ``bernoulli_`` (``pipeline.models.dropout``).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from pipeline import distributed as ddp
from pipeline.models.attention import CrossViewLayer, GridEmbedding, MultiHeadAttention
from pipeline.models.common import CaptionModel, ce_parts, group_slices, pair_groups, pair_mean, sequence_ce
from pipeline.models.dropout import Dropout
from pipeline.models.token_matching import info_nce_both_ways, multihead_token_matching
from pipeline.models.transformer_decoder import TransformerDecoder, masked_mean

MAX_LOGIT_SCALE = math.log(100.0)


def _scale(logit_scale: nn.Parameter) -> torch.Tensor:
    """exp of the learned logit scale, capped at 100 (the official code clamps the parameter after each step)."""
    return logit_scale.clamp(max=MAX_LOGIT_SCALE).exp()


def view_invariance_loss(q_bef, k_bef, q_aft, k_aft, logit_scale, chunk_elements=None, per_head=True) -> torch.Tensor:
    """Eq. (4): InfoNCE over the batch on MTM(before→after) and MTM(after→before). Inputs per head [B, h, N, d]:
    the queries and keys of the before and after tokens (the last cross-view layer's projections)."""
    # In-batch negatives: the whole batch's rows when several processes share it (pipeline.distributed).
    q_bef, k_bef, q_aft, k_aft = map(ddp.gather, (q_bef, k_bef, q_aft, k_aft))
    s_ba = logit_scale * multihead_token_matching(q_bef, k_aft, chunk_elements, per_head)
    s_ab = logit_scale * multihead_token_matching(q_aft, k_bef, chunk_elements, per_head)
    return info_nce_both_ways(s_ba, s_ab)


class CBR(nn.Module):
    """Cross-modal backward reasoning: hallucinate the after image from the sentence and the before image."""

    def __init__(self, dim: int = 512, heads: int = 8, per_head: bool = True):
        super().__init__()
        self.heads, self.per_head = heads, per_head
        self.conv1 = nn.Linear(2 * dim, dim)  # 1×1 conv over [before; sentence]
        self.self_attn = MultiHeadAttention(dim, heads, dropout=0.0, bias=False)  # official: nn.MultiheadAttention(bias=False)
        self.conv2 = nn.Linear(dim, dim)
        self.query = nn.Linear(dim, dim)  # MTM projections of the hallucination and of the after image
        self.key = nn.Linear(dim, dim)
        self.logit_scale = nn.Parameter(torch.ones([]))

    def hallucinate(self, bef: torch.Tensor, sentence: torch.Tensor) -> torch.Tensor:
        """Eqs. (9)-(10): ``bef`` [B, N, D], ``sentence`` [B, D] -> hallucinated after tokens [B, N, D]."""
        d = bef.size(-1)
        w = self.conv1.weight
        # conv1([bef; broadcast(sentence)]) = W_b·bef + W_s·sentence: the sentence term once per pair.
        x = bef @ w[:, :d].t() + (sentence @ w[:, d:].t() + self.conv1.bias).unsqueeze(1)
        return self.conv2(self.self_attn(x))

    def forward(self, bef, sentence, aft, chunk_elements=None) -> torch.Tensor:
        h = self.hallucinate(bef, sentence)
        split = lambda x: x.view(x.size(0), x.size(1), self.heads, -1).transpose(1, 2)
        q, k = ddp.gather(self.query(h)), ddp.gather(self.key(aft))  # in-batch negatives: the whole batch
        sim = _scale(self.logit_scale) * multihead_token_matching(split(q), split(k),
                                                                  chunk_elements, self.per_head)
        return info_nce_both_ways(sim)  # Eq. (11): hallucination→after rows and after→hallucination columns


class SCORER(CaptionModel):
    difference = "reconstruction"
    contrastive = True
    use_cbr = False

    def __init__(self, vocab_size: int, feat_dim: int = 1024, dim: int = 512, heads: int = 8, layers: int = 2,
                 grid: int = 14, dropout: float = 0.1, word_dim: int = 300, decoder_heads: int = 8,
                 decoder_layers: int = 2, decoder_ffn_dim: int = 512, decoder_activation: str = "gelu",
                 sim_weight: float = 0.1, cbr_weight: float = 0.001, cbr_heads: int = 8,
                 mtm_per_head: bool = True, mtm_chunk_elements: int | None = None, pool: int | None = None):
        super().__init__()
        self.embed = GridEmbedding(feat_dim, dim, grid, pool)
        if self.difference == "reconstruction":
            self.layers = nn.ModuleList(CrossViewLayer(dim, heads, dropout) for _ in range(layers))
            self.fuse = nn.Sequential(nn.Linear(2 * dim, dim), Dropout(dropout), nn.ReLU())
        else:
            self.layers = nn.ModuleList()
            self.fuse = nn.Sequential(nn.Linear(dim, dim), Dropout(dropout), nn.ReLU())
        self.logit_scale = nn.Parameter(torch.ones([])) if self.contrastive else None
        self.cbr = CBR(dim, cbr_heads, mtm_per_head) if self.use_cbr else None
        self.per_head = mtm_per_head
        self.decoder = TransformerDecoder(vocab_size, dim, word_dim, decoder_heads, decoder_layers, decoder_ffn_dim,
                                          dropout, decoder_activation)
        self.sim_weight, self.cbr_weight = sim_weight, cbr_weight
        self.chunk = mtm_chunk_elements

    def encode(self, bef: torch.Tensor, aft: torch.Tensor, return_qk: bool = False):
        """Embedded tokens [B, N, D] of both images -> (difference representation [B, N, D], the last layer's
        per-head (q, k) if ``return_qk`` else None)."""
        if self.difference == "subtraction":
            return self.fuse(aft - bef), None
        qk = None
        for i, layer in enumerate(self.layers):
            last = return_qk and i == len(self.layers) - 1
            bef, aft, *qk_i = layer(bef, aft, return_qk=last)
            qk = qk_i or qk
        return self.fuse(torch.cat([bef, aft], -1)), qk  # qk: ((q_bef, k_bef), (q_aft, k_aft)) or None

    def training_loss(self, batch):
        before = batch["before"]
        b = before.size(0)
        afters, labels = pair_groups(batch)
        groups = group_slices(b, len(afters))
        x_bef = self.embed(before)  # embedded once for all of its pairs
        x_aft = torch.cat([self.embed(a) for a in afters])  # the pairs, then (partner mode) the distractor pairs
        x_bef2 = torch.cat([x_bef] * len(afters))
        need_qk = self.contrastive and self.sim_weight > 0
        diff, qk = self.encode(x_bef2, x_aft, return_qk=need_qk)
        tokens = labels[:, :-1]
        out = self.decoder(tokens, diff)
        ces = [sequence_ce(out.logits[sl], labels[sl, 1:]) for sl in groups]
        loss = pair_mean(ces)
        parts = ce_parts(ces)
        if need_qk:
            (q_bef, k_bef), (q_aft, k_aft) = qk  # per head [nB, h, N, d]: the pairs, then the distractor pairs
            sims = [view_invariance_loss(q_bef[sl], k_bef[sl], q_aft[sl], k_aft[sl], _scale(self.logit_scale),
                                         self.chunk, self.per_head)
                    for sl in groups]  # changed pairs, distractor pairs: separate batches
            sim = pair_mean(sims)
            loss = loss + self.sim_weight * sim
            parts["sim"] = sim.item()
            parts["logit_scale"] = _scale(self.logit_scale).item()
        if self.cbr is not None and self.cbr_weight > 0:
            sentence = masked_mean(out.hidden, tokens)
            cbr = pair_mean([self.cbr(x_bef, sentence[sl], x_aft[sl], self.chunk) for sl in groups])
            loss = loss + self.cbr_weight * cbr
            parts["cbr"] = cbr.item()
        return loss, parts

    @torch.no_grad()
    def generate(self, before, after, max_len: int):
        return self.decoder.greedy(self.encode(self.embed(before), self.embed(after))[0], max_len)


class SCORERCBR(SCORER):
    use_cbr = True


class RR(SCORER):
    """Vanilla representation reconstruction: SCORER's architecture without the cross-view alignment."""

    contrastive = False


class RRCBR(RR):
    use_cbr = True


class Subtraction(SCORER):
    """Transformer baseline with the difference computed by direct subtraction of the embedded images."""

    difference = "subtraction"
    contrastive = False
