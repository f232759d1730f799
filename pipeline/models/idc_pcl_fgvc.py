"""IDC-PCL's FGVC expansion objectives (appendix A.3, Figure 6): NABirds image pairs refine the image
difference encoder.

- single-image encoder: a fine-grained classification loss (cross-entropy of a linear classifier on each
  image's [IMG] output) and a contrastive loss over the batch's images, "which pulls the image representations
  of the same label in a batch closer and pushes image representations of different labels farther apart"
  (He et al. 2021, TransFG): mean over all ordered pairs (i, j) of 1 - cos(z_i, z_j) for the same label and
  max(cos(z_i, z_j) - margin, 0) for different labels (TransFG's margin 0.4);
- pair-image encoder: a matching loss, cross-entropy of a linear classifier on [IMG1; IMG2] of the pair
  encoder's output, same class (1) or not (0).
The three are summed unweighted (the paper gives no weights).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class FGVCHeads(nn.Module):
    """The two classifiers FGVC pre-training adds (dropped at fine-tuning: ``init_from`` copies by name)."""

    def __init__(self, d: int, n_classes: int):
        super().__init__()
        self.classify = nn.Linear(d, n_classes)
        self.match = nn.Linear(2 * d, 2)


def label_contrastive(z: torch.Tensor, labels: torch.Tensor, margin: float) -> torch.Tensor:
    """TransFG's contrastive loss over a batch of representations ``z`` [N, d] with class ``labels`` [N]."""
    zn = F.normalize(z.float(), dim=-1)
    sim = zn @ zn.t()
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    return torch.where(same, 1.0 - sim, (sim - margin).clamp_min(0.0)).mean()


def fgvc_loss(model, heads: FGVCHeads, batch: dict, margin: float) -> tuple[torch.Tensor, dict]:
    """Classification + contrastive on both images' single-encoder [IMG] outputs, matching on the pair's."""
    s1 = model.single_image(batch["img1"], 0)
    s2 = model.single_image(batch["img2"], 1)
    z = torch.cat([s1[:, 0], s2[:, 0]])
    y = torch.cat([batch["label1"], batch["label2"]]).long()
    logits = heads.classify(z).float()
    cls = F.cross_entropy(logits, y)
    con = label_contrastive(z, y, margin)
    v = model.pair_images(s1, s2)
    m_logits = heads.match(torch.cat([v[:, 0], v[:, v.size(1) // 2]], 1)).float()
    same = batch["same"].long()
    match = F.cross_entropy(m_logits, same)
    return cls + con + match, {
        "fgvc_cls": cls.item(), "fgvc_con": con.item(), "fgvc_match": match.item(),
        "fgvc_acc": (logits.argmax(1) == y).float().mean().item(),
        "fgvc_match_acc": (m_logits.argmax(1) == same).float().mean().item()}
