"""CLIP4IDC (Guo, Wang & Laaksonen, AACL 2022) and its CLIP-FT baseline: CLIP ViT-B/32 on raw pixel pairs.

Vision encoder (seed paper §2.2, Eq. 2-4, appendix B). Each image is patchified by CLIP's 32×32 convolution
into 49 patches plus the class token, with CLIP's positional embedding (Eq. 2-3), then ``n_intra`` CLIP
layers run on each image *alone* (F_intra). The two token sequences get the learned before/after
embeddings e1/e2, are concatenated, get the joint positional embedding p over 2·50 positions (Eq. 4) and
the remaining ``12 - n_intra`` CLIP layers run on the joint sequence (F_inter). CLIP's ``ln_post`` and its
projection W (768→512) are applied to every token: F'(X1, X2), [B, 100, 512]. The official code adds a
LayerNorm (``ln_mid``) after the joint positional embedding; it is kept (the paper is silent, it is part of
the same parameters the paper counts). e1, e2 and p are new parameters initialised like CLIP's own
embeddings (normal, std width^-0.5).

Captioning (§2.4, appendix B): F'(X1, X2) feeds a captioning Transformer *encoder* and a *decoder*, 3 layers
each, hidden 512, 8 heads, 10 % dropout, trained from scratch with word-level cross-entropy; greedy decoding.
The official code has only the decoder and ties its word embeddings to CLIP's BPE token embedding; the paper
describes encoder + decoder learned from scratch (and its Table 5 parameter count, 135.6 M, is consistent with a ViT-B/32
vision encoder + a 3-layer encoder + a 3-layer decoder + a 49 408-word embedding), so we follow the paper,
with the pipeline's word vocabulary. The decoder is the project's shared transformer decoder
(``pipeline.models.transformer_decoder``, sinusoidal positions, key/value cache): the image pair and the
captioning encoder run once per batch and each step costs one token (the official greedy decoding re-runs the
whole model, CLIP included, at every step). Loss per batch, as the official ``main_task_caption.py``: CE(before, semantic
after, change caption) + CE(before, distractor after, no-change caption), summed; on plain pairs (a dataset
without distractor partners, ``pipeline.data``) CE(before, after, caption) of every pair.

CLIP-FT (§2.1, Table 5): the same captioner on a CLIP vision encoder fine-tuned directly from CLIP, each image
through all 12 layers alone (``n_intra = 12``, no joint positional embedding, no ``ln_mid``). The paper does
not say how CLIP-FT tells the two images apart; we keep e1/e2 (1 536 parameters, inside the rounding of
Table 5's 0.08 M difference between the two models) so that its captioning encoder can.

Optimiser (appendix B): Adam, 1e-4 for the captioner and 1e-7 for the vision encoder, i.e. the encoder's
learning rate is ``encoder_lr_mult`` × the base rate (``param_groups``, read by ``pipeline.engine``). The
official code puts the new e1/e2/p/ln_mid in the 1e-7 group too (their names start with ``clip.``); so do we.

Adaptation (§2.3, Eq. 5-8; :class:`CLIP4IDCAdapt`, trained by ``pipeline.clip4idc_adapt``): the pair
representation v is the mean of the two class tokens of F'(X1, X2) (positions 1 and n+2); the caption's is
the CLIP text encoder's output at its end token, projected to 512; cosine similarities scaled by a learned
temperature (CLIP's ``logit_scale``, clamped at 100 as CLIP and the official code do); loss L_i2t + L_t2i.

Weights (``weights``): ``random`` (explicit; seeded by the run's seed), ``openai`` (OpenAI's ``ViT-B-32.pt``,
looked up in ``weights_dir`` or downloaded from its published URL, sha256 checked), or the path of a file in
the OpenAI layout (a plain state dict or OpenAI's TorchScript archive). The OpenAI layout is mapped key for
key onto the ``transformers`` CLIP modules (:func:`openai_key_map`); a missing, unexpected or misshapen key is
an error, never skipped.

Size (``clip``: :class:`ClipShape` overrides). The default shape is ViT-B/32, the paper's, and the only one
``weights: openai`` loads. The embedded CPU default (``config/config.yaml``) overrides it with a small CLIP
trained from scratch (ViT width 128, 6 layers, 32-px patches on the 224-px pixel cache, 3-layer text encoder,
embed 128) and a 128-wide captioner: a randomly initialised ViT-B/32 cannot learn in a CPU budget (issue 12).
Every component stays: the adaptation, the intra/inter split with the joint positions, CLIP-FT's all-intra
encoder; the Table 7 sweep ranges over the small ViT's layers.

Cross-cell bias (``cross_cell_bias``, a deviation of the embedded default; 0, the paper's model, adds nothing): a
learned scalar, started at the configured value, added to the attention score between patch i of one image and
patch i of the other wherever the two images' tokens meet (the inter layers; the captioning encoder, CLIP-FT's
only joint stack). The same term as IDC-PCL's (``pipeline.models.idc_pcl``, where the measurements are): on the
small CPU budgets a single stream over both images does not find which tokens to compare by itself.

Image type embedding (``type_embedding``, a deviation of the embedded default; 0, the paper's model, adds nothing):
a learned vector for each image, before and after, added to each of its tokens at the captioning encoder's input,
as BERT's token-type embedding, started at N(0, σ²) with σ the configured value. The captioning encoder has no
positions of its own, so otherwise which image a token came from is only in e1/e2, added before ``ln_post`` at
CLIP's scale (std width^-0.5, against tokens of norm ~15) and held with the encoder: CLIP-FT, whose only joint
stack is this encoder, told an addition from a removal worst of all rows (measured, ``config/config.yaml``).

Frozen encoder (``freeze_encoder``; CLIP4IDC Table 7 and, on the CPU default, the paper's 1e-7 taken to 0): no
gradient and no optimiser group for the vision encoder. ``encoder_cache_mb`` then keeps each training image's
intra-layer output (keyed by its pixels' bytes, computed for that image alone, up to that many MiB) so the ViT
runs once per image instead of once per epoch, and each training pair's encoder output F' as well (the joint
layers are frozen too), so a step runs only the captioner; decoding uses neither. ``freeze_intra`` (a deviation of the
CPU default) holds the patch embedding and the intra layers at their initialisation and trains the rest: in the
adaptation the joint layers, the text encoder and the temperature (trained from scratch at chance, the whole
ViT's adaptation left features its captioner could not read; measured, ``config/config.yaml``).

Text tokens for the adaptation (``text_tokens``): ``words`` uses the pipeline's word vocabulary (its own,
randomly initialised token embedding; only valid with ``weights: random``); ``clip_bpe`` uses CLIP's byte-pair
encoding (:class:`ClipBPE`, needs ``bpe_simple_vocab_16e6.txt.gz``, which ships with the ``open_clip_torch``
wheel), required with OpenAI weights. Tested: the ``words`` path end to end; the BPE tokenizer on known CLIP
token ids when the vocabulary file is present (tests skip otherwise); the OpenAI loading path on a randomly
initialised state dict in the OpenAI layout (the real file cannot be downloaded here).
"""

from __future__ import annotations

import gzip
import hashlib
import html
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline import distributed as ddp
from pipeline.errors import PipelineError
from pipeline.models.attention import MultiHeadAttention, cross_cell_scores
from pipeline.models.common import CaptionModel, ce_parts, group_slices, pair_groups, sequence_ce
from pipeline.models.dropout import Dropout
from pipeline.models.transformer_decoder import TransformerDecoder
from pipeline.text import START

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


# ------------------------------------------------------------------------------------------ shapes
@dataclass(frozen=True)
class ClipShape:
    """CLIP's architecture; the default is ViT-B/32 (appendix B). The embedded CPU config and the tests use
    smaller ones, trained from scratch (OpenAI weights exist only for ViT-B/32)."""

    vision_width: int = 768
    vision_layers: int = 12
    vision_heads: int = 12
    patch_size: int = 32
    image_size: int = 224
    embed_dim: int = 512
    text_width: int = 512
    text_layers: int = 12
    text_heads: int = 8
    context_length: int = 77
    text_vocab: int = 49408

    @property
    def n_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1


def clip_shape(overrides: dict | None) -> ClipShape:
    try:
        return ClipShape(**(overrides or {}))
    except TypeError as e:
        raise PipelineError(f"clip shape: {e}") from None


def _vision_config(s: ClipShape):
    from transformers import CLIPVisionConfig

    cfg = CLIPVisionConfig(hidden_size=s.vision_width, intermediate_size=4 * s.vision_width,
                           num_hidden_layers=s.vision_layers, num_attention_heads=s.vision_heads,
                           image_size=s.image_size, patch_size=s.patch_size, hidden_act="quick_gelu",
                           layer_norm_eps=1e-5, attention_dropout=0.0, projection_dim=s.embed_dim)
    cfg._attn_implementation = "sdpa"  # fused attention (F.scaled_dot_product_attention)
    return cfg


def _text_config(s: ClipShape, vocab_size: int, eos_id: int):
    from transformers import CLIPTextConfig

    bos = 49406 if eos_id == 49407 else START  # CLIP BPE <|startoftext|>, or the word vocabulary's <START>
    cfg = CLIPTextConfig(vocab_size=vocab_size, bos_token_id=bos, pad_token_id=0, hidden_size=s.text_width, intermediate_size=4 * s.text_width,
                         num_hidden_layers=s.text_layers, num_attention_heads=s.text_heads,
                         max_position_embeddings=s.context_length, hidden_act="quick_gelu", layer_norm_eps=1e-5,
                         attention_dropout=0.0, eos_token_id=eos_id, projection_dim=s.embed_dim)
    cfg._attn_implementation = "sdpa"
    return cfg


class QuickGELU(nn.Module):
    """CLIP's x·σ(1.702x) as silu(1.702x)/1.702: the same function, one fused kernel forward and backward
    instead of three elementwise passes (transformers' ``QuickGELUActivation``); [32, 100, 1024] on one core:
    12 ms against 23 ms forward + backward (measured 2026-12-03)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x * 1.702).mul_(1 / 1.702)


def fast_quick_gelu_(model: nn.Module) -> nn.Module:
    """Swap each of ``model``'s QuickGELU activations (no parameters) for ``QuickGELU``; returns ``model``."""
    from transformers.activations import QuickGELUActivation

    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, QuickGELUActivation):
                setattr(module, child_name, QuickGELU())
    return model


# ------------------------------------------------------------------------------------------ vision
class PairEncoder(nn.Module):
    """F'(X1, X2) of Eq. 4: intra layers per image, inter layers on the joint sequence; [B, 2T, embed_dim]."""

    def __init__(self, shape: ClipShape = ClipShape(), n_intra: int = 9, joint_position: bool = True,
                 cross_cell_bias: float = 0.0):
        super().__init__()
        from transformers import CLIPVisionModel

        if not 0 <= n_intra <= shape.vision_layers:
            raise PipelineError(f"model.n_intra must be in 0..{shape.vision_layers} (the CLIP vision layers), got {n_intra}")
        self.shape, self.n_intra, self.joint = shape, n_intra, joint_position
        self.vit = fast_quick_gelu_(CLIPVisionModel(_vision_config(shape)))  # embeddings, pre_layrnorm, encoder.layers, post_layernorm
        w = shape.vision_width
        self.proj = nn.Linear(w, shape.embed_dim, bias=False)  # CLIP's visual.proj (stored transposed there)
        nn.init.normal_(self.proj.weight, std=w ** -0.5)
        self.before_embedding = nn.Parameter(torch.randn(w) * w ** -0.5)  # e1
        self.after_embedding = nn.Parameter(torch.randn(w) * w ** -0.5)   # e2
        if joint_position:
            self.joint_position = nn.Parameter(torch.randn(2 * shape.n_tokens, w) * w ** -0.5)  # p
            self.ln_mid = nn.LayerNorm(w, eps=1e-5)
        # The split travels with the weights: a captioner must not start from an adaptation with another split.
        self.register_buffer("split", torch.tensor([n_intra, shape.vision_layers - n_intra, int(joint_position)]))
        # A deviation when non-zero (the paper's encoder has no such term): a learned scalar added to the inter
        # layers' attention score between patch i of one image and patch i of the other (module docstring).
        self.cross_cell_bias = (nn.Parameter(torch.tensor(float(cross_cell_bias)))
                                if cross_cell_bias and n_intra < shape.vision_layers else None)
        mean, std = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1), torch.tensor(CLIP_STD).view(1, 3, 1, 1)
        # pixels 0-255 -> (x/255 - mean) / std as one multiply-add
        self.register_buffer("pix_scale", 1.0 / (255.0 * std), persistent=False)
        self.register_buffer("pix_shift", -mean / std, persistent=False)

    @property
    def layers(self):
        return self.vit.encoder.layers

    def freeze_intra(self) -> None:
        """Hold the patch embedding and the intra layers at their weights (``freeze_intra``, module docstring)."""
        for part in (self.vit.embeddings, self.vit.pre_layrnorm, *self.layers[:self.n_intra]):
            part.requires_grad_(False)

    def intra(self, pixels: torch.Tensor) -> torch.Tensor:
        """F_intra on each image alone: pixels [N, 3, S, S] in 0-255 -> [N, T, width]."""
        x = pixels * self.pix_scale + self.pix_shift
        h = self.vit.pre_layrnorm(self.vit.embeddings(x))
        for layer in self.layers[:self.n_intra]:
            h = layer(h, None)
        return h

    def inter(self, h_before: torch.Tensor, h_after: torch.Tensor) -> torch.Tensor:
        """F_inter on [F_intra(X1) + e1, F_intra(X2) + e2] + p, then ln_post and W -> [B, 2T, embed_dim]."""
        h = torch.cat([h_before + self.before_embedding, h_after + self.after_embedding], 1)
        if self.joint:
            h = self.ln_mid(h + self.joint_position)
        mask = None
        if self.cross_cell_bias is not None:
            mask = cross_cell_scores(self.cross_cell_bias, h_before.size(1) - 1).to(h.dtype)
        for layer in self.layers[self.n_intra:]:
            h = layer(h, mask)
        return self.proj(self.vit.post_layernorm(h))

    def forward(self, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
        h = self.intra(torch.cat([before, after]))
        return self.inter(*h.chunk(2))


# ------------------------------------------------------------------------------------------ OpenAI weights
OPENAI_VIT_B32_URL = ("https://openaipublic.azureedge.net/clip/models/"
                      "40d365715913c9da98579312b702a82c18be219cc2a73407c4526f58eba950af/ViT-B-32.pt")
OPENAI_VIT_B32_SHA256 = "40d365715913c9da98579312b702a82c18be219cc2a73407c4526f58eba950af"
OPENAI_METADATA_KEYS = ("input_resolution", "context_length", "vocab_size")  # ints in OpenAI's archive


def _block_map(src: str, dst: str) -> dict[str, tuple[str, str]]:
    """One residual block: OpenAI key -> (transformers name, how). ``in_proj`` is split into q, k, v."""
    m = {f"{src}.attn.in_proj_weight": (f"{dst}.self_attn.{{q,k,v}}_proj.weight", "qkv"),
         f"{src}.attn.in_proj_bias": (f"{dst}.self_attn.{{q,k,v}}_proj.bias", "qkv")}
    for a, b in (("attn.out_proj", "self_attn.out_proj"), ("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"),
                 ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
        for p in ("weight", "bias"):
            m[f"{src}.{a}.{p}"] = (f"{dst}.{b}.{p}", "copy")
    return m


def openai_key_map(shape: ClipShape = ClipShape(), vision: str = "encoder", text: str | None = "text",
                   text_proj: str | None = "text_proj", logit_scale: str | None = "logit_scale"
                   ) -> dict[str, tuple[str, str]]:
    """OpenAI CLIP state-dict key -> (our parameter name, transform) for every tensor of the OpenAI layout.

    Transforms: ``copy``; ``t`` (OpenAI stores projections as x @ P, nn.Linear as x @ W.T); ``qkv`` (split
    in_proj into the three q/k/v projections). ``text`` etc. None: that part is absent from our model (the
    captioner has no text encoder) and its OpenAI keys are deliberately not loaded.
    """
    v = f"{vision}.vit"
    m = {"visual.class_embedding": (f"{v}.embeddings.class_embedding", "copy"),
         "visual.positional_embedding": (f"{v}.embeddings.position_embedding.weight", "copy"),
         "visual.conv1.weight": (f"{v}.embeddings.patch_embedding.weight", "copy"),
         "visual.ln_pre.weight": (f"{v}.pre_layrnorm.weight", "copy"),
         "visual.ln_pre.bias": (f"{v}.pre_layrnorm.bias", "copy"),
         "visual.ln_post.weight": (f"{v}.post_layernorm.weight", "copy"),
         "visual.ln_post.bias": (f"{v}.post_layernorm.bias", "copy"),
         "visual.proj": (f"{vision}.proj.weight", "t")}
    for i in range(shape.vision_layers):
        m.update(_block_map(f"visual.transformer.resblocks.{i}", f"{v}.encoder.layers.{i}"))
    if text is not None:
        m.update({"token_embedding.weight": (f"{text}.embeddings.token_embedding.weight", "copy"),
                  "positional_embedding": (f"{text}.embeddings.position_embedding.weight", "copy"),
                  "ln_final.weight": (f"{text}.final_layer_norm.weight", "copy"),
                  "ln_final.bias": (f"{text}.final_layer_norm.bias", "copy")})
        for i in range(shape.text_layers):
            m.update(_block_map(f"transformer.resblocks.{i}", f"{text}.encoder.layers.{i}"))
    if text_proj is not None:
        m["text_projection"] = (f"{text_proj}.weight", "t")
    if logit_scale is not None:
        m["logit_scale"] = (logit_scale, "copy")
    return m


def openai_layout_shapes(shape: ClipShape = ClipShape()) -> dict[str, tuple[int, ...]]:
    """The tensor shapes of OpenAI's CLIP state dict for ``shape`` (ViT image tower)."""
    w, t, e = shape.vision_width, shape.text_width, shape.embed_dim
    out = {"visual.class_embedding": (w,), "visual.positional_embedding": (shape.n_tokens, w),
           "visual.conv1.weight": (w, 3, shape.patch_size, shape.patch_size), "visual.ln_pre.weight": (w,),
           "visual.ln_pre.bias": (w,), "visual.ln_post.weight": (w,), "visual.ln_post.bias": (w,),
           "visual.proj": (w, e), "token_embedding.weight": (shape.text_vocab, t),
           "positional_embedding": (shape.context_length, t), "ln_final.weight": (t,), "ln_final.bias": (t,),
           "text_projection": (t, e), "logit_scale": ()}

    def block(prefix, d):
        out.update({f"{prefix}.attn.in_proj_weight": (3 * d, d), f"{prefix}.attn.in_proj_bias": (3 * d,),
                    f"{prefix}.attn.out_proj.weight": (d, d), f"{prefix}.attn.out_proj.bias": (d,),
                    f"{prefix}.ln_1.weight": (d,), f"{prefix}.ln_1.bias": (d,), f"{prefix}.ln_2.weight": (d,),
                    f"{prefix}.ln_2.bias": (d,), f"{prefix}.mlp.c_fc.weight": (4 * d, d),
                    f"{prefix}.mlp.c_fc.bias": (4 * d,), f"{prefix}.mlp.c_proj.weight": (d, 4 * d),
                    f"{prefix}.mlp.c_proj.bias": (d,)})

    for i in range(shape.vision_layers):
        block(f"visual.transformer.resblocks.{i}", w)
    for i in range(shape.text_layers):
        block(f"transformer.resblocks.{i}", t)
    return out


def read_openai_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A plain state dict (``torch.save``) or OpenAI's TorchScript archive, as float32 tensors."""
    path = Path(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - OpenAI's published file is a TorchScript archive, not a pickle
        try:
            obj = torch.jit.load(str(path), map_location="cpu").state_dict()
        except Exception as e:  # noqa: BLE001
            raise PipelineError(f"cannot read CLIP weights file {path}: {e}") from None
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise PipelineError(f"CLIP weights file {path}: expected a state dict, got {type(obj).__name__}")
    return {k: v for k, v in obj.items() if k not in OPENAI_METADATA_KEYS}


def load_openai(model: nn.Module, state: dict[str, torch.Tensor], key_map: dict[str, tuple[str, str]],
                source: str) -> list[str]:
    """Copy an OpenAI-layout state dict into ``model`` key for key; returns our names that were set.

    Every key of ``key_map`` must be in ``state`` with the right shape; keys of ``state`` outside the map
    are errors unless they belong to a part the model does not have (the map was built without it).
    """
    own = model.state_dict()
    skipped_prefixes = () if any(k.startswith("token_embedding") for k in key_map) else (
        "token_embedding.", "positional_embedding", "transformer.", "ln_final.", "text_projection", "logit_scale")
    unexpected = [k for k in state if k not in key_map and not k.startswith(skipped_prefixes)]
    missing = [k for k in key_map if k not in state]
    if missing or unexpected:
        raise PipelineError(f"CLIP weights {source}: not the OpenAI CLIP layout for this architecture "
                            f"(missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected "
                            f"{unexpected[:3]}{'...' if len(unexpected) > 3 else ''})")
    new, done = {}, []
    for src, (dst, how) in key_map.items():
        t = state[src].float()
        if how == "qkv":
            parts = dict(zip("qkv", t.chunk(3, 0)))
            targets = [(dst.replace("{q,k,v}", c), parts[c]) for c in "qkv"]
        else:
            targets = [(dst, t.t() if how == "t" else t)]
        for name, value in targets:
            if name not in own:
                raise PipelineError(f"CLIP weights {source}: {src} maps to {name}, which this model lacks")
            if tuple(own[name].shape) != tuple(value.shape):
                raise PipelineError(f"CLIP weights {source}: {src} has shape {tuple(state[src].shape)}, "
                                    f"this model expects {tuple(own[name].shape)} for {name}")
            new[name] = value.contiguous()
            done.append(name)
    model.load_state_dict({**own, **new})
    return done


def resolve_clip_weights(spec: str, weights_dir: str | os.PathLike = "resources/weights",
                         download_ok: bool = True, url: str | None = None) -> tuple[Path | None, str]:
    """``weights`` setting -> (file or None, identity). ``random`` -> (None, 'random(seed=S)')."""
    import urllib.error

    from pipeline.utils.download import download, sha256_file

    spec = str(spec).strip()
    if spec == "random":
        return None, f"random(seed={torch.initial_seed()})"
    if spec == "openai":
        target = Path(weights_dir) / "ViT-B-32.pt"
        if not target.exists():
            why = "downloads are disabled"
            if download_ok:
                try:
                    download(url or OPENAI_VIT_B32_URL, target, sha256_prefix=OPENAI_VIT_B32_SHA256)
                except (urllib.error.URLError, OSError, TimeoutError) as e:
                    why = f"download from {url or OPENAI_VIT_B32_URL} failed: {getattr(e, 'reason', None) or e}"
            if not target.exists():
                raise PipelineError(
                    f"OpenAI CLIP ViT-B/32 weights not available ({why}): download {OPENAI_VIT_B32_URL} and place "
                    f"it at {target} (sha256 {OPENAI_VIT_B32_SHA256}), or set `weights: random` in the method's "
                    f"model block to run explicitly with a randomly initialised CLIP")
        digest = sha256_file(target)
        if digest != OPENAI_VIT_B32_SHA256:
            raise PipelineError(f"{target}: sha256 {digest} is not that of OpenAI's ViT-B-32.pt "
                                f"({OPENAI_VIT_B32_SHA256}); replace it with the file from {OPENAI_VIT_B32_URL}")
        return target, f"sha256:{digest}"
    path = Path(spec)
    if not path.is_file():
        raise PipelineError(f"CLIP weights file {path} does not exist (weights: expects 'random', 'openai' or the "
                            f"path of a CLIP ViT-B/32 state dict in the OpenAI layout)")
    return path, f"sha256:{sha256_file(path)}"


# ------------------------------------------------------------------------------------------ CLIP BPE
def _bytes_to_unicode() -> dict[int, str]:
    """Byte -> printable unicode character, so that BPE runs on strings without whitespace/control bytes."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    rest = [b for b in range(256) if b not in keep]
    # Insertion order is the vocabulary order: printable bytes first, then the remapped ones.
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


def find_bpe_vocab(path: str | os.PathLike | None = None, weights_dir: str | os.PathLike = "resources/weights") -> Path:
    """The CLIP BPE merges file: ``path``, else ``<weights_dir>/bpe_simple_vocab_16e6.txt.gz``, else the copy
    inside an installed ``open_clip`` package."""
    import importlib.util

    name = "bpe_simple_vocab_16e6.txt.gz"
    candidates = [Path(path)] if path else [Path(weights_dir) / name]
    if not path:
        spec = importlib.util.find_spec("open_clip")
        if spec is not None and spec.submodule_search_locations:
            candidates += [Path(p) / name for p in spec.submodule_search_locations]
    for c in candidates:
        if c.is_file():
            return c
    raise PipelineError(f"CLIP BPE vocabulary {name} not found (looked at {', '.join(map(str, candidates))}): "
                        f"place it at {candidates[0]} (it ships inside the open_clip_torch wheel: "
                        f"`pip download open_clip_torch --no-deps`, file open_clip/{name}), or use "
                        f"`text_tokens: words` with `weights: random`")


class ClipBPE:
    """CLIP's byte-level BPE tokenizer (vocabulary 49 408: 256 bytes, 256 bytes + ``</w>``, 48 894 merges,
    ``<|startoftext|>``, ``<|endoftext|>``). Cleaning is lower-casing, HTML unescaping and whitespace
    collapsing; OpenAI's ``ftfy`` repair of broken unicode is omitted (captions here are plain ASCII)."""

    N_MERGES = 49152 - 256 - 2

    def __init__(self, path: str | os.PathLike):
        import regex

        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                lines = f.read().split("\n")
        except OSError as e:
            raise PipelineError(f"cannot read CLIP BPE vocabulary {path}: {e}") from None
        merges = [tuple(m.split()) for m in lines[1:1 + self.N_MERGES]]
        if len(merges) != self.N_MERGES or any(len(m) != 2 for m in merges):
            raise PipelineError(f"{path}: not CLIP's BPE merges file ({len(merges)} merges read)")
        self.byte_encoder = _bytes_to_unicode()
        symbols = list(self.byte_encoder.values())
        vocab = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges]
        vocab += ["<|startoftext|>", "<|endoftext|>"]
        self.encoder = {w: i for i, w in enumerate(vocab)}
        self.ranks = {m: i for i, m in enumerate(merges)}
        self.sot, self.eot = self.encoder["<|startoftext|>"], self.encoder["<|endoftext|>"]
        self.pattern = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""",
                                     regex.IGNORECASE)
        self._bpe = lru_cache(maxsize=65536)(self._bpe_uncached)

    def __len__(self) -> int:
        return len(self.encoder)

    def _bpe_uncached(self, token: str) -> tuple[str, ...]:
        word = tuple(token[:-1]) + (token[-1] + "</w>",)
        while len(word) > 1:
            pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
            best = min(pairs, key=lambda p: self.ranks.get(p, math.inf))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        return word

    def encode(self, text: str) -> list[int]:
        text = " ".join(html.unescape(html.unescape(text)).split()).lower()
        ids = []
        for tok in self.pattern.findall(text):
            tok = "".join(self.byte_encoder[b] for b in tok.encode("utf-8"))
            ids.extend(self.encoder[p] for p in self._bpe(tok))
        return ids

    def __call__(self, texts: list[str], length: int) -> torch.Tensor:
        """[len(texts), length]: <|startoftext|> tokens <|endoftext|>, truncated to fit, padded with 0 (as the
        official code)."""
        out = torch.zeros(len(texts), length, dtype=torch.long)
        for i, t in enumerate(texts):
            ids = [self.sot] + self.encode(t)[:length - 2] + [self.eot]
            out[i, :len(ids)] = torch.tensor(ids)
        return out


# ------------------------------------------------------------------------------------------ captioner
class EncoderLayer(nn.Module):
    """Post-LayerNorm transformer encoder layer (BERT style) of the captioning encoder."""

    def __init__(self, dim: int, heads: int, ffn: int, dropout: float):
        super().__init__()
        self.attn = MultiHeadAttention(dim, heads, dropout)
        # The cheap-mask Dropout (pipeline.models.dropout), as the decoder's: nn.Dropout's bernoulli_ was ~15 % of a
        # CPU training step here (measured 2026-11-30, CLIP-FT at the default sizes).
        self.ffn = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(), Dropout(dropout), nn.Linear(ffn, dim))
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.drop1, self.drop2 = Dropout(dropout), Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.norm1(x + self.drop1(self.attn(x, attn_mask=mask)))
        return self.norm2(x + self.drop2(self.ffn(x)))


class Captioner(nn.Module):
    """Captioning encoder over F'(X1, X2), then the shared transformer decoder
    (``pipeline.models.transformer_decoder``: key/value-cached greedy decoding, ``<UNK>`` never emitted) with
    512-d word embeddings (appendix B: d_T = 512) and GELU feed-forward layers as the official BERT-style decoder."""

    def __init__(self, vocab_size: int, dim: int = 512, layers: int = 3, heads: int = 8, ffn: int = 2048,
                 dropout: float = 0.1, max_positions: int = 64, cross_cell_bias: float = 0.0,
                 type_embedding: float = 0.0):
        super().__init__()
        self.encoder = nn.ModuleList(EncoderLayer(dim, heads, ffn, dropout) for _ in range(layers))
        # A deviation when non-zero (module docstring): before / after vectors added at the encoder's input.
        self.type_embedding = nn.Parameter(torch.randn(2, dim) * type_embedding) if type_embedding else None
        # The same deviation as PairEncoder's, for the captioning encoder's joint sequence (CLIP-FT's only one).
        self.cross_cell_bias = nn.Parameter(torch.tensor(float(cross_cell_bias))) if cross_cell_bias else None
        self.decoder = TransformerDecoder(vocab_size, dim=dim, word_dim=dim, heads=heads, layers=layers, ffn_dim=ffn,
                                          dropout=dropout, activation="gelu", max_len=max_positions)

    def memory(self, visual: torch.Tensor) -> torch.Tensor:
        if self.type_embedding is not None:  # [before's T tokens, after's T tokens]
            visual = visual + self.type_embedding.repeat_interleave(visual.size(1) // 2, 0).to(visual.dtype)
        mask = None
        if self.cross_cell_bias is not None:  # [CLS1, n patches, CLS2, n patches]
            mask = cross_cell_scores(self.cross_cell_bias, visual.size(1) // 2 - 1).to(visual.dtype)
        for layer in self.encoder:
            visual = layer(visual, mask)
        return visual

    def forward(self, visual: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: logits [B, L, V] for the next token after each of ``words`` [B, L]."""
        return self.decoder(words, self.memory(visual)).logits

    @torch.no_grad()
    def greedy(self, visual: torch.Tensor, max_len: int) -> torch.Tensor:
        """The image pair and the captioning encoder run once; each step costs one token."""
        return self.decoder.greedy(self.memory(visual), max_len)


# ------------------------------------------------------------------------------------------ models
def _apply_weights(model: nn.Module, weights: str, weights_dir: str, key_map: dict) -> str:
    """Load ``weights`` into ``model`` (random: keep the seeded init). Returns the weights identity."""
    path, identity = resolve_clip_weights(weights, weights_dir)
    if path is not None:
        load_openai(model, read_openai_state(path), key_map, str(path))
    return identity


class CLIP4IDC(CaptionModel):
    """CLIP4IDC / CLIP-FT captioning (registry ids ``clip4idc``, ``clip_ft``, ``clip4idc_no_adapt``,
    ``clip4idc_frozen_intra{N}_inter{M}``); the variant is set by the hyper-parameters, see the module doc."""

    def __init__(self, vocab_size: int, feat_dim: int = 3, weights: str = "random",
                 weights_dir: str = "resources/weights", clip: dict | None = None, n_intra: int = 9,
                 joint_position: bool = True, freeze_encoder: bool = False, encoder_lr_mult: float = 1e-3,
                 layers: int = 3, heads: int = 8, ffn: int = 2048, dropout: float = 0.1, max_positions: int = 64,
                 cross_cell_bias: float = 0.0, encoder_cache_mb: float = 0.0, freeze_intra: bool = False,
                 type_embedding: float = 0.0):
        super().__init__()
        if feat_dim != 3:
            raise PipelineError(f"CLIP4IDC reads raw pixels (backbone clip_pixels224, 3 channels); the feature "
                                f"file given has {feat_dim} channels")
        shape = clip_shape(clip)
        self.encoder = PairEncoder(shape, n_intra, joint_position, cross_cell_bias)
        self.captioner = Captioner(vocab_size, shape.embed_dim, layers, heads, ffn, dropout, max_positions,
                                   cross_cell_bias, type_embedding)
        self.freeze_encoder, self.encoder_lr_mult = freeze_encoder, encoder_lr_mult
        self.weights_identity = "CLIP " + _apply_weights(self, weights, weights_dir, openai_key_map(shape, text=None,
                                                         text_proj=None, logit_scale=None))
        if freeze_encoder:
            self.encoder.requires_grad_(False)
        elif freeze_intra:
            self.encoder.freeze_intra()
        if encoder_cache_mb and not (freeze_encoder or freeze_intra):
            raise PipelineError("model.encoder_cache_mb caches the frozen intra layers' output: it needs "
                                "model.freeze_encoder or model.freeze_intra")
        # Frozen, the intra pass is a fixed function of the image: computed once per image (alone, so that
        # the cached value does not depend on the batch it first came in, and a resumed run equals an
        # uninterrupted one), up to this many bytes. Training then runs the ViT only on new images.
        self.cache_limit = int(encoder_cache_mb * 2 ** 20)
        self._intra_cache: dict[bytes, torch.Tensor] = {}
        # With the whole encoder frozen the joint layers are a fixed function of the pair as well: its F' is kept
        # too (``cached_pairs``), in the same budget.
        self._pair_cache: dict[tuple[int, int], torch.Tensor] = {}
        self._cache_bytes = 0

    # One fused Adam kernel instead of ~10 per tensor: the for-loop Adam over CLIP's 88 M parameters costs
    # several seconds per step on a 2-core CPU, as much as the forward pass of a small batch.
    optimizer_options = {"fused": True}

    def param_groups(self, lr: float) -> list[dict]:
        enc = [p for p in self.encoder.parameters() if p.requires_grad]
        groups = [{"params": [p for p in self.captioner.parameters() if p.requires_grad], "lr": lr}]
        if enc:
            groups.append({"params": enc, "lr": lr * self.encoder_lr_mult})
        return groups

    def init_from(self, state: dict) -> list[str]:
        """Start the vision encoder from an adaptation checkpoint (``encoder.*``; its split must match)."""
        own = self.encoder.state_dict()
        enc = {k[len("encoder."):]: v for k, v in state.items() if k.startswith("encoder.")}
        missing, extra = sorted(set(own) - set(enc)), sorted(set(enc) - set(own))
        if missing:
            raise ValueError(f"the initial checkpoint lacks vision-encoder tensors {missing[:3]}")
        if extra:  # e.g. an adaptation trained with cross_cell_bias, a captioner without it
            raise ValueError(f"the initial checkpoint has vision-encoder tensors this model lacks: {extra[:3]}")
        if not torch.equal(enc["split"], own["split"]):
            raise ValueError(f"the initial checkpoint's encoder has split (intra, inter, joint) = "
                             f"{enc['split'].tolist()}, this model {own['split'].tolist()}")
        bad = [k for k in own if enc[k].shape != own[k].shape]
        if bad:
            raise ValueError(f"the initial checkpoint's {bad[0]} has shape {tuple(enc[bad[0]].shape)}, "
                             f"this model {tuple(own[bad[0]].shape)}")
        self.encoder.load_state_dict({k: enc[k] for k in own})
        self.weights_identity += ", adapted (retrieval)"
        return [f"encoder.{k}" for k in own]

    def encode_pairs(self, before, afters: list, rows: list[int] | None = None) -> torch.Tensor:
        """F' of (before, after) for each after image of ``afters`` (the pairs, then the distractor partners),
        stacked [nB, 2T, D]; the before image's intra pass is shared. ``rows``: the images' feature-file rows in
        the same order (before, then each of ``afters``), the intra cache's keys when given."""
        b = before.size(0)
        if self.freeze_encoder and self.cache_limit:
            return self.cached_pairs(before, afters, rows)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.freeze_encoder):
            h = self.cached_intra([before, *afters], rows) if self.cache_limit else self.encoder.intra(
                torch.cat([before, *afters]))
            hb, *ha = h.split(b)
            return self.encoder.inter(torch.cat([hb] * len(afters)), torch.cat(ha))

    def cached_pairs(self, before, afters: list, rows: list[int] | None = None) -> torch.Tensor:
        """F' of each (before, after) pair as ``encode_pairs`` orders them, for a frozen encoder: from the pair
        cache (keyed by the two images' keys, as ``cached_intra``'s), or computed for that pair alone (its intra
        passes from ``cached_intra``) and kept while the cache is under ``encoder_cache_mb``. Alone, as the intra
        pass: the cached value does not depend on the batch the pair first came in. Measured on the CPU default:
        CLIP4IDC's two joint layers at width 256 were ~30 % of a captioning step."""
        b = before.size(0)
        if rows is None:  # each image hashed once; cached_intra takes these keys as given
            rows = [self.pixel_key(img) for chunk in (before, *afters) for img in chunk]
        out = []
        for j, after in enumerate(afters):
            for i in range(b):
                key = (rows[i], rows[b * (j + 1) + i])
                f = self._pair_cache.get(key)
                if f is None:
                    with torch.no_grad():
                        h = self.cached_intra([before[i:i + 1], after[i:i + 1]], list(key))
                        f = self.encoder.inter(h[:1], h[1:])[0]
                    if self._cache_bytes + f.nbytes <= self.cache_limit:
                        self._pair_cache[key] = f
                        self._cache_bytes += f.nbytes
                out.append(f)
        return torch.stack(out)

    @staticmethod
    def pixel_key(img: torch.Tensor) -> bytes:
        """An image's cache key where its feature-file row is not known: SHA-1 over the array's own buffer
        (hardware-accelerated on x86, ~2x blake2b, measured; no copy)."""
        return hashlib.sha1(np.ascontiguousarray(img.detach().cpu().numpy())).digest()

    def cached_intra(self, pixels: torch.Tensor | list[torch.Tensor], rows: list[int] | None = None) -> torch.Tensor:
        """F_intra of each image, from the cache or computed alone and kept while the cache is under
        ``encoder_cache_mb``; [N, T, width]. ``pixels``: [N, 3, H, W], or a list of such batches taken in order
        (not concatenated: a warm cache only looks the images up). The cache is keyed by ``rows`` where
        given (a training batch's ``*_row``, or ``pixel_key``s already computed), else by ``pixel_key``."""
        images = (img for chunk in (pixels if isinstance(pixels, (list, tuple)) else [pixels]) for img in chunk)
        out = []
        for i, img in enumerate(images):
            # a row: ~1 µs against ~0.5 ms of SHA-1 over a 224-px float image (48 images were ~13 % of a CLIP-FT step)
            key = rows[i] if rows is not None else self.pixel_key(img)
            h = self._intra_cache.get(key)
            if h is None:
                with torch.no_grad():
                    h = self.encoder.intra(img[None])[0]
                if self._cache_bytes + h.nbytes <= self.cache_limit:
                    self._intra_cache[key] = h
                    self._cache_bytes += h.nbytes
            out.append(h)
        return torch.stack(out)

    def training_loss(self, batch):
        b = batch["before"].size(0)
        afters, labels = pair_groups(batch)
        row_keys = ["before_row", "after_row", "distractor_row"][:1 + len(afters)]
        rows = torch.cat([batch[k] for k in row_keys]).tolist() if all(k in batch for k in row_keys) else None
        visual = self.encode_pairs(batch["before"], afters, rows)
        labels = labels[:, :int((labels > 0).sum(1).max())]  # drop all-padding columns
        logits = self.captioner(visual, labels[:, :-1])
        ces = [sequence_ce(logits[sl].float(), labels[sl, 1:]) for sl in group_slices(b, len(afters))]
        loss = ces[0] if len(ces) == 1 else ces[0] + ces[1]  # summed over a pair and its partner, as released
        return loss, ce_parts(ces)

    @torch.no_grad()
    def generate(self, before, after, max_len: int):
        return self.captioner.greedy(self.encoder(before, after), max_len)


class CLIP4IDCAdapt(nn.Module):
    """The IDC adaptation model (§2.3): pair encoder, CLIP text encoder, learned temperature, Eq. 5-8."""

    def __init__(self, text_vocab_size: int, eos_id: int, weights: str = "random",
                 weights_dir: str = "resources/weights", clip: dict | None = None, n_intra: int = 9,
                 joint_position: bool = True, text_tokens: str = "words", encoder_lr_mult: float = 1.0,
                 cross_cell_bias: float = 0.0, freeze_intra: bool = False):
        super().__init__()
        from transformers import CLIPTextModel

        shape = clip_shape(clip)
        if text_tokens not in ("words", "clip_bpe"):
            raise PipelineError(f"text_tokens must be 'words' or 'clip_bpe', got {text_tokens!r}")
        if weights != "random" and text_tokens != "clip_bpe":
            raise PipelineError("CLIP4IDC adaptation with pretrained CLIP weights needs `text_tokens: clip_bpe` "
                                "(the OpenAI text encoder reads CLIP's BPE tokens, not the pipeline's word ids)")
        if text_tokens == "clip_bpe" and text_vocab_size != shape.text_vocab:
            raise PipelineError(f"clip_bpe tokens need a text vocabulary of {shape.text_vocab}, got {text_vocab_size}")
        self.encoder = PairEncoder(shape, n_intra, joint_position, cross_cell_bias)
        self.text = fast_quick_gelu_(CLIPTextModel(_text_config(shape, text_vocab_size, eos_id)))
        self.text_proj = nn.Linear(shape.text_width, shape.embed_dim, bias=False)
        nn.init.normal_(self.text_proj.weight, std=shape.text_width ** -0.5)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))  # CLIP's initial temperature
        self.max_logit_scale = math.log(100.0)
        self.encoder_lr_mult = encoder_lr_mult
        # Pretrained weights come with BPE tokens only (checked above), so the whole OpenAI layout is loaded.
        self.weights_identity = "CLIP " + _apply_weights(self, weights, weights_dir, openai_key_map(shape))
        if freeze_intra:  # a deviation (module docstring): only the joint layers, the text side and tau adapt
            self.encoder.freeze_intra()

    optimizer_options = {"fused": True}

    def param_groups(self, lr: float) -> list[dict]:
        # The official adaptation puts every parameter at lr * coef_lr (all are under ``clip.``); the
        # multiplier defaults to 1 so that ``lr`` is the adaptation learning rate of appendix B (1e-7).
        return [{"params": [p for p in self.parameters() if p.requires_grad], "lr": lr * self.encoder_lr_mult}]

    def pair_embedding(self, before, after) -> torch.Tensor:
        """Eq. 5: mean of the two class tokens of F'(X1, X2), L2-normalised."""
        tokens = self.encoder(before, after)
        t = tokens.size(1) // 2
        return F.normalize(((tokens[:, 0] + tokens[:, t]) / 2).float(), dim=-1)

    def text_embedding(self, ids: torch.Tensor) -> torch.Tensor:
        pooled = self.text(input_ids=ids).pooler_output  # the end token's output (causal mask: padding unseen)
        return F.normalize(self.text_proj(pooled).float(), dim=-1)

    def similarity(self, v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Scaled cosine similarities [texts, pairs]."""
        return self.logit_scale.clamp(max=self.max_logit_scale).exp() * g @ v.t()

    def training_loss(self, batch):
        """Eq. 6-8 on the batch's changed pairs (before, after) and their change captions ``text``."""
        # In-batch negatives: the whole batch's embeddings when several processes share it.
        v = ddp.gather(self.pair_embedding(batch["before"], batch["after"]))
        g = ddp.gather(self.text_embedding(batch["text"]))
        logits = self.similarity(v, g)  # [texts, pairs]
        target = torch.arange(logits.size(0), device=logits.device)
        l_t2i = F.cross_entropy(logits, target)
        l_i2t = F.cross_entropy(logits.t(), target)
        return l_i2t + l_t2i, {"l_i2t": l_i2t.item(), "l_t2i": l_t2i.item(),
                               "temperature": float(1 / self.logit_scale.detach().clamp(max=self.max_logit_scale).exp())}
