"""DUDA computed the way the official code does, for equivalence tests and benchmarks only.

Coordinates concatenated to the features, the 1×1 conv over [X; X_diff] run for every image of every
pair, the changed and distractor pairs in separate passes, and plain ``nn.LSTMCell`` calls fed the
concatenated inputs at every step. Uses the parameters of a ``pipeline.models.duda.DUDA`` instance, so
both formulations can be compared number for number and timed side by side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.models.common import pair_mean, sequence_ce


def detector(det, bef, aft):
    b, _, h, w = bef.shape
    ys = torch.linspace(-1, 1, h).view(1, 1, h, 1).expand(b, 1, h, w)
    xs = torch.linspace(-1, 1, w).view(1, 1, 1, w).expand(b, 1, h, w)
    bef, aft = torch.cat([bef, ys, xs], 1), torch.cat([aft, ys, xs], 1)
    diff = aft - bef

    def att(x):
        e = det.embed_rest(F.conv2d(torch.cat([x, diff], 1), det.embed_conv.weight, det.embed_conv.bias))
        return torch.sigmoid(det.att(e))

    a_b, a_a = att(bef), att(aft)
    l_b, l_a = (a_b * bef).sum((2, 3)), (a_a * aft).sum((2, 3))
    return l_b, l_a, l_a - l_b, a_b, a_a


def speaker(sp, l_bef, l_diff, l_aft, labels):
    feats = torch.stack([l_bef, l_diff, l_aft], 1)
    u = sp.embed_feats(feats.flatten(1))
    z = u.new_zeros(u.size(0), sp.hidden)
    (h_a, c_a), (h_l, c_l) = (z, z), (z, z)
    logits, alphas = [], []
    for t in range(labels.size(1) - 1):
        h_a, c_a = sp.att_lstm(torch.cat([u, h_l], 1), (h_a, c_a))
        alpha = torch.softmax(sp.dyn_att(torch.cat([u, h_a], 1)), 1)
        l_dyn = (alpha.unsqueeze(2) * feats).sum(1)
        h_l, c_l = sp.lang_lstm(torch.cat([sp.word_embed(labels[:, t]), l_dyn], 1), (h_l, c_l))
        logits.append(sp.logit(sp.drop(h_l)))
        alphas.append(alpha)
    return torch.stack(logits, 1), torch.stack(alphas, 1)


def training_loss(model, batch):
    """The official objective: 0.5·CE(changed) + 0.5·CE(distractor) + λ·L1(maps of the changed pair); on plain
    pairs CE(pair) + λ·L1(maps of the pair)."""
    losses = []
    groups = [(batch["after"], batch["labels"])]
    if "distractor" in batch:
        groups.append((batch["distractor"], batch["distractor_labels"]))
    for aft, labels in groups:
        l_b, l_a, l_d, a_b, a_a = detector(model.detector, batch["before"], aft)
        logits, _ = speaker(model.speaker, l_b, l_d, l_a, labels)
        losses.append(sequence_ce(logits, labels[:, 1:]))
        if aft is batch["after"]:
            l1 = (a_b.sum((1, 2, 3)) + a_a.sum((1, 2, 3))).mean()
    return pair_mean(losses) + model.l1_weight * l1
