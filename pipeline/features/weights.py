"""Backbone weights policy (DESIGN.md "Pretrained weights").

``weights`` in the config / ``--weights`` on the command line is one of

- ``random``: seeded random init (:func:`pipeline.features.backbones.init_random_`); identity ``random(seed=S)``;
- ``imagenet``: torchvision's ImageNet ResNet-101 (``IMAGENET1K_V1``, ``resnet101-63fe2227.pth``, the file the
  papers used), looked up as ``<weights_dir>/resnet101-63fe2227.pth``, otherwise downloaded from its published
  URL (resumable ``.part`` + HTTP Range, sha256 prefix verified, atomic rename); identity ``sha256:<hex>``;
- a path to a local torchvision-layout state dict; identity ``sha256:<hex>`` of that file.

When the ImageNet file cannot be had (offline), :func:`resolve_weights` raises one PipelineError that says which
file to place where, and that ``weights: random`` is the explicit alternative. Nothing falls back silently.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.utils.download import download, sha256_file

@dataclass(frozen=True)
class PublishedWeights:
    name: str            # file name; torchvision puts the first 8 hex digits of the sha256 in it
    url: str
    sha256_prefix: str
    description: str


IMAGENET_RESNET101 = PublishedWeights(
    name="resnet101-63fe2227.pth",
    url="https://download.pytorch.org/models/resnet101-63fe2227.pth",
    sha256_prefix="63fe2227",
    description="torchvision ResNet-101 ImageNet weights (IMAGENET1K_V1)",
)


@dataclass(frozen=True)
class ResolvedWeights:
    kind: str                 # "random" | "file"
    identity: str             # "random(seed=S)" | "sha256:<hex>"
    path: Path | None = None  # the state dict file for kind "file"
    seed: int | None = None   # the init seed for kind "random"


# --------------------------------------------------------------------------------------------- policy
def resolve_weights(spec: str, weights_dir: str | os.PathLike = "resources/weights", seed: int = 0,
                    url: str | None = None, download_ok: bool = True, timeout: float = 30.0) -> ResolvedWeights:
    """Turn a ``weights`` setting into a file (or a seed) and its identity; see the module docstring.

    ``url`` overrides the published ImageNet URL (tests, mirrors); ``download_ok=False`` never touches the
    network.
    """
    spec = str(spec).strip()
    if spec == "random":
        return ResolvedWeights("random", f"random(seed={int(seed)})", seed=int(seed))
    if spec == "imagenet":
        pub = IMAGENET_RESNET101
        target = Path(weights_dir) / pub.name
        if not target.exists():
            if not download_ok:
                raise PipelineError(_missing_message(pub, target, "downloads are disabled"))
            try:
                download(url or pub.url, target, sha256_prefix=pub.sha256_prefix, timeout=timeout)
            except (urllib.error.URLError, OSError, TimeoutError) as e:  # offline, refused, DNS, timeout
                reason = getattr(e, "reason", None) or e
                raise PipelineError(_missing_message(pub, target, f"download from {url or pub.url} failed: "
                                                                  f"{reason}")) from None
        digest = sha256_file(target)
        if not digest.startswith(pub.sha256_prefix):
            raise PipelineError(f"{target}: sha256 {digest} does not start with {pub.sha256_prefix}, so it is not "
                                f"{pub.description}; replace it with the file from {pub.url}")
        return ResolvedWeights("file", f"sha256:{digest}", path=target)
    path = Path(spec)
    if not path.is_file():
        raise PipelineError(f"weights file {path} does not exist (weights: expects 'random', 'imagenet' or the "
                            f"path of a torchvision-layout ResNet-101 state dict)")
    return ResolvedWeights("file", f"sha256:{sha256_file(path)}", path=path)


def _missing_message(pub: PublishedWeights, target: Path, why: str) -> str:
    return (f"{pub.description} not available ({why}): download {pub.url} and place it at {target} "
            f"(sha256 starting {pub.sha256_prefix}), or set `weights: random` (--weights random) to run "
            f"explicitly with randomly initialised backbone weights")


def load_state_dict_file(path: str | os.PathLike):
    """Read a state dict saved with ``torch.save`` (tensors only: ``weights_only=True``)."""
    import torch

    from pipeline.features.backbones import unwrap_state_dict

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a bad file
        raise PipelineError(f"cannot read weights file {path}: {e}") from None
    try:
        return unwrap_state_dict(obj)
    except PipelineError as e:
        raise PipelineError(f"{path}: {e}") from None


def apply_weights(model, resolved: ResolvedWeights, calibration=None):
    """Set ``model``'s (a truncated transformers ResNet) weights from a resolved ``weights`` setting;
    ``calibration`` (random weights only): the image batch BatchNorm statistics are calibrated on."""
    from pipeline.features.backbones import init_random_, load_torchvision_state_dict

    if resolved.kind == "random":
        return init_random_(model, 0 if resolved.seed is None else resolved.seed, calibration)
    state = load_state_dict_file(resolved.path)
    return load_torchvision_state_dict(model, state, source=str(resolved.path))


__all__ = ["IMAGENET_RESNET101", "PublishedWeights", "ResolvedWeights", "apply_weights", "download",
           "load_state_dict_file", "resolve_weights", "sha256_file"]
