"""IDC-PCL (Yao et al., AAAI 2022): a single-stream transformer pre-trained for image difference captioning.

Input (§2.1): the 49 grid features of each image (ResNet-101 ``layer4``, 2048×7×7, flattened) projected to
the hidden size (linear layer; the official code follows it with a sigmoid, kept here), each image led by its
special token [IMG1] / [IMG2]; the caption led by [CLS]. Every token gets a fixed sinusoidal position within
its own modality and a learned type embedding (img1 / img2 / text), then LayerNorm and dropout.
``img_positions="learned"`` gives the image cells the official code's learned 2-D positions instead (a row plus
a column embedding, BERT init std 0.02; the paper's text says fixed sinusoids). ``feature_norm="standardize"``
(a deviation) centres and scales each feature channel by its mean and std over the training images
(:meth:`IDCPCL.fit_input_stats`, run by the training stages; the statistics travel in the checkpoint). Why, for
the random-backbone embedded default (measured): the channels share a large mean, so after the sigmoid and
LayerNorm an image's content is ~10 % of its tokens against unit-amplitude sinusoids, the encoders add
image-independent vectors (the content falls to 0.4 % of the tokens the caption reads), and the captioner
ignores the images (its loss is the same with the pairs shuffled); standardised and with learned positions the
content is 80 % at the input and 37 % where the caption reads it.

``cross_cell_bias`` (a deviation when non-zero; 0 builds the official model) adds one learned scalar, started at
the configured value, to the pair encoder's attention score between cell i of one image and cell i of the other
(a relative-position bias across the two images; no subtraction). Why, measured on the embedded default (issue
12): over [before; after] tokens of the random backbone a small transformer classifying changed against
distractor pairs stays at chance (train and test 0.50 over 1,200 steps at batch 32), and with the bias started
at 4 it reaches train 0.93 / test 0.85 in the same steps: the single stream does not find the other image's
counterpart cell by itself at this data scale. IDC-PCL fine-tuned with the bias leaves the constant caption
(``config/config.yaml``, ``methods.idc_pcl``). The bias sits where the two images first meet: with
``difference_encoder=False`` (Table 4 line 5) there is no pair encoder, and it goes to the cross-modal stack,
between image cells only (caption tokens get no such term).

Image difference encoder: a single-image encoder (shared by both images) then a pair-image encoder over
[IMG1, img1, IMG2, img2]; cross-modal transformer over [visual tokens, CLS, caption]. Hidden 512, 8 heads,
FFN 2048, dropout 0.2, 1 + 1 + 3 layers (appendix Table 6). Where the paper is silent the official code is
followed: pre-LN layers behind one input LayerNorm per stack, ReLU feed-forward, dropout on the embeddings,
the attention probabilities, the FFN's hidden layer and both residual branches, a linear output layer.
``difference_encoder=False`` feeds the embedded image tokens straight to the cross-modal transformer
(Table 4, line 5).

Cost (exact, same numbers): captions are cut to the batch's longest one; the last cross-modal layer computes
only the positions a loss reads (masked words, masked cells, [IMG1]/[IMG2]/[CLS]; all positions still serve
as its keys and values); on a CPU dropout masks come from 16 random bits per element instead of a 64-bit
draw (``pipeline.models.dropout``), fused with the ReLU of the feed-forward layer.

Pre-training (§2.2; bidirectional attention, caption padding masked), one task per batch:
- MLM: 15 % of the caption's tokens (words and the end token, at least one), 80 % → [MASK], 10 % → a random
  word, 10 % kept; cross-entropy on them (the linear output layer, shared with fine-tuning).
- MVCL: 15 % of *one* image's grid cells (at least one; the image chosen per sample) are zeroed before the
  projection; the outputs at those cells are mapped back to feature space (tied to the projection) and
  scored by an NCE (eq. 8): cosine / τ against the cell's original feature (positive) and the original
  features of the unmasked cells of the masked images of the batch (negatives). The official code uses the
  *predicted* features at unmasked cells as negatives; the paper's "unmasked image features" is followed.
  Many such negatives are near-duplicates of the positive (background cells), and τ = 1 bounds the logits
  to [-1, 1]: a weak but unbiased signal, kept as the paper defines it.
- FDA: the global visual representation mean([IMG1], [IMG2]) and the textual one [CLS] from the output of
  the same (pair, caption) pass, cosine / τ for the positive caption and each constructed negative
  (``pipeline.negatives``), cross-entropy with the positive as target (eq. 9). Each caption is scored against
  the visual vector of its own pass, as the official formulation: with bidirectional attention the positive
  pass's visual vector has read the positive caption, so scoring every candidate against it would let text
  match text without the images. The image difference encoder runs once per pair (as the official code),
  its output repeated for the pair's 1 + K captions.

Cross-task expansion (§2.4, appendix A.3; batches from ``pipeline.cross_task``): a GIC batch (CUB) carries
``img2_empty``: its second image is the empty image, whose cells no query attends to (single-image, pair and
cross-modal encoders; its [IMG2] token stays, so FDA's mean([IMG1], [IMG2]) is defined) and MVCL masks the real
image only; its loss parts are logged as ``gic_*``. An FGVC batch (task ``fgvc``, NABirds pairs) trains the image
difference encoder with ``pipeline.models.idc_pcl_fgvc`` (heads built when ``fgvc_classes`` > 0, dropped at
fine-tuning).

Fine-tuning (§2.3, §3.1): UniLM-style sequence-to-sequence mask: visual tokens attend to visual tokens,
caption tokens to all visual tokens and causally to the caption. ``ft_targets="masked"`` (the default, the
official Oscar-style recipe): caption tokens are masked as in MLM (``ft_mask_prob`` 15 %) and predicted under
that mask, so a caption of ~6 tokens supervises ~1 word per pass. ``ft_targets="every"`` (a deviation, used
by the CPU-sized embedded default): the true caption plus one [MASK] query per word at that word's position,
each query seeing the visual tokens, the true words before it and itself: every word is a target, under
exactly the input inference gives it. The paper says only that the MLM task is "adapted" with the
uni-directional mask and that inference predicts at a [MASK] after the words so far; both modes are that.
The distractor-judging classifier on [IMG1; IMG2] (changed = 1, distractor = 0) is added unweighted
(``distractor_judging=False``: Table 4, line 6). On CLEVR-Change each batch holds a changed and a distractor
pair per index (partner mode, ``pipeline.data``); the before image is encoded once for both. On plain pairs
(a dataset without distractor partners) the pairs are captioned alike and the judge classifies each pair as
changed or ``no_change`` (the batch's ``changed``, CLEVR-DC's distractors), on the batches that hold both kinds:
a batch of changed pairs only (Spot-the-Diff, Image Editing Request) has nothing to judge, the term is skipped.
Inference: [CLS] [BOS] w1 … w_{t-1} [MASK], the word predicted at [MASK] is taken (greedy). Visual states and
the caption tokens' keys/values are cached: caption tokens only ever attend backwards, so each step runs
only the newest word and the [MASK] through the cross-modal layers, with the same result as re-running all.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline import distributed as ddp
from pipeline.models.attention import cross_cell_scores
from pipeline.models.common import CaptionModel, has_partners, pair_groups
from pipeline.models.dropout import attention as shared_attention
from pipeline.models.dropout import dropout as shared_dropout
from pipeline.models.dropout import keep_mask, zero_dropped
from pipeline.text import END, START

TASKS = ("mlm", "mvcl", "fda", "fgvc")  # fgvc: the cross-task expansion (pipeline.models.idc_pcl_fgvc)
FIRST_WORD = 4  # ids below are <NULL> <UNK> <START> <END>
MAX_GRID = 32  # learned image positions: rows and columns of the feature grid


def sinusoid(n: int, d: int) -> torch.Tensor:
    """The fixed positional embeddings of Vaswani et al. (2017): [n, d]."""
    pos = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    pe = torch.zeros(n, d)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe


class _ReluDropout(torch.autograd.Function):
    """y = relu(x) · mask · s in three in-place passes; the backward pass needs only y (y > 0 ⇔ kept and x > 0),
    which the next linear layer keeps anyway.

    Both passes multiply by 0/1 factors of a cheap kind (measured on a CPU, [32, 120, 512] bf16, one thread):
    the mask's uint8 view (1.1 ms against 3.0 for the bool mask) and sign(y), which is 1 where y > 0 and ±0
    elsewhere since y ≥ 0 (1.5 ms against 5.4 for ``g · (y > 0)``). The values are the same; only the sign of
    some zeros may differ, which no later sum, product or Adam step tells apart."""

    @staticmethod
    def forward(ctx, x, mask, scale: float):
        y = zero_dropped(x, mask).clamp_min_(0.0).mul_(scale)
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return (g * y.sign()).mul_(ctx.scale), None, None


def dropout(x: torch.Tensor, p: float, training: bool, relu: bool = False) -> torch.Tensor:
    """Dropout (inverted scaling, the cheap CPU masks of ``pipeline.models.dropout``); ``relu=True`` applies
    ReLU first, fused with the mask on a CPU."""
    if not relu:
        return shared_dropout(x, p, training)
    if not training or p == 0.0:
        return F.relu(x)
    if x.is_cuda:  # the GPU's fused dropout is cheap
        return F.dropout(F.relu(x), p, True)
    return _ReluDropout.apply(x, keep_mask(x.shape, p, device=x.device), 1.0 / (1.0 - p))


def attention(q, k, v, mask, p: float, training: bool) -> torch.Tensor:
    """Multi-head attention with dropout on the attention probabilities (``mask``: True = may attend)."""
    return shared_attention(q, k, v, p if training else 0.0, attn_mask=mask)


class Block(nn.Module):
    """Pre-LN transformer layer, as the official code: x + drop(attn(LN x)), x + drop(W2 drop(relu(W1 LN x))).

    ``past`` holds keys/values of earlier tokens (the decoding cache). ``rows`` [B, M] restricts the output
    to those positions of each sequence (all positions still serve as keys and values): the last layer of a
    stack only needs the positions a loss reads. Returns (output, (k, v) of ``x``).
    """

    def __init__(self, d: int, heads: int, ff: int, dropout: float):
        super().__init__()
        self.heads, self.p = heads, dropout
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.ff1 = nn.Linear(d, ff)
        self.ff2 = nn.Linear(ff, d)

    def forward(self, x, mask=None, past=None, rows=None):
        b, t, d = x.shape
        dh = d // self.heads
        h = self.ln1(x)
        if rows is None:
            q, k, v = self.qkv(h).view(b, t, 3, self.heads, dh).permute(2, 0, 3, 1, 4)
        else:
            w, bias = self.qkv.weight, self.qkv.bias
            k, v = F.linear(h, w[d:], bias[d:]).view(b, t, 2, self.heads, dh).permute(2, 0, 3, 1, 4)
            idx = rows.unsqueeze(-1).expand(-1, -1, d)
            x = x.gather(1, idx)
            q = F.linear(h.gather(1, idx), w[:d], bias[:d]).view(b, -1, self.heads, dh).transpose(1, 2)
            if mask is not None and mask.dim() >= 2 and mask.size(-2) == t:  # per-query mask rows
                m = mask.reshape(-1, t, mask.size(-1)).expand(b, t, mask.size(-1))
                mask = m.gather(1, rows.unsqueeze(-1).expand(-1, -1, m.size(-1))).unsqueeze(1)
        kk, vv = (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)) if past is not None else (k, v)
        a = attention(q, kk, vv, mask, self.p, self.training).transpose(1, 2).reshape(b, x.size(1), d)
        x = x + dropout(self.out(a), self.p, self.training)
        h = dropout(self.ff1(self.ln2(x)), self.p, self.training, relu=True)
        return x + dropout(self.ff2(h), self.p, self.training), (k, v)


class Stack(nn.Module):
    """Transformer layers behind one input LayerNorm (the official ``Transformer``); ``rows``: see ``Block``
    (applied to the last layer)."""

    def __init__(self, n: int, d: int, heads: int, ff: int, p: float):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.layers = nn.ModuleList(Block(d, heads, ff, p) for _ in range(n))

    def forward(self, x, mask=None, rows=None):
        x = self.norm(x)
        for i, blk in enumerate(self.layers):
            x = blk(x, mask, rows=rows if i == len(self.layers) - 1 else None)[0]
        return x


def needed_rows(need: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] bool → (rows [B, M], valid [B, M]): each row's needed positions in increasing order, padded with
    unneeded ones up to the largest count M; ``out[valid]`` lists them in the order of ``x[need]``."""
    m = max(int(need.sum(1).max()), 1)
    rows = torch.argsort((~need).to(torch.int8), dim=1, stable=True)[:, :m]
    valid = torch.arange(m, device=need.device) < need.sum(1, keepdim=True)
    return rows, valid


def mask_tokens(labels: torch.Tensor, prob: float, vocab_size: int, mask_id: int, groups: int = 1):
    """BERT masking of caption tokens (words and <END>; never <START> or padding), at least one per caption.

    Returns (inputs, targets, masked): targets are the original ids at masked positions and -100 elsewhere.
    The draws are the whole batch's (``pipeline.distributed.draw``; ``groups``: stacked blocks of the batch).
    """
    dev = labels.device
    rand = lambda s: torch.rand(s, device=dev)  # noqa: E731
    cand = (labels > 0) & (labels != START)
    masked = (ddp.draw(rand, labels.shape, groups) < prob) & cand
    none = ~masked.any(1) & cand.any(1)
    if ddp.any(none):  # pick one candidate uniformly in captions where the draw masked nothing
        score = ddp.draw(rand, labels.shape, groups).masked_fill(~cand, -1.0)
        one = F.one_hot(score.argmax(1), labels.size(1)).bool()
        masked |= one & none.unsqueeze(1)
    u = ddp.draw(rand, labels.shape, groups)
    rand_words = ddp.draw(lambda s: torch.randint(FIRST_WORD, vocab_size, s, device=dev), labels.shape, groups)
    inputs = torch.where(masked & (u < 0.8), torch.full_like(labels, mask_id), labels)
    inputs = torch.where(masked & (u >= 0.8) & (u < 0.9), rand_words, inputs)
    targets = labels.masked_fill(~masked, -100)
    return inputs, targets, masked


def mask_cells(b: int, n: int, prob: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """MVCL masking: which image (0/1) of each sample, and a [B, n] mask with ≥ 1 cell per sample."""
    which = ddp.draw(lambda s: torch.randint(0, 2, s, device=device), (b,))  # the whole batch's draws
    cells = ddp.draw(lambda s: torch.rand(s, device=device), (b, n)) < prob
    none = ~cells.any(1)
    if ddp.any(none):
        pick = ddp.draw(lambda s: torch.randint(0, n, s, device=device), (b,))
        cells |= F.one_hot(pick, n).bool() & none.unsqueeze(1)
    return which, cells


def mvcl_nce(pred: torch.Tensor, target: torch.Tensor, negatives: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. 8: −log exp(cos(p, t)/τ) / (exp(cos(p, t)/τ) + Σ_n exp(cos(p, n)/τ)), averaged over masked cells."""
    p, t, n = F.normalize(pred.float(), dim=-1), F.normalize(target.float(), dim=-1), F.normalize(negatives.float(), dim=-1)
    pos = (p * t).sum(-1, keepdim=True) / tau
    logits = torch.cat([pos, p @ n.t() / tau], 1)
    return ddp.mean(torch.logsumexp(logits, 1) - pos.squeeze(1))  # over the whole batch's masked cells


def fda_loss(visual: torch.Tensor, text: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 9: ``visual`` and ``text`` [P, 1+K, d] (positive first), each caption's visual vector from its own
    pass → cross-entropy over cos/τ, and the fraction of pairs whose positive scores highest."""
    sim = F.cosine_similarity(visual.float(), text.float(), dim=-1) / tau  # [P, 1+K]
    target = torch.zeros(sim.size(0), dtype=torch.long, device=sim.device)
    return F.cross_entropy(sim, target), (sim.argmax(1) == 0).float().mean()


class IDCPCL(CaptionModel):
    # Read by pipeline.engine: Adam as one fused pass over the parameters (the per-tensor loop costs more than
    # the forward pass at small CPU batches); same update rule.
    optimizer_options = {"fused": True}

    def __init__(self, vocab_size: int, feat_dim: int = 2048, hidden: int = 512, heads: int = 8, ff: int = 2048,
                 layers: int = 3, single_layers: int = 1, pair_layers: int = 1, dropout: float = 0.2,
                 difference_encoder: bool = True, distractor_judging: bool = True, mlm_prob: float = 0.15,
                 mvcl_prob: float = 0.15, nce_temp: float = 1.0, fda_temp: float = 1.0, ft_mask_prob: float = 0.15,
                 ft_targets: str = "masked", max_positions: int = 512, fgvc_classes: int = 0,
                 fgvc_margin: float = 0.4, img_positions: str = "fixed", feature_norm: str = "none",
                 cross_cell_bias: float = 0.0):
        super().__init__()
        d = hidden
        self.vocab_size = vocab_size
        self.mask_id, self.cls_id = vocab_size, vocab_size + 1  # extra input-only tokens
        self.difference_encoder, self.distractor_judging = difference_encoder, distractor_judging
        self.mlm_prob, self.mvcl_prob, self.nce_temp, self.fda_temp = mlm_prob, mvcl_prob, nce_temp, fda_temp
        if ft_targets not in ("masked", "every"):
            raise ValueError(f"ft_targets must be 'masked' or 'every', not {ft_targets!r}")
        self.ft_mask_prob, self.ft_targets = ft_mask_prob, ft_targets
        self.prune_last = True  # the last cross-modal layer computes only the positions a loss reads
        self.p, self.d = dropout, d
        self.word = nn.Embedding(vocab_size + 2, d)
        self.img_proj = nn.Linear(feat_dim, d)
        if img_positions not in ("fixed", "learned"):
            raise ValueError(f"img_positions must be 'fixed' or 'learned', not {img_positions!r}")
        # "learned": the official code's 2-D grid embedding, a row plus a column vector per cell (BERT init,
        # std 0.02); [IMG1]/[IMG2] are learned tokens already and take none. "fixed": the paper's sinusoids.
        self.img_row = nn.Embedding(MAX_GRID, d) if img_positions == "learned" else None
        self.img_col = nn.Embedding(MAX_GRID, d) if img_positions == "learned" else None
        if feature_norm not in ("none", "standardize"):
            raise ValueError(f"feature_norm must be 'none' or 'standardize', not {feature_norm!r}")
        if feature_norm == "standardize":  # per-channel statistics of the training images (fit_input_stats)
            self.register_buffer("feat_mean", torch.zeros(feat_dim))
            self.register_buffer("feat_std", torch.ones(feat_dim))
        self.feature_norm = feature_norm
        self.img_token = nn.Parameter(torch.zeros(2, d))  # [IMG1], [IMG2]
        self.type_emb = nn.Embedding(3, d)  # img1, img2, text
        self.ln_img, self.ln_txt = nn.LayerNorm(d), nn.LayerNorm(d)
        self.register_buffer("pos", sinusoid(max_positions, d), persistent=False)
        if difference_encoder:
            self.single = Stack(single_layers, d, heads, ff, dropout)
            self.pair = Stack(pair_layers, d, heads, ff, dropout)
        # A deviation when non-zero (the official model: 0, no such term): a learned scalar added to the attention
        # score between cell i of one image and cell i of the other where the images first meet: the pair
        # encoder, or the cross-modal stack without one (see the docstring).
        self.cross_cell_bias = nn.Parameter(torch.tensor(float(cross_cell_bias))) if cross_cell_bias else None
        self.cross = Stack(layers, d, heads, ff, dropout)
        self.mlm = nn.Linear(d, vocab_size)  # the official output layer, shared by MLM and fine-tuning
        self.mvcl = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d))
        self.mvcl_bias = nn.Parameter(torch.zeros(feat_dim))
        self.judge = nn.Linear(2 * d, 2)
        self.fgvc_margin = fgvc_margin
        if fgvc_classes:  # only a pre-training run with FGVC data (NABirds) has these heads
            from pipeline.models.idc_pcl_fgvc import FGVCHeads

            self.fgvc = FGVCHeads(d, fgvc_classes)
        self.apply(self._init)
        nn.init.normal_(self.img_token, std=0.02)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    # ------------------------------------------------------------------------------------- encoders
    @torch.no_grad()
    def fit_input_stats(self, store, keys, max_images: int = 256) -> int:
        """``feature_norm: standardize``: per-channel mean and std of the features of ``keys`` (the training
        images; at most ``max_images``, evenly spaced over the sorted keys) over images and cells. Returns the
        number of images read (0 without standardisation)."""
        if self.feature_norm != "standardize":
            return 0
        keys = sorted(set(keys))
        if not keys:
            raise ValueError("no training images to fit the feature statistics on")
        keys = [keys[i] for i in np.linspace(0, len(keys) - 1, min(max_images, len(keys))).round().astype(int)]
        total, total_sq, n = 0.0, 0.0, 0
        for i in range(0, len(keys), 32):  # bounded memory: 32 images at a time
            x = torch.from_numpy(store.get_many(keys[i:i + 32])).double().flatten(2)  # [n, C, HW]
            total = total + x.sum((0, 2))
            total_sq = total_sq + (x * x).sum((0, 2))
            n += x.size(0) * x.size(2)
        mean = total / n
        self.feat_mean.copy_(mean)
        self.feat_std.copy_((total_sq / n - mean * mean).clamp_min(0).sqrt().clamp_min(1e-3))
        return len(keys)

    def standardized(self, feats: torch.Tensor) -> torch.Tensor:
        """[B, C, ...] features in the model's input space (``feature_norm``)."""
        if self.feature_norm == "none":
            return feats
        shape = (1, -1) + (1,) * (feats.dim() - 2)
        return (feats - self.feat_mean.view(shape)) / self.feat_std.view(shape)

    def project(self, feats: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] → [B, HW, d]: the linear projection of each cell, of the standardised features under
        ``feature_norm: standardize``. The standardisation is folded into the weights, W (x − μ)/σ + b =
        (W/σ) x + (b − (W/σ) μ): the same function and gradients, without two passes over the C-channel input
        (C = 2048: 27 of IDC-PCL's ~580 ms per fine-tuning step on one core, measured 2026-12-03)."""
        w, b = self.img_proj.weight, self.img_proj.bias
        if self.feature_norm == "standardize":
            w = w / self.feat_std
            b = b - w @ self.feat_mean
        return F.linear(feats.flatten(2).transpose(1, 2), w, b)

    def embed_image(self, feats: torch.Tensor, which: int) -> torch.Tensor:
        """[B, C, H, W] → [B, 1 + HW, d]: [IMG_which] then the projected cells (linear + sigmoid, as the
        official projection; ``feature_norm: standardize`` first standardises each channel)."""
        x = torch.sigmoid(self.project(feats))
        tok = self.img_token[which].expand(x.size(0), 1, -1)
        if self.img_row is None:
            x = torch.cat([tok, x], 1) + self.pos[: x.size(1) + 1]
        else:
            h, w = feats.shape[-2:]
            if max(h, w) > MAX_GRID:
                raise ValueError(f"learned image positions cover grids up to {MAX_GRID}x{MAX_GRID}, got {h}x{w}")
            grid = (self.img_row.weight[:h, None] + self.img_col.weight[None, :w]).reshape(h * w, -1)
            x = torch.cat([tok, x + grid], 1)
        x = x + self.type_emb.weight[which]
        return dropout(self.ln_img(x), self.p, self.training)

    def embed_text(self, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Word embeddings scaled by √d (as the official code) + fixed positions from ``start`` + text type."""
        x = self.word(ids) * math.sqrt(self.d) + self.pos[start:start + ids.size(1)] + self.type_emb.weight[2]
        return dropout(self.ln_txt(x), self.p, self.training)

    def single_image(self, feats: torch.Tensor, which: int, empty: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_image(feats, which)
        if not self.difference_encoder:
            return x
        if empty is None:
            return self.single(x)
        keep = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)  # an empty image's [IMG] sees itself only
        keep[:, 1:] = ~empty.bool().unsqueeze(1)
        return self.single(x, keep[:, None, None, :])

    def pair_images(self, s1: torch.Tensor, s2: torch.Tensor, empty2: torch.Tensor | None = None) -> torch.Tensor:
        v = torch.cat([s1, s2], 1)
        if not self.difference_encoder:
            return v
        mask = None if empty2 is None else self.visual_keys(v.size(1), empty2)[:, None, None, :]
        if self.cross_cell_bias is not None:
            mask = cross_cell_scores(self.cross_cell_bias, s1.size(1) - 1, mask)
        return self.pair(v, mask)

    def visual(self, img1: torch.Tensor, img2: torch.Tensor, empty2: torch.Tensor | None = None) -> torch.Tensor:
        return self.pair_images(self.single_image(img1, 0), self.single_image(img2, 1, empty2), empty2)

    @staticmethod
    def visual_keys(nv: int, empty2: torch.Tensor) -> torch.Tensor:
        """[B, Nv] keys a query may attend to: all but the cells of an empty second image (GIC's pseudo pairs,
        §2.4: "the padded vectors will not be involved in self-attention"); its [IMG2] token stays."""
        keep = torch.ones(empty2.size(0), nv, dtype=torch.bool, device=empty2.device)
        keep[:, nv // 2 + 1:] = ~empty2.bool().unsqueeze(1)
        return keep

    def joint_mask(self, mask: torch.Tensor | None, nv: int, n: int) -> torch.Tensor | None:
        """The cross-modal stack's mask over ``n`` tokens (``nv`` visual first): as given, or, without a pair
        encoder but with the cross-cell bias, additive scores with the bias between counterpart cells of the
        two images and -inf where the boolean ``mask`` forbids a key."""
        if self.difference_encoder or self.cross_cell_bias is None:
            return mask
        scores = F.pad(cross_cell_scores(self.cross_cell_bias, nv // 2 - 1), (0, n - nv, 0, n - nv))
        return scores if mask is None else scores.masked_fill(~mask, float("-inf"))

    def cross_modal(self, v: torch.Tensor, t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = torch.cat([v, t], 1)
        return self.cross(x, self.joint_mask(mask, v.size(1), x.size(1)))

    def cross_select(self, v, t, mask, need: torch.Tensor):
        """Cross-modal outputs at the ``need`` [B, T] positions only: (out [B, M, d], valid [B, M]) as
        ``needed_rows``. The last layer computes just those rows (``prune_last``; else all, then gathered)."""
        mask = self.joint_mask(mask, v.size(1), v.size(1) + t.size(1))
        rows, valid = needed_rows(need)
        if self.prune_last:
            return self.cross(torch.cat([v, t], 1), mask, rows), valid
        full = self.cross(torch.cat([v, t], 1), mask)
        return full.gather(1, rows.unsqueeze(-1).expand(-1, -1, full.size(-1))), valid

    @staticmethod
    def trim(labels: torch.Tensor) -> torch.Tensor:
        """Drop the padding columns that no caption of the batch uses (captions are left-aligned)."""
        n = ddp.max_int(int((labels > 0).sum(-1).max()))  # the whole batch's longest caption
        return labels[..., :max(n, 1)]

    def text_input(self, labels: torch.Tensor) -> torch.Tensor:
        cls = torch.full_like(labels[:, :1], self.cls_id)
        return torch.cat([cls, labels], 1)

    @classmethod
    def padding_mask(cls, nv: int, text: torch.Tensor, empty2: torch.Tensor | None = None) -> torch.Tensor:
        """Bidirectional attention over everything but the caption padding (and an empty image's cells):
        [B, 1, 1, Nv + Nt]."""
        vis = (torch.ones(text.size(0), nv, dtype=torch.bool, device=text.device) if empty2 is None
               else cls.visual_keys(nv, empty2))
        keep = torch.cat([vis, text > 0], 1)
        keep[:, nv] = True  # [CLS]
        return keep[:, None, None, :]

    @staticmethod
    def seq2seq_mask(nv: int, nt: int, device) -> torch.Tensor:
        """Visual tokens see visual tokens; caption tokens see all visual tokens and earlier caption tokens."""
        m = torch.zeros(nv + nt, nv + nt, dtype=torch.bool, device=device)
        m[:, :nv] = True
        m[nv:, nv:] = torch.ones(nt, nt, dtype=torch.bool, device=device).tril()
        return m

    def word_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlm(h)

    def feature_prediction(self, h: torch.Tensor) -> torch.Tensor:
        return self.mvcl(h) @ self.img_proj.weight + self.mvcl_bias

    # ----------------------------------------------------------------------------------- pre-training
    def pretraining_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        task = TASKS[int(batch["task"])]
        if task == "fgvc":
            from pipeline.models.idc_pcl_fgvc import fgvc_loss

            return fgvc_loss(self, self.fgvc, batch, self.fgvc_margin)
        empty2 = batch.get("img2_empty")  # GIC pseudo pairs: (image, empty image), pipeline.cross_task
        if empty2 is not None and bool(empty2.any()):
            loss, parts = self.task_loss(batch, empty2)
            return loss, {f"gic_{k}": v for k, v in parts.items()}
        return self.task_loss(batch)

    def task_loss(self, batch: dict, empty2: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        task = TASKS[int(batch["task"])]
        img1, img2, text = batch["img1"], batch["img2"], self.trim(batch["text"].long())
        if task == "mlm":
            v = self.visual(img1, img2, empty2)
            inp, tgt, masked = mask_tokens(text, self.mlm_prob, self.vocab_size, self.mask_id)
            t_in = self.text_input(inp)
            need = F.pad(masked, (v.size(1) + 1, 0))
            out, valid = self.cross_select(v, self.embed_text(t_in), self.padding_mask(v.size(1), t_in, empty2), need)
            logits = self.word_logits(out[valid])
            loss = ddp.cross_entropy(logits.float(), tgt[masked])
            acc = (logits.argmax(-1) == tgt[masked]).float().mean()
            return loss, {"mlm": loss.item(), "mlm_acc": acc.item()}
        if task == "mvcl":
            b, c, hh, ww = img1.shape
            n = hh * ww
            which, cells = mask_cells(b, n, self.mvcl_prob, img1.device)
            if empty2 is not None:  # appendix A.3: only the real image of a pseudo pair is masked
                which = which.masked_fill(empty2.bool(), 0)
            feats = torch.stack([img1, img2], 1).flatten(3).transpose(2, 3)  # [B, 2, HW, C]
            sel = F.one_hot(which, 2).bool().unsqueeze(2) & cells.unsqueeze(1)  # [B, 2, HW]
            # Masked cells are zeroed in the model's input space (raw zeros, or the channel means when
            # standardising); the regression targets and negatives live in that space too.
            fill = self.feat_mean if self.feature_norm == "standardize" else feats.new_zeros(c)
            masked_feats = torch.where(sel.unsqueeze(-1), fill, feats).transpose(2, 3).reshape(b, 2, c, hh, ww)
            if self.feature_norm == "standardize":
                feats = (feats - self.feat_mean) / self.feat_std
            v = self.visual(masked_feats[:, 0], masked_feats[:, 1], empty2)
            t_in = self.text_input(text)
            need = F.pad(F.pad(sel, (1, 0)).reshape(b, -1), (0, t_in.size(1)))  # the masked cells' tokens
            out, valid = self.cross_select(v, self.embed_text(t_in), self.padding_mask(v.size(1), t_in, empty2), need)
            pred = self.feature_prediction(out[valid])
            own = feats[torch.arange(b), which]  # the masked images' original features [B, HW, C]
            # The negatives are the unmasked cells of the whole batch's masked images.
            loss = mvcl_nce(pred, feats[sel], ddp.gather(own)[~ddp.gather(cells)], self.nce_temp)
            return loss, {"mvcl": loss.item()}
        # fda: text [P, 1+K, L]
        p, k1, length = text.shape
        v = self.visual(img1, img2, empty2)
        v = v.unsqueeze(1).expand(p, k1, *v.shape[1:]).reshape(p * k1, *v.shape[1:])
        e2 = None if empty2 is None else empty2.repeat_interleave(k1)
        t_in = self.text_input(text.reshape(p * k1, length))
        need = torch.zeros(p * k1, v.size(1) + t_in.size(1), dtype=torch.bool, device=v.device)
        need[:, [0, v.size(1) // 2, v.size(1)]] = True  # [IMG1], [IMG2], [CLS]
        out, _ = self.cross_select(v, self.embed_text(t_in), self.padding_mask(v.size(1), t_in, e2), need)
        vis = 0.5 * (out[:, 0] + out[:, 1])  # each caption against the visual vector of its own pass
        loss, acc = fda_loss(vis.view(p, k1, -1), out[:, 2].view(p, k1, -1), self.fda_temp)
        return loss, {"fda": loss.item(), "fda_acc": acc.item()}

    # ------------------------------------------------------------------------------------ fine-tuning
    def training_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        if "task" in batch:
            return self.pretraining_loss(batch)
        before = batch["before"]
        b = before.size(0)
        afters, labels = pair_groups(batch)
        s_bef = self.single_image(before, 0)
        s_aft = torch.cat([self.single_image(a, 1) for a in afters])  # no copy of the C-channel inputs
        v = self.pair_images(torch.cat([s_bef] * len(afters)), s_aft)
        labels = self.trim(labels)
        nv = v.size(1)
        if self.ft_targets == "every":
            t, tgt, masked, mask = self.every_word_input(labels, nv)
        else:
            inp, tgt, masked = mask_tokens(labels, self.ft_mask_prob, self.vocab_size, self.mask_id, len(afters))
            t_in = self.text_input(inp)
            t, mask = self.embed_text(t_in), self.seq2seq_mask(nv, t_in.size(1), v.device)
        need = F.pad(masked, (nv + t.size(1) - masked.size(1), 0))
        need[:, [0, nv // 2]] = True  # [IMG1], [IMG2]: always the first two needed positions
        out, valid = self.cross_select(v, t, mask, need)
        logits = self.word_logits(out[:, 2:][valid[:, 2:]])
        ce = ddp.cross_entropy(logits.float(), tgt[masked])
        parts = {"mlm": ce.item()}
        loss = ce
        if has_partners(batch):  # each pair is changed (1), each partner a distractor (0)
            target = torch.cat([torch.ones(b), torch.zeros(b)]).long()
        else:  # plain pairs: a no_change pair is the distractor; a batch of one kind has nothing to judge
            target = batch["changed"].long().cpu()
        if self.distractor_judging and 0 < ddp.sum_int(int(target.sum())) < ddp.sum_int(len(target)):
            judged = self.judge(torch.cat([out[:, 0], out[:, 1]], 1)).float()
            target = target.to(judged.device)
            dj = F.cross_entropy(judged, target)
            loss = loss + dj
            parts.update(dj=dj.item(), dj_acc=(judged.argmax(1) == target).float().mean().item())
        return loss, parts

    def every_word_input(self, labels: torch.Tensor, nv: int):
        """Fine-tuning input in which every word is a target under the inference condition: the true caption
        [CLS] <START> w1 … (causal, as in ``seq2seq_mask``), then one [MASK] query per word at that word's
        position, seeing the visual tokens, the true words before it and itself (exactly what ``greedy``
        feeds). Returns (embedded text [B, T + Q, d], targets [B, Q] (-100 at padding), target mask [B, Q],
        attention mask [Nv + T + Q]²)."""
        t_in = self.text_input(labels)  # [B, T]: [CLS] <START> w1 … <END> pad
        tgt = labels[:, 1:]  # query q predicts the word at text position q + 2
        n_t, n_q = t_in.size(1), tgt.size(1)
        t = torch.cat([self.embed_text(t_in), self.embed_text(torch.full_like(tgt, self.mask_id), start=2)], 1)
        dev = labels.device
        m = torch.zeros(nv + n_t + n_q, nv + n_t + n_q, dtype=torch.bool, device=dev)
        m[:, :nv] = True
        m[nv:nv + n_t, nv:nv + n_t] = torch.ones(n_t, n_t, dtype=torch.bool, device=dev).tril()
        m[nv + n_t:, nv:nv + n_t] = torch.ones(n_q, n_t, dtype=torch.bool, device=dev).tril(1)
        m[nv + n_t:, nv + n_t:] = torch.eye(n_q, dtype=torch.bool, device=dev)
        masked = tgt > 0
        return t, tgt.masked_fill(~masked, -100), masked, m

    def init_from(self, state: dict) -> list[str]:
        """Start from a pre-training checkpoint of the same architecture: every tensor but the fine-tuning
        classifier must be there with the same shape (a mismatch means the configs disagree)."""
        own = self.state_dict()
        bad = [k for k in own if not k.startswith("judge.") and (k not in state or state[k].shape != own[k].shape)]
        if bad:
            raise ValueError(f"pre-trained weights do not fit this IDC-PCL model ({len(bad)} tensors missing or "
                             f"of another shape, e.g. {bad[:3]}): the pre-training and method model blocks must agree")
        hits = [k for k in own if k in state and state[k].shape == own[k].shape]
        self.load_state_dict({**own, **{k: state[k] for k in hits}})
        return hits

    # -------------------------------------------------------------------------------------- inference
    @torch.no_grad()
    def greedy(self, before: torch.Tensor, after: torch.Tensor, max_len: int, return_logits: bool = False):
        b = before.size(0)
        dev = before.device
        x = self.cross.norm(self.visual(before, after))
        vis_mask = self.joint_mask(None, x.size(1), x.size(1))  # caption queries below get no cross-cell term
        cache = []
        for blk in self.cross.layers:  # visual states never see the caption: run them once
            x, kv = blk(x, vis_mask)
            cache.append(kv)
        out = torch.zeros(b, max_len, dtype=torch.long, device=dev)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        real = torch.tensor([[self.cls_id, START]], device=dev).expand(b, 2)  # new caption tokens this step
        mask_tok = torch.full((b, 1), self.mask_id, dtype=torch.long, device=dev)
        pos = 0  # text position of real[:, 0]
        all_logits = []
        for t in range(max_len):
            n_r = real.size(1)
            h = self.cross.norm(torch.cat([self.embed_text(real, pos), self.embed_text(mask_tok, pos + n_r)], 1))
            p = cache[0][0].size(2)
            m = torch.ones(n_r + 1, p + n_r + 1, dtype=torch.bool, device=dev)
            m[:, p:] = torch.ones(n_r + 1, n_r + 1, dtype=torch.bool, device=dev).tril()
            for i, blk in enumerate(self.cross.layers):
                h, (k, v) = blk(h, m, cache[i])
                cache[i] = (torch.cat([cache[i][0], k[:, :, :n_r]], 2), torch.cat([cache[i][1], v[:, :, :n_r]], 2))
            logits = self.word_logits(h[:, -1])
            if return_logits:
                all_logits.append(logits)
            word = logits.argmax(-1).masked_fill(done, 0)
            out[:, t] = word
            done |= word == END
            if done.all():
                break
            pos += n_r
            real = word.unsqueeze(1)
        if return_logits:
            return out, torch.stack(all_logits, 1)
        return out

    @torch.no_grad()
    def generate(self, before, after, max_len: int):
        return self.greedy(before, after, max_len)
