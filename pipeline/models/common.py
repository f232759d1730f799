"""What every captioning method shares: the model interface and the masked sequence cross-entropy."""

from __future__ import annotations

import abc

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline import distributed as ddp


class CaptionModel(nn.Module, abc.ABC):
    """Interface the training engine and the decoder rely on.

    ``training_loss(batch) -> (loss, {name: float})`` with the batch of ``pipeline.data.TrainBatches``
    (``docs/contracts.md``): ``before`` and ``after`` features ``[B, C, H, W]``, ``labels`` ``[B, L]``
    (``<START> .. <END>`` padded with 0), ``type`` ``[B]`` (``TrainBatches.type_ids``), ``changed`` ``[B]``
    bool, the scalars ``step`` and ``epoch`` (for schedules inside a model), and, only when the split pairs
    each changed pair with a distractor (partner mode), ``distractor`` ``[B, C, H, W]`` and
    ``distractor_labels`` ``[B, L]``. ``has_partners``, ``pair_groups`` and ``pair_mean`` serve both shapes.
    ``generate(before, after, max_len) -> [B, max_len]`` greedy token ids (0 after ``<END>``).
    """

    @abc.abstractmethod
    def training_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """The method's full training objective on one batch."""

    def init_from(self, state: dict) -> list[str]:
        """Initialise from a previous stage's weights (pre-training, adaptation): copy every tensor whose
        name and shape match; return the names copied. A model with its own mapping overrides this."""
        own = self.state_dict()
        hits = [k for k, v in state.items() if k in own and own[k].shape == v.shape]
        if not hits:
            raise ValueError("no parameter of the initial checkpoint matches this model")
        self.load_state_dict({**own, **{k: state[k] for k in hits}})
        return hits

    @abc.abstractmethod
    def generate(self, before: torch.Tensor, after: torch.Tensor, max_len: int) -> torch.Tensor:
        """Greedy decoding."""


def autocast_cast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the autocast dtype where autocast is on (else as is). Autocast casts a tensor that is not a
    parameter anew for every product it enters; a tensor used many times (a grid, a per-sequence weight slice) is
    cast once with this instead."""
    dev = t.device.type
    return t.to(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else t


def sequence_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the non-padding target tokens (padding id 0); ``<END>`` is a target. With several
    processes, over the tokens of the whole batch (``pipeline.distributed``)."""
    mask = targets > 0
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
    return ddp.mean_over((ce * mask.reshape(-1)).sum(), mask.sum(), floor=1)


def has_partners(batch: dict) -> bool:
    """Whether the batch pairs each changed pair with its distractor partner (``distractor``,
    ``distractor_labels``: partner mode, ``pipeline.data``); otherwise it holds plain pairs."""
    return "distractor" in batch


def pair_groups(batch: dict) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The batch's after images and captions by group: the pairs, then (partner mode) their distractor
    partners. Returns ([after] or [after, distractor], labels [B or 2B, L] int64 in the same order)."""
    if has_partners(batch):
        return [batch["after"], batch["distractor"]], torch.cat([batch["labels"], batch["distractor_labels"]]).long()
    return [batch["after"]], batch["labels"].long()


def group_slices(b: int, n_groups: int) -> list[slice]:
    """Row slices of ``n_groups`` groups of ``b`` rows stacked as ``pair_groups`` stacks them."""
    return [slice(i * b, (i + 1) * b) for i in range(n_groups)]


def pair_mean(values: list):
    """A term over the pairs' groups: itself for plain pairs, 0.5·pairs + 0.5·distractor partners (the weighting
    of the CLEVR-Change objectives, which average the changed and the distractor pair)."""
    return values[0] if len(values) == 1 else 0.5 * values[0] + 0.5 * values[1]


def ce_parts(ces: list[torch.Tensor]) -> dict:
    """The logged captioning cross-entropies: ``ce`` (plain pairs), or ``ce_pos`` and ``ce_neg`` (pairs, partners)."""
    return {"ce": ces[0].item()} if len(ces) == 1 else {"ce_pos": ces[0].item(), "ce_neg": ces[1].item()}
