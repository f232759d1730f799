"""TIRG composed-query image retrieval (Vo et al., CVPR 2019): the auxiliary network of Hosseinzadeh & Wang
(CVPR 2021) §3-4.

Parts, named as in the aux paper:
- image encoder g(I; θ_G): here a small trainable conv head on the primary's frozen ResNet-101 layer3 maps
  (TIRG trains a ResNet-18 on pixels, then global average pooling and a linear layer). Two coordinate
  channels in [-1, 1] are added first (as DUDA does) so that pooling does not erase *where* things are: a
  moved object must change g(B);
- text encoder: word embedding W_emb (the matrix of Eq. 4) → LSTM → output at the last word → dropout →
  linear (TIRG's text model). It reads embedding *rows*, so it takes hard tokens (E_C = W_emb[C]) and soft
  word distributions (E = P·W_emb, Eq. 4) alike;
- composition k(A, E_C; θ_K): TIRG's gated residual, f = a₀·σ(gate([φ_A; φ_T]))⊙φ_A + a₁·res([φ_A; φ_T]),
  gate = Linear(ReLU(BN(·))), res = Linear(ReLU(Linear(ReLU(BN(·))))), a learnable, initialised (1, 10);
- the shared space: L2 normalisation times one learnable scale (initialised 4.0), applied to composed
  queries and candidate images alike, so ⟨·,·⟩ of Eq. 6 and Eq. 9 is a scaled cosine.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.models.dropout import Dropout
from pipeline.models.duda import coordinates


class ImageEncoder(nn.Module):
    """g: [B, C, H, W] feature maps → [B, d] (before normalisation)."""

    def __init__(self, feat_dim: int, hidden: int = 256, embed_dim: int = 512):
        super().__init__()
        self.feat_dim = feat_dim
        self.conv1 = nn.Conv2d(feat_dim + 2, hidden, 1)  # features + (y, x) coordinates
        self.conv2 = nn.Conv2d(hidden, hidden, 3, stride=2, padding=1)
        self.fc = nn.Linear(hidden, embed_dim)

    def forward(self, maps: torch.Tensor) -> torch.Tensor:
        b, c, h, w = maps.shape
        if c != self.feat_dim:
            raise ValueError(f"image encoder expects {self.feat_dim} channels, got {c}")
        # Coordinates enter linearly: W·[X; xy] = W_x·X + W_xy·xy, without copying the maps.
        w1 = self.conv1.weight
        x = F.conv2d(maps, w1[:, :c], self.conv1.bias)
        x = x + (w1[:, c:, 0, 0] @ coordinates(h, w, maps)).view(1, -1, h, w)
        x = F.relu(self.conv2(F.relu(x)))
        return self.fc(x.mean((2, 3)))


class TextEncoder(nn.Module):
    """Word embedding W_emb → LSTM → output at the last word → dropout → linear."""

    def __init__(self, vocab_size: int, word_dim: int = 512, hidden: int = 512, embed_dim: int = 512,
                 dropout: float = 0.1):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, word_dim)
        self.lstm = nn.LSTM(word_dim, hidden, batch_first=True)
        self.out = nn.Sequential(Dropout(dropout), nn.Linear(hidden, embed_dim))

    @property
    def w_emb(self) -> torch.Tensor:
        return self.embedding.weight

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """E_C = W_emb[C]: [B, T] ids → [B, T, d_e]."""
        return self.embedding(tokens)

    def soft_embed(self, probs: torch.Tensor) -> torch.Tensor:
        """Eq. 4: E = P × W_emb, [B, T, |V|] → [B, T, d_e]; differentiable in P."""
        return probs @ self.w_emb.to(probs.dtype)

    def forward(self, emb: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, T, d_e] embeddings, [B] lengths ≥ 1 → [B, d]. The LSTM is causal, so the output at position
        ``length-1`` ignores whatever follows (padding, words after <END>): no packing needed."""
        out, _ = self.lstm(emb)
        last = out[torch.arange(out.size(0), device=out.device), (lengths - 1).clamp(min=0)]
        return self.out(last)


class GatedResidualComposition(nn.Module):
    """TIRG's k(A, E): keep the image feature where the gate says so, add a text-driven residual."""

    def __init__(self, dim: int):
        super().__init__()
        self.gate = nn.Sequential(nn.BatchNorm1d(2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))
        self.res = nn.Sequential(nn.BatchNorm1d(2 * dim), nn.ReLU(), nn.Linear(2 * dim, 2 * dim), nn.ReLU(),
                                 nn.Linear(2 * dim, dim))
        self.a = nn.Parameter(torch.tensor([1.0, 10.0]))

    def forward(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        x = torch.cat([img, txt], 1)
        return self.a[0] * torch.sigmoid(self.gate(x)) * img + self.a[1] * self.res(x)


class Normalization(nn.Module):
    """L2 normalisation times a learnable scale: the shared retrieval space."""

    def __init__(self, scale: float = 4.0):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(float(scale)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * F.normalize(x.to(torch.promote_types(x.dtype, torch.float32)), dim=-1)


class TIRG(nn.Module):
    """The auxiliary network θ_A = {θ_G, θ_K} (image encoder; text encoder + composition)."""

    def __init__(self, vocab_size: int, feat_dim: int, embed_dim: int = 512, word_dim: int = 512,
                 img_hidden: int = 256, text_dropout: float = 0.1, norm_scale: float = 4.0):
        super().__init__()
        self.image = ImageEncoder(feat_dim, img_hidden, embed_dim)
        self.text = TextEncoder(vocab_size, word_dim, embed_dim, embed_dim, text_dropout)
        self.compose_fn = GatedResidualComposition(embed_dim)
        self.norm = Normalization(norm_scale)

    def encode_images(self, maps: torch.Tensor) -> torch.Tensor:
        """φ = g(I) before normalisation (the composition reads the query image's φ_A)."""
        return self.image(maps)

    def candidates(self, phi: torch.Tensor) -> torch.Tensor:
        """Ĩ = normalised g(I) (Eq. 8)."""
        return self.norm(phi)

    def compose(self, phi_a: torch.Tensor, emb: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """R = normalised k(A, E) (Eq. 7) from φ_A and word embeddings E (hard or soft)."""
        return self.norm(self.compose_fn(phi_a, self.text(emb, lengths)))
