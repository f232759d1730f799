"""Model factory: method id → constructor. One file per model."""

from __future__ import annotations

import importlib
import re

# method id -> (module, class name)
REGISTRY: dict[str, tuple[str, str]] = {
    "duda": ("pipeline.models.duda", "DUDA"),
    # DUDA trained with the TIRG auxiliary task; the two ids differ only in `model.candidates` (config).
    "duda_aux": ("pipeline.models.aux_training", "AuxiliaryTraining"),
    "duda_aux_easy": ("pipeline.models.aux_training", "AuxiliaryTraining"),
    # IDC-PCL and the variants of its Table 4: one class; pre-training run (`init_from`) and `model:` differ.
    **{m: ("pipeline.models.idc_pcl", "IDCPCL") for m in
       ("idc_pcl", "idc_pcl_no_pretrain", "idc_pcl_mlm", "idc_pcl_mlm_mvcl", "idc_pcl_no_de", "idc_pcl_no_dj",
        "idc_pcl_cub", "idc_pcl_nabirds", "idc_pcl_cub_nabirds")},
    # CLIP4IDC and its CLIP-FT baseline and ablations: one class, the variant set by `model:` (config).
    "clip_ft": ("pipeline.models.clip4idc", "CLIP4IDC"),
    "clip4idc": ("pipeline.models.clip4idc", "CLIP4IDC"),
    "clip4idc_no_adapt": ("pipeline.models.clip4idc", "CLIP4IDC"),
    # SCORER + CBR and the ablations of its Table 6: one class per variant (the variant is not a config knob).
    "subtraction": ("pipeline.models.scorer", "Subtraction"),
    "rr": ("pipeline.models.scorer", "RR"),
    "rr_cbr": ("pipeline.models.scorer", "RRCBR"),
    "scorer": ("pipeline.models.scorer", "SCORER"),
    "scorer_cbr": ("pipeline.models.scorer", "SCORERCBR"),
    # DIRL + CCR and the ablations of its Tables 6 and 7 ("Transformer + DIRL" is `dirl`).
    "transformer": ("pipeline.models.dirl", "Transformer"),
    "dirl": ("pipeline.models.dirl", "DIRL"),
    "dirl_nonpert": ("pipeline.models.dirl", "DIRLNonPerturbation"),  # Table 7: Eq. (4)'s first term only
    "dirl_discrim": ("pipeline.models.dirl", "DIRLDiscrimination"),  # Table 7: its second term only
    "transformer_ccr": ("pipeline.models.dirl", "TransformerCCR"),
    "dirl_ccr": ("pipeline.models.dirl", "DIRLCCR"),
}


# CLIP4IDC Table 7: the frozen-encoder sweep, one id per split of the encoder's layers (12 for ViT-B/32 in
# config/paper.yaml, 6 for the CPU-sized ViT of config/config.yaml); the split itself is in `model:`.
PATTERNS: list[tuple[re.Pattern, tuple[str, str]]] = [
    (re.compile(r"clip4idc_frozen_intra\d+_inter\d+"), ("pipeline.models.clip4idc", "CLIP4IDC")),
]


def lookup(method: str) -> tuple[str, str] | None:
    """(module, class) of a method id, or None."""
    if method in REGISTRY:
        return REGISTRY[method]
    return next((target for pattern, target in PATTERNS if pattern.fullmatch(method)), None)


# Attention maps a model family exposes to the report (pipeline.attention_maps), by the module of its class:
# DUDA's dual spatial attention, the SCORER and DIRL families' decoder attention over the difference tokens.
ATTENTION = {"pipeline.models.duda": "dual", "pipeline.models.scorer": "token", "pipeline.models.dirl": "token"}


def attention_kind(method: str) -> str | None:
    """``dual``, ``token`` or None (no attention map) for a method id."""
    target = lookup(method)
    return ATTENTION.get(target[0]) if target else None


def build_model(method: str, vocab_size: int, feat_dim: int, hparams: dict):
    target = lookup(method)
    if target is None:
        from pipeline.errors import PipelineError

        raise PipelineError(f"unknown method {method!r}; known: {sorted(REGISTRY)} and "
                            f"{[p.pattern for p, _ in PATTERNS]}")
    module, cls = target
    return getattr(importlib.import_module(module), cls)(vocab_size=vocab_size, feat_dim=feat_dim, **hparams)
