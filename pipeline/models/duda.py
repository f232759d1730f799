"""DUDA: Dual Dynamic Attention (Park et al., ICCV 2019), as used by Hosseinzadeh & Wang (CVPR 2021) §3.

Change detector: the difference X_diff = X_aft - X_bef is concatenated with each image; one shared
1×1-conv stack (conv → GroupNorm → dropout → ReLU → conv → sigmoid) gives a spatial attention map per
image; features are *summed* under the map (the official code sums, it does not average), giving
l_bef, l_aft and l_diff = l_aft - l_bef.

Dynamic speaker: an attention LSTM reads [u; h_c] with u = embed([l_bef; l_diff; l_aft]) and chooses
soft weights over the three features; a caption LSTM reads [word embedding; attended feature].

Loss (official ``train.py``): 0.5·CE(changed pair) + 0.5·CE(distractor pair) + λ_L1 · Σ(att_bef + att_aft)
of the changed pair − λ_ent · H(dynamic attention) (λ_ent = 0 by default, as released). On plain pairs
(a dataset without distractor partners, ``pipeline.data``): CE(pair) + λ_L1 · Σ(att_bef + att_aft) of every
pair (a ``no_change`` pair is one of them) − λ_ent · H; nothing else needs a partner.
Input features get two coordinate channels in [-1, 1] (the official ``AddSpatialInfo``): 1024 → 1026,
handled analytically in ``ChangeDetector`` rather than by concatenation.
The official 6-way change-type classifier is omitted: its loss is never used in the released code.
``diff_prior`` (0 = the official init) adds to the dynamic attention's initial logit for l_diff: with uniform
weights the caption LSTM reads (l_bef + l_diff + l_aft)/3 = 2/3·l_aft, with no trace of the before image, and
which input the random init favours decides whether a run ever reads the difference (config/config.yaml, duda).

Two deviations, off by default (the official model), on for CLEVR-Change's embedded default (measured there,
docs/measurements.md "DUDA reads the before image"):
- ``own_difference``: the before map reads [X_bef; X_bef − X_aft] instead of [X_bef; X_aft − X_bef], so the
  shared conv sees, for each image, what that image has and the other lacks. With the official sign one map head
  learns one sign of the difference: the maps found added objects (after) or dropped and recoloured ones (before),
  never both, whichever a run met first.
- ``usage_weight``: − λ_u · H(ū), ū the dynamic attention's mean weights over the batch's words (each word may
  still pick one input; across words all three are used: a load-balancing term, as for a mixture of experts'
  router). Without it the attention settles on one input within ~100 steps (l_aft: the before image never
  reaches the caption); the official per-word entropy bonus keeps every word near uniform instead, which reads
  (l_bef + l_diff + l_aft)/3 = 2/3·l_aft.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline import distributed as ddp
from pipeline.models.common import (CaptionModel, autocast_cast, ce_parts, group_slices, pair_groups, pair_mean,
                                    sequence_ce)
from pipeline.models.dropout import Dropout
from pipeline.text import END, START


def coordinates(h: int, w: int, ref: torch.Tensor) -> torch.Tensor:
    """The two coordinate channels in [-1, 1] of the official ``AddSpatialInfo``: [2, H*W]."""
    ys = torch.linspace(-1, 1, h, device=ref.device, dtype=ref.dtype).view(h, 1).expand(h, w)
    xs = torch.linspace(-1, 1, w, device=ref.device, dtype=ref.dtype).view(1, w).expand(h, w)
    return torch.stack([ys, xs]).reshape(2, h * w)


def pool_grid(x: torch.Tensor, size: int) -> torch.Tensor:
    """Average-pool a [B, C, H, W] grid to size × size: a plain k × k pooling where the grid divides evenly
    (the same cells as the adaptive pooling, ~40 % faster on a CPU), the adaptive one elsewhere."""
    h, w = x.shape[-2:]
    if h == w == size:  # stored pooled already (features.<backbone>.pool)
        return x
    if h % size == 0 and w % size == 0 and h // size == w // size:
        return F.avg_pool2d(x, h // size)
    return F.adaptive_avg_pool2d(x, size)


class ChangeDetector(nn.Module):
    """Dual attention: one attention map on the before image, one on the after image.

    The official first layer is a 1×1 conv over [X; X_diff] (2·(C+2) channels, C feature channels plus
    2 coordinate channels). Being linear, it equals W_x·X + W_d·(X_aft − X_bef): each image is projected
    once and a before image shared by several pairs (changed and distractor) is projected once. The
    coordinate channels cancel in X_diff and add a constant map W_xy·coords. Same function and
    parameters as the official conv (``embed_conv`` keeps its [hidden, 2·(C+2), 1, 1] shape).
    """

    def __init__(self, dim: int, hidden: int = 128, groups: int = 32, dropout: float = 0.5, pool: int | None = None,
                 reduce: str = "sum", own_difference: bool = False):
        super().__init__()
        self.own_difference = own_difference  # the before map reads X_bef - X_aft (module docstring)
        if reduce not in ("sum", "mean"):
            raise ValueError(f"reduce must be 'sum' (official) or 'mean', not {reduce!r}")
        self.reduce = reduce
        self.dim = dim  # feature channels + 2 coordinates
        self.pool = pool  # average-pool the grid to pool x pool first (CPU-sized runs)
        self.embed_conv = nn.Conv2d(2 * dim, hidden, 1)
        # Dropout: the cheap-mask one of pipeline.models.dropout (same rate; bernoulli_ was ~4 % of a CPU step)
        self.embed_rest = nn.Sequential(nn.GroupNorm(groups, hidden), Dropout(dropout), nn.ReLU())
        self.att = nn.Conv2d(hidden, 1, 1)

    def forward(self, bef: torch.Tensor, afts: list[torch.Tensor]):
        """``bef`` [B, C, H, W] and each ``aft`` [B, C, H, W] → per pair (l_bef, l_aft, l_diff, att_bef, att_aft).

        Pooled vectors carry C+2 dims (features, then the attention-weighted coordinates).
        """
        if self.pool:
            bef, afts = pool_grid(bef, self.pool), [pool_grid(a, self.pool) for a in afts]
        b, c, h, w = bef.shape
        n = len(afts)
        weight = self.embed_conv.weight.view(-1, 2 * self.dim)
        hid = weight.size(0)
        w_xy = weight[:, c:c + 2]
        # Cells as rows, [1+n, B, HW, C], in one copy: both products below then read it as stored (matmul would
        # otherwise copy a transposed [B·HW, C] grid for the projection, bmm one for the pooling), cast once.
        imgs = autocast_cast(torch.stack([x.flatten(2).transpose(1, 2) for x in (bef, *afts)]))
        # W_x and W_d stacked: one [B·HW, C] x [C, 2·hidden] product instead of two einsums (measured, one core,
        # bf16 autocast, layer4 batch 32: 37 against 120 ms forward + backward).
        w_both = torch.cat([weight[:, :c], weight[:, self.dim:self.dim + c]])
        proj_img, proj_dif = (imgs @ w_both.t()).transpose(2, 3).split(hid, 2)  # each [1+n, B, hidden, HW]
        coords = coordinates(h, w, bef)
        const = (w_xy @ coords).unsqueeze(0) + self.embed_conv.bias.view(1, -1, 1)  # [1, hidden, HW]
        sign = -1.0 if self.own_difference else 1.0
        e_bef = proj_img[0] + sign * (proj_dif[1:] - proj_dif[0]) + const  # [n, B, hidden, HW]
        e_aft = proj_img[1:] + proj_dif[1:] - proj_dif[0] + const
        e = torch.cat([e_bef, e_aft]).reshape(2 * n * b, -1, h, w)
        maps = torch.sigmoid(self.att(self.embed_rest(e))).view(2, n, b, 1, h * w)
        att_bef, att_aft = maps[0], maps[1]  # [n, B, 1, HW]
        coords_t = coords.t()
        scale = 1.0 / (h * w) if self.reduce == "mean" else 1.0  # mean: the attended sums divided by the cell count
        outs = []
        for i in range(n):
            l_bef = scale * torch.cat([torch.bmm(att_bef[i], imgs[0]).squeeze(1), att_bef[i].squeeze(1) @ coords_t], 1)
            l_aft = scale * torch.cat([torch.bmm(att_aft[i], imgs[i + 1]).squeeze(1), att_aft[i].squeeze(1) @ coords_t], 1)
            outs.append((l_bef, l_aft, l_aft - l_bef, att_bef[i].view(b, 1, h, w), att_aft[i].view(b, 1, h, w)))
        return outs


def lstm_gates_step(gates_x: torch.Tensor, h: torch.Tensor, c: torch.Tensor, cell: nn.LSTMCell):
    """``nn.LSTMCell`` with its input projection (``gates_x`` = W_ih·x + b_ih) computed by the caller."""
    gates = gates_x + F.linear(h, cell.weight_hh, cell.bias_hh)
    i, f, g, o = gates.chunk(4, 1)  # PyTorch's gate order
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


class DynamicSpeaker(nn.Module):
    """Attention LSTM + dynamic attention over {l_bef, l_diff, l_aft} + caption LSTM.

    The LSTM input projections are split by input part: the feature embedding u is constant over time
    and the words are known under teacher forcing, so W·u, W·E(words) and W·l_i (for the three features,
    mixed by the step's attention weights α since W·Σα_i l_i = Σα_i W·l_i) are computed once per sequence
    instead of once per step. Same parameters and function as two ``nn.LSTMCell``s fed the concatenations.
    """

    def __init__(self, feat_dim: int, vocab_size: int, embed_dim: int = 300, hidden: int = 512,
                 att_hidden: int = 512, dropout: float = 0.5, diff_prior: float = 0.0):
        super().__init__()
        self.hidden, self.embed_dim = hidden, embed_dim
        self.embed_feats = nn.Sequential(nn.Linear(3 * feat_dim, hidden), nn.ReLU(), Dropout(dropout))
        self.att_lstm = nn.LSTMCell(2 * hidden, hidden)  # input [u; h_lang]
        self.dyn_att = nn.Sequential(nn.Linear(2 * hidden, att_hidden), nn.ReLU(), nn.Linear(att_hidden, 3))
        self.word_embed = nn.Sequential(nn.Embedding(vocab_size, embed_dim), nn.ReLU(), Dropout(dropout))
        self.lang_lstm = nn.LSTMCell(embed_dim + feat_dim, hidden)  # input [E(w); l_dyn]
        self.drop = Dropout(dropout)
        self.logit = nn.Linear(hidden, vocab_size)
        with torch.no_grad():  # initial logit bias towards l_diff (0: the official init)
            self.dyn_att[-1].bias[1] += diff_prior

    def _prepare(self, l_bef, l_diff, l_aft):
        feats = torch.stack([l_bef, l_diff, l_aft], 1)  # [B, 3, D]
        u = self.embed_feats(feats.flatten(1))
        h = self.hidden
        att_u = F.linear(u, self.att_lstm.weight_ih[:, :h], self.att_lstm.bias_ih)  # [B, 4H]
        lang_f = F.linear(feats, self.lang_lstm.weight_ih[:, self.embed_dim:])  # [B, 3, 4H]
        # The h_lang part of the attention LSTM's input weight, sliced once per sequence: sliced at every step,
        # each step's backward zero-fills and adds a gradient of the whole [4H, 2H] weight (and copies the
        # non-contiguous slice for the product), ~20 % of a step at the default sizes.
        w_att_h = autocast_cast(self.att_lstm.weight_ih[:, h:].contiguous())  # once, not at every step
        z = u.new_zeros(u.size(0), h)
        return u, (att_u, w_att_h), lang_f, ((z, z), (z, z))

    def _step(self, u, att_u, lang_f, lang_w, state):
        """One step given the word's input projection ``lang_w`` = W_w·E(w) + b_ih; ``att_u`` is the pair
        (W_u·u + b_ih, W_h) of the attention LSTM's input projection from ``_prepare``."""
        (h_a, c_a), (h_l, c_l) = state
        att_u, w_att_h = att_u
        h_a, c_a = lstm_gates_step(att_u + F.linear(h_l, w_att_h), h_a, c_a, self.att_lstm)
        alpha = F.softmax(self.dyn_att(torch.cat([u, h_a], 1)), dim=1)  # [B, 3]
        gates_x = lang_w + (alpha.unsqueeze(2) * lang_f).sum(1)
        h_l, c_l = lstm_gates_step(gates_x, h_l, c_l, self.lang_lstm)
        return self.logit(self.drop(h_l)), alpha, ((h_a, c_a), (h_l, c_l))

    def _word_proj(self, emb):
        return F.linear(emb, self.lang_lstm.weight_ih[:, :self.embed_dim], self.lang_lstm.bias_ih)

    def forward(self, l_bef, l_diff, l_aft, labels):
        """Teacher forcing: logits [B, L-1, V] and attention weights [B, L-1, 3] for positions 1..L-1 of
        ``labels`` (which start with <START>). Positions after a caption's last non-padding target are not
        computed (zero logits and weights): the losses mask them, so the result there is the same.

        The captions are packed as ``pack_padded_sequence`` does: sorted longest first, step t runs only on the
        prefix of captions that still have a target at t. Labels come padded to the longest caption of the
        dataset (24 on CLEVR-Change, ~7 tokens on average): the batch would run ~3x the steps it needs."""
        b, n_pos = labels.size(0), labels.size(1) - 1
        targets = labels[:, 1:] > 0
        n_steps = torch.where(targets.any(1), n_pos - targets.flip(1).int().argmax(1), 0)  # up to the last target
        order = n_steps.argsort(descending=True, stable=True)
        sorted_steps = n_steps[order].tolist()
        u, (att_u, w_att_h), lang_f, state = self._prepare(l_bef[order], l_diff[order], l_aft[order])
        t_max = sorted_steps[0] if b else 0
        # [B, T, 4H] in one matmul, unbound once: indexing it per step makes each step's backward zero-fill and
        # add a gradient of the whole tensor (~13 % of a step at the default sizes); unbind's is one stack.
        lang_w = self._word_proj(self.word_embed(labels[order, :t_max])).unbind(1)
        logits, alphas, n = [], [], b
        for t in range(t_max):
            n_t = sum(k > t for k in sorted_steps)
            if n_t < n:  # sliced only when a caption ends: each slice's backward fills its whole input once
                n = n_t
                u, att_u, lang_f = u[:n], att_u[:n], lang_f[:n]
                state = tuple((h[:n], c[:n]) for h, c in state)
            lg, a, state = self._step(u, (att_u, w_att_h), lang_f, lang_w[t][:n] if n < b else lang_w[t], state)
            logits.append(F.pad(lg, (0, 0, 0, b - n)))
            alphas.append(F.pad(a, (0, 0, 0, b - n)))
        inverse = order.argsort()
        logits = torch.stack(logits, 1)[inverse] if logits else l_bef.new_zeros(b, 0, self.logit.out_features)
        alphas = torch.stack(alphas, 1)[inverse] if alphas else l_bef.new_zeros(b, 0, 3)
        return F.pad(logits, (0, 0, 0, n_pos - t_max)), F.pad(alphas, (0, 0, 0, n_pos - t_max))

    @torch.no_grad()
    def greedy(self, l_bef, l_diff, l_aft, max_len: int):
        u, att_u, lang_f, state = self._prepare(l_bef, l_diff, l_aft)
        b = l_bef.size(0)
        word = torch.full((b,), START, dtype=torch.long, device=l_bef.device)
        out = torch.zeros(b, max_len, dtype=torch.long, device=l_bef.device)
        done = torch.zeros(b, dtype=torch.bool, device=l_bef.device)
        for t in range(max_len):
            lg, _, state = self._step(u, att_u, lang_f, self._word_proj(self.word_embed(word)), state)
            word = lg.argmax(1).masked_fill(done, 0)
            out[:, t] = word
            done |= word == END
            if done.all():
                break
        return out


def attention_use(alphas: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ū [3]: the dynamic attention's mean weights over the whole batch's words (``alphas`` [B, T, 3], ``mask``
    [B, T] the words with a target). Rows are gathered over the processes: every process computes the same ū."""
    totals = ddp.gather((alphas.float() * mask.unsqueeze(2)).sum(1))  # [B, 3] per caption
    return totals.sum(0) / ddp.gather(mask.sum(1)).sum().clamp(min=1)


def entropy(p: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return -(p * torch.log(p + 1e-12)).sum(dim)


def usage_entropy(alphas: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """H(ū), the ``usage_weight`` term (module docstring)."""
    return entropy(attention_use(alphas, mask))


class DUDA(CaptionModel):
    # Read by pipeline.engine: Adam as one fused pass (the per-tensor loop was ~15 % of a CPU step at layer4's
    # 2,050-d inputs, measured); same update rule.
    optimizer_options = {"fused": True}

    def __init__(self, vocab_size: int, feat_dim: int = 1024, att_hidden: int = 128, embed_dim: int = 300,
                 hidden: int = 512, dropout: float = 0.5, l1_weight: float = 2.5e-3, entropy_weight: float = 0.0,
                 pool: int | None = None, reduce: str = "sum", diff_prior: float = 0.0, usage_weight: float = 0.0,
                 own_difference: bool = False):
        super().__init__()
        d = feat_dim + 2
        self.usage_weight = usage_weight
        self.detector = ChangeDetector(d, att_hidden, dropout=dropout, pool=pool, reduce=reduce,
                                       own_difference=own_difference)
        self.speaker = DynamicSpeaker(d, vocab_size, embed_dim, hidden, dropout=dropout, diff_prior=diff_prior)
        self.l1_weight = l1_weight
        self.entropy_weight = entropy_weight

    def training_loss(self, batch):
        before = batch["before"]
        b = before.size(0)
        afters, labels = pair_groups(batch)
        # A pair and its distractor partner share the before image's projection and one speaker pass.
        outs = self.detector(before, afters)
        l_bef, l_aft, l_diff, att_bef, att_aft = (torch.cat(x) for x in zip(*outs))
        logits, alphas = self.speaker(l_bef, l_diff, l_aft, labels)
        ces = [sequence_ce(logits[s], labels[s, 1:]) for s in group_slices(b, len(afters))]
        l1 = (att_bef[:b].sum((1, 2, 3)) + att_aft[:b].sum((1, 2, 3))).mean()  # the pairs' maps, not the partners'
        if self.detector.reduce == "mean":  # per cell, as the features: the same L1/CE balance as summing
            l1 = l1 / att_bef[0, 0].numel()
        mask = (labels[:, 1:] > 0).float()
        word_entropy = ddp.mean_over((entropy(alphas) * mask).sum(), mask.sum())  # over the whole batch's tokens
        usage = usage_entropy(alphas, mask)
        loss = pair_mean(ces) + self.l1_weight * l1 - self.entropy_weight * word_entropy - self.usage_weight * usage
        # Which input the speaker reads (mean α over the changed pairs' words), logged: the entropy alone does not
        # say where the attention settled (on CLEVR-Change it ends on l_aft without usage_weight, docs/measurements.md).
        with torch.no_grad():
            used = attention_use(alphas[:b], mask[:b])
        reads = {f"alpha_{k}": v for k, v in zip(("bef", "diff", "aft"), used.tolist())}
        return loss, {**ce_parts(ces), "att_l1": l1.item(), "dyn_entropy": word_entropy.item(),
                      "usage_entropy": usage.item(), **reads}

    @torch.no_grad()
    def generate(self, before, after, max_len: int):
        l_bef, l_aft, l_diff, _, _ = self.detector(before, [after])[0]
        return self.speaker.greedy(l_bef, l_diff, l_aft, max_len)
