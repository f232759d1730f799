"""What every captioning method shares: the model interface and the masked sequence cross-entropy."""

from __future__ import annotations

import abc

import torch
import torch.nn as nn
import torch.nn.functional as F


class CaptionModel(nn.Module, abc.ABC):
    """Interface the training engine and the decoder rely on.

    ``training_loss(batch) -> (loss, {name: float})`` with the batch of ``pipeline.data.TrainBatches``:
    ``before``, ``sc`` (semantic after), ``nsc`` (distractor after) features ``[B, C, H, W]``,
    ``pos_labels`` / ``neg_labels`` ``[B, L]`` (``<START> .. <END>`` padded with 0), ``type`` ``[B]``
    (``pipeline.data.TYPE_IDS``), and the scalars ``step`` and ``epoch`` (for schedules inside a model).
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


def sequence_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the non-padding target tokens (padding id 0); ``<END>`` is a target."""
    mask = targets > 0
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
    return (ce * mask.reshape(-1)).sum() / mask.sum().clamp(min=1)
