"""The captioning transformer decoder shared by every transformer method (SCORER §3.3, DIRL §3.4).

Words: embedding (``word_dim``, 300 in both papers) plus sinusoidal positions, then a linear map to the model
width with dropout (both official codes). Each of ``layers`` post-norm layers: causal multi-head
self-attention (Eq. 8 of DIRL) → cross-attention to the difference representation (Eq. 9) → feed-forward
(Eq. 10), each with residual, dropout and LayerNorm; a linear vocabulary head (Eq. 11).
Dropout layers (and the attention's) are those of ``pipeline.models.dropout``: the same placement and rates
with cheaper random masks on a CPU.

Differences from the official decoders, following the papers' "standard transformer decoder [Vaswani]":
SCORER's official attention has no output projection and its feed-forward residual adds the FFN's own hidden
state; here both are the standard ones. The FFN width and activation are parameters (SCORER's official
code: 512, GELU; DIRL's: 2048, ReLU).

No key-padding mask is needed: padding only follows ``<END>``, so under the causal mask no real position
attends to it (padded positions are excluded from the loss and from the pooled features).

``forward`` returns, besides the logits, what the auxiliary losses read: the last layer's output (CBR's
sentence features), its self-attention sub-layer output (CCR's word features Ê[W]) and its cross-attention
output before the residual (CCR's attended difference features V̂). ``greedy`` decodes with a key/value
cache; the memory's keys and values are projected once.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn

from pipeline.models.attention import MultiHeadAttention
from pipeline.models.dropout import Dropout
from pipeline.text import END, START, UNK


def sinusoid_table(length: int, dim: int) -> torch.Tensor:
    pos = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(pos * div)
    table[:, 1::2] = torch.cos(pos * div[: dim // 2])
    return table


class DecoderOutput(NamedTuple):
    logits: torch.Tensor  # [B, L, V]
    hidden: torch.Tensor  # [B, L, D] last layer output
    words: torch.Tensor  # [B, L, D] last layer's self-attention sub-layer output
    attended: torch.Tensor  # [B, L, D] last layer's cross-attention output (before the residual)


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, ffn_dim: int, dropout: float, activation: str):
        super().__init__()
        self.self_attn = MultiHeadAttention(dim, heads, dropout)
        self.cross_attn = MultiHeadAttention(dim, heads, dropout)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), _ACTIVATIONS[activation](), Dropout(dropout),
                                 nn.Linear(ffn_dim, dim))
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.drop1, self.drop2, self.drop3 = Dropout(dropout), Dropout(dropout), Dropout(dropout)

    def forward(self, x, mem_kv):
        words = self.norm1(x + self.drop1(self.self_attn(x, causal=True)))
        attended = self.cross_attn.attend(self.cross_attn.project_q(words), *mem_kv)
        y = self.norm2(words + self.drop2(attended))
        return self.norm3(y + self.drop3(self.ffn(y))), words, attended

    def step(self, x, cache_k, cache_v, t, mem_kv):
        """One new position ``t`` (x [B, 1, D]) with the self-attention keys/values of 0..t-1 cached."""
        q, k, v = self.self_attn.project_qkv(x)
        cache_k[:, :, t:t + 1], cache_v[:, :, t:t + 1] = k, v
        x = self.norm1(x + self.self_attn.attend(q, cache_k[:, :, :t + 1], cache_v[:, :, :t + 1]))
        x = self.norm2(x + self.cross_attn.attend(self.cross_attn.project_q(x), *mem_kv))
        return self.norm3(x + self.ffn(x))


_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU}


class TransformerDecoder(nn.Module):
    def __init__(self, vocab_size: int, dim: int = 512, word_dim: int = 300, heads: int = 8, layers: int = 2,
                 ffn_dim: int = 2048, dropout: float = 0.1, activation: str = "relu", max_len: int = 64):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"decoder activation {activation!r}; expected one of {sorted(_ACTIVATIONS)}")
        self.embed = nn.Embedding(vocab_size, word_dim, padding_idx=0)
        self.register_buffer("pos_table", sinusoid_table(max_len, word_dim), persistent=False)
        self.embed_fc = nn.Sequential(nn.Linear(word_dim, dim), Dropout(dropout))
        self.layers = nn.ModuleList(DecoderLayer(dim, heads, ffn_dim, dropout, activation) for _ in range(layers))
        self.head = nn.Linear(dim, vocab_size)

    def _words(self, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
        n = tokens.size(1)
        if offset + n > self.pos_table.size(0):
            raise ValueError(f"caption length {offset + n} exceeds the decoder's max_len {self.pos_table.size(0)}")
        return self.embed_fc(self.embed(tokens) + self.pos_table[offset:offset + n])

    def memory_kv(self, memory: torch.Tensor):
        """Cross-attention keys/values of the difference representation, once per layer."""
        return [layer.cross_attn.project_kv(memory) for layer in self.layers]

    def forward(self, tokens: torch.Tensor, memory: torch.Tensor) -> DecoderOutput:
        """Teacher forcing: ``tokens`` [B, L] (starting with <START>) attend to ``memory`` [B, S, D]."""
        x = self._words(tokens)
        for layer, kv in zip(self.layers, self.memory_kv(memory)):
            x, words, attended = layer(x, kv)
        return DecoderOutput(self.head(x), x, words, attended)

    @torch.no_grad()
    def greedy(self, memory: torch.Tensor, max_len: int, suppress: tuple[int, ...] = (UNK,)) -> torch.Tensor:
        """Greedy decoding [B, max_len]: 0 after <END>; ``<UNK>`` is never emitted (as in the official code)."""
        b = memory.size(0)
        mem_kv = self.memory_kv(memory)
        heads = self.layers[0].self_attn.heads
        dim = self.head.in_features
        caches = [(memory.new_empty(b, heads, max_len, dim // heads), memory.new_empty(b, heads, max_len, dim // heads))
                  for _ in self.layers]
        word = torch.full((b, 1), START, dtype=torch.long, device=memory.device)
        out = torch.zeros(b, max_len, dtype=torch.long, device=memory.device)
        done = torch.zeros(b, dtype=torch.bool, device=memory.device)
        for t in range(max_len):
            x = self._words(word, offset=t)
            for layer, (ck, cv), kv in zip(self.layers, caches, mem_kv):
                x = layer.step(x, ck, cv, t, kv)
            logits = self.head(x[:, 0]).float()
            logits[:, list(suppress)] = -math.inf
            word = logits.argmax(-1).masked_fill(done, 0)
            out[:, t] = word
            done |= word == END
            if done.all():
                break
            word = word.unsqueeze(1)
        return out


def masked_mean(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` [B, L, D] over the non-padding positions of ``tokens`` [B, L] (the papers' mean pooling
    over the caption's words; the official codes average over the padded length)."""
    mask = (tokens > 0).to(x.dtype).unsqueeze(-1)
    return (x * mask).sum(1) / mask.sum(1).clamp(min=1)
