"""Attention building blocks shared by the transformer methods (SCORER, DIRL and their ablations).

- ``MultiHeadAttention``: the standard multi-head attention (Vaswani et al.), q/k/v and output projections,
  dropout on the attention probabilities as in the official code. Computed by ``dropout.attention``:
  ``F.scaled_dot_product_attention`` (fused kernels on GPU, flash attention on CPU) except when training on a
  CPU, where the probabilities are materialised so that the cheap 16-bit dropout mask of
  ``pipeline.models.dropout`` replaces the slow ``bernoulli_`` one that SDPA would draw.
- ``GridEmbedding``: Eq. (1) of both papers: a 1×1 convolution of the CNN grid to ``dim`` channels plus a
  learned position embedding (row and column tables of ``dim/2`` each, concatenated and started xavier-uniform,
  as in the official code; ``nn.Embedding``'s N(0, 1) made position outweigh content). ``pool`` average-pools the
  grid first (e.g. 14×14 -> 7×7: 1/4 of the tokens, 1/16 of the attention and token-matching cost), a CPU-sized
  reduction that the table row states.
- ``cross_cell_scores``: additive attention scores that favour, between the two images of a pair, cell i of
  one and cell i of the other (a learned scalar; the single-stream models' optional ``cross_cell_bias``).
- ``CrossViewLayer``: one layer of cross-view attention between the two images of a pair: the before tokens
  attend to the after tokens and vice versa with the *same* layer (both official codes share it), followed
  by the residual connection and LayerNorm.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.models.dropout import Dropout, attention


def cross_cell_scores(bias: torch.Tensor, n: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Additive attention scores over [IMG1, n cells, IMG2, n cells]: ``bias`` between cell i of one image and
    cell i of the other, 0 elsewhere; -inf where the boolean ``keep`` [B, 1, 1, 2n + 2] forbids a key."""
    t = 2 * n + 2
    idx = torch.arange(n, device=bias.device)
    same = torch.zeros(t, t, device=bias.device)
    same[1 + idx, n + 2 + idx] = 1.0
    same[n + 2 + idx, 1 + idx] = 1.0
    scores = (bias * same)[None, None]
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


class MultiHeadAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.1, bias: bool = True):
        super().__init__()
        if dim % heads:
            raise ValueError(f"attention dim {dim} is not a multiple of {heads} heads")
        self.dim, self.heads, self.dropout = dim, heads, dropout
        self.in_proj = nn.Linear(dim, 3 * dim, bias=bias)  # q | k | v, as nn.MultiheadAttention
        self.out_proj = nn.Linear(dim, dim, bias=bias)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, D] -> [B, h, L, D/h]."""
        b, n, _ = x.shape
        return x.view(b, n, self.heads, -1).transpose(1, 2)

    def project_q(self, x):
        return self.split(F.linear(x, self.in_proj.weight[:self.dim], _part(self.in_proj.bias, 0, self.dim)))

    def project_kv(self, x):
        kv = F.linear(x, self.in_proj.weight[self.dim:], _part(self.in_proj.bias, self.dim, 3 * self.dim))
        k, v = kv.chunk(2, dim=-1)
        return self.split(k), self.split(v)

    def project_qkv(self, x):
        q, k, v = self.in_proj(x).chunk(3, dim=-1)
        return self.split(q), self.split(k), self.split(v)

    def attend(self, q, k, v, causal: bool = False, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Heads [B, h, L, d] in, merged and projected [B, L, D] out (``attn_mask``: ``dropout.attention``'s)."""
        p = self.dropout if self.training else 0.0
        a = attention(q, k, v, dropout_p=p, causal=causal, attn_mask=attn_mask)
        b, _, n, _ = a.shape
        return self.out_proj(a.transpose(1, 2).reshape(b, n, self.dim))

    def forward(self, x_q, x_kv=None, causal: bool = False, attn_mask: torch.Tensor | None = None):
        if x_kv is None:
            return self.attend(*self.project_qkv(x_q), causal=causal, attn_mask=attn_mask)
        return self.attend(self.project_q(x_q), *self.project_kv(x_kv), causal=causal, attn_mask=attn_mask)


def _part(bias, lo, hi):
    return None if bias is None else bias[lo:hi]


class GridEmbedding(nn.Module):
    """CNN grid [B, C, H, W] -> tokens [B, H*W, dim]: 1×1 conv (a per-location linear map) + learned positions."""

    def __init__(self, feat_dim: int, dim: int, grid: int = 14, pool: int | None = None):
        super().__init__()
        if dim % 2:
            raise ValueError(f"embedding dim {dim} must be even (row and column halves)")
        self.pool = pool
        self.grid = pool or grid
        self.proj = nn.Linear(feat_dim, dim)
        self.col_embed = nn.Embedding(self.grid, dim // 2)
        self.row_embed = nn.Embedding(self.grid, dim // 2)
        # Xavier-uniform, as the official code initialises its weight matrices: nn.Embedding's N(0, 1) made position
        # outweigh content (std 1.0 against ~0.7 for the projected grid), so attention and token matching paired
        # cells by place more than by what they show (measured on CLEVR-Change: docs/measurements.md).
        nn.init.xavier_uniform_(self.col_embed.weight)
        nn.init.xavier_uniform_(self.row_embed.weight)

    def positions(self, h: int, w: int) -> torch.Tensor:
        if h > self.grid or w > self.grid:
            raise ValueError(f"feature grid {h}x{w} exceeds the position tables ({self.grid}x{self.grid}); set model.grid")
        cols = self.col_embed.weight[:w].unsqueeze(0).expand(h, w, -1)
        rows = self.row_embed.weight[:h].unsqueeze(1).expand(h, w, -1)
        return torch.cat([cols, rows], -1).reshape(h * w, -1)  # [H*W, dim], row-major like .flatten(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool and x.shape[-2:] != (self.pool, self.pool):  # not when stored pooled (features.<b>.pool)
            x = F.adaptive_avg_pool2d(x, self.pool)
        _, _, h, w = x.shape
        return self.proj(x.flatten(2).transpose(1, 2)) + self.positions(h, w)


class CrossViewLayer(nn.Module):
    """``bef' = LN(bef + MHCA(bef, aft, aft))`` and ``aft' = LN(aft + MHCA(aft, bef, bef))`` with one layer.

    Both directions use the inputs of the layer (the official SCORER code keeps the previous ``bef`` for the
    second direction, DIRL updates both at once: the same computation). ``out_dropout`` is the dropout on the
    attention output before the residual (DIRL: 0.1; SCORER's official layer has none).
    """

    def __init__(self, dim: int, heads: int, dropout: float = 0.1, out_dropout: float = 0.0, norm: bool = True):
        super().__init__()
        self.attn = MultiHeadAttention(dim, heads, dropout)
        # A layer used only through ``shared`` (DIRL's last) has no residual and so no LayerNorm.
        self.norm = nn.LayerNorm(dim) if norm else None
        self.drop = Dropout(out_dropout)

    def shared(self, bef: torch.Tensor, aft: torch.Tensor):
        """The cross-attention outputs alone, MHCA(bef, aft, aft) and MHCA(aft, bef, bef) (DIRL Eq. 5),
        with the output dropout, before the residual and LayerNorm."""
        qb, kb, vb = self.attn.project_qkv(bef)
        qa, ka, va = self.attn.project_qkv(aft)
        return self.drop(self.attn.attend(qb, ka, va)), self.drop(self.attn.attend(qa, kb, vb))

    def forward(self, bef: torch.Tensor, aft: torch.Tensor, return_qk: bool = False):
        # Each image is projected once; its keys/values serve the other image's queries (no concatenation).
        qb, kb, vb = self.attn.project_qkv(bef)
        qa, ka, va = self.attn.project_qkv(aft)
        new_bef = self.norm(bef + self.drop(self.attn.attend(qb, ka, va)))
        new_aft = self.norm(aft + self.drop(self.attn.attend(qa, kb, vb)))
        # q and k per head [B, h, N, d] of both images, reused by SCORER's token-wise matching.
        return (new_bef, new_aft, (qb, kb), (qa, ka)) if return_qk else (new_bef, new_aft)
