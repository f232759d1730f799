"""Attention maps of a trained captioner for a batch of pairs, read from the model without changing it (report).

Two kinds, by model family (``pipeline.models.attention_kind``):

- ``dual`` (DUDA): the change detector's spatial attention on the before and on the after image,
  ``model.detector(before, [after])`` (the maps its speaker pools the features with), [B, H, W] each.
- ``token`` (SCORER and DIRL families, transformer decoders): the last decoder layer's cross-attention over
  the difference tokens (the CNN grid, pooled where the model pools it), averaged over heads and over the words
  of the model's own greedy caption (up to and including ``<END>``): where the decoder looked while it wrote
  the caption, [B, h, w]. It is recomputed from a teacher-forced pass over that caption, whose last layer gives
  the queries (``DecoderOutput.words``) the decoder's greedy step uses.

Other methods have no map here (``attention_kind`` is None): CLIP4IDC and IDC-PCL attend over joint token
sequences without a single map per pair, and DUDA trained with the auxiliary task wraps DUDA in another model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pipeline.models import attention_kind
from pipeline.text import START


def _memory(model, before, after):
    memory = model.encode(model.embed(before), model.embed(after))
    return memory[0] if isinstance(memory, tuple) else memory  # SCORER returns (memory, per-head q/k or None)


def decoder_cross_attention(decoder, inputs: torch.Tensor, memory: torch.Tensor):
    """Teacher-forced pass of ``inputs`` [B, L] over ``memory`` [B, S, D]: the last layer's cross-attention
    probabilities per head [B, heads, L, S] (what its ``attend`` weighs the memory's values with) and the
    decoder's output."""
    out = decoder(inputs, memory)
    last = decoder.layers[-1].cross_attn
    q = last.project_q(out.words)  # [B, heads, L, d]: the queries of the last layer's cross-attention
    k, _ = last.project_kv(memory)  # [B, heads, S, d]
    return F.softmax(q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.size(-1)), dim=-1), out


def token_attention(model, before: torch.Tensor, after: torch.Tensor, caption: torch.Tensor) -> torch.Tensor:
    """[B, h, w] cross-attention of the last decoder layer over the difference tokens, for ``caption``
    [B, L] (the word ids ``generate`` returned, 0 after ``<END>``)."""
    memory = _memory(model, before, after)
    b = caption.size(0)
    inputs = torch.cat([caption.new_full((b, 1), START), caption[:, :-1]], 1)  # the word fed to predict each word
    p = decoder_cross_attention(model.decoder, inputs, memory)[0].mean(1)  # [B, L, S], heads averaged
    written = (caption != 0).float()  # the words up to <END>; a caption that never ends uses all L steps
    mean = (p * written.unsqueeze(-1)).sum(1) / written.sum(1, keepdim=True).clamp(min=1)
    side = math.isqrt(mean.size(1))
    if side * side != mean.size(1):
        raise ValueError(f"{mean.size(1)} difference tokens do not form a square grid")
    return mean.view(b, side, side)


@torch.no_grad()
def attention_maps(method: str, model, before: torch.Tensor, after: torch.Tensor, max_len: int) -> dict:
    """The model's caption ids and its maps for a batch: ``{"caption": [B, L], "before"/"after": [B, H, W]}``
    (dual) or ``{"caption", "tokens": [B, h, w]}`` (token); ``{"caption"}`` alone for other methods."""
    model.eval()
    caption = model.generate(before, after, max_len)
    kind = attention_kind(method)
    if kind == "dual":
        att_bef, att_aft = model.detector(before, [after])[0][3:]
        return {"caption": caption, "before": att_bef[:, 0].float(), "after": att_aft[:, 0].float()}
    if kind == "token":
        return {"caption": caption, "tokens": token_attention(model, before, after, caption)}
    return {"caption": caption}
