"""ResNet-101 trunks (``transformers`` architecture) for feature extraction.

Backbone ids:

- ``resnet101_layer3``: stem + ``layer1..layer3`` → 1024 × H/16 × W/16 (1024×14×14 at 224²; DUDA, SCORER, DIRL)
- ``resnet101_layer4``: stem + ``layer1..layer4`` → 2048 × H/32 × W/32 (2048×7×7 at 224²; IDC-PCL)

The architecture is ``transformers.ResNetModel`` with bottleneck blocks, depths [3, 4, 23, 3] and the stride
in the 3×3 convolution (``downsample_in_bottleneck=False``), i.e. torchvision's ResNet v1.5, truncated to the
stages the backbone keeps. :func:`load_torchvision_state_dict` maps a torchvision-layout state dict
(``conv1.weight``, ``bn1.*``, ``layer{i}.{j}.conv{k}.weight``, ``layer{i}.{j}.bn{k}.*``,
``layer{i}.0.downsample.{0,1}.*``) onto it key for key.

For inference, :func:`prepare_for_inference` folds every BatchNorm into the convolution before it (exact in
eval mode) and switches to channels_last; :class:`Extractor` runs it under ``inference_mode`` with bf16
autocast on CUDA.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass

import torch
from torch import nn
import torch.nn.functional as F

from pipeline.errors import PipelineError

# ResNet-101 (torchvision ``resnet101``): bottleneck, expansion 4.
RESNET101_DEPTHS = (3, 4, 23, 3)
RESNET101_WIDTHS = (256, 512, 1024, 2048)
STEM_WIDTH = 64
BN_EPS = 1e-5  # torchvision's and transformers' BatchNorm2d default


@dataclass(frozen=True)
class BackboneSpec:
    id: str
    layer: str        # the last stage kept, torchvision name
    n_stages: int     # how many of layer1..layer4 are kept
    stride: int       # total downsampling factor of the output map

    @property
    def channels(self) -> int:
        return RESNET101_WIDTHS[self.n_stages - 1]

    def output_shape(self, image_size: int) -> tuple[int, int, int]:
        """(C, H, W) of the feature map for a square ``image_size`` input."""
        side = image_size
        # stem conv (stride 2, pad 3, k 7), max-pool (stride 2, pad 1, k 3), then one stride-2 3×3 per stage ≥ 2
        side = (side + 2 * 3 - 7) // 2 + 1
        side = (side + 2 * 1 - 3) // 2 + 1
        for _ in range(self.n_stages - 1):
            side = (side + 2 * 1 - 3) // 2 + 1
        return (self.channels, side, side)


BACKBONES: dict[str, BackboneSpec] = {
    "resnet101_layer3": BackboneSpec("resnet101_layer3", "layer3", 3, 16),
    "resnet101_layer4": BackboneSpec("resnet101_layer4", "layer4", 4, 32),
}


def get_spec(backbone_id: str) -> BackboneSpec:
    try:
        return BACKBONES[backbone_id]
    except KeyError:
        raise PipelineError(
            f"unknown backbone {backbone_id!r}; known: {', '.join(sorted(BACKBONES))}") from None


def make_config(backbone_id: str, depths: tuple[int, ...] | None = None):
    """The ``transformers.ResNetConfig`` of a backbone; ``depths`` overrides the block counts (tests use a
    shallow trunk)."""
    from transformers import ResNetConfig

    spec = get_spec(backbone_id)
    depths = tuple(RESNET101_DEPTHS[: spec.n_stages] if depths is None else depths)
    if len(depths) != spec.n_stages:
        raise PipelineError(f"backbone {backbone_id}: expected {spec.n_stages} depths, got {list(depths)}")
    return ResNetConfig(
        num_channels=3,
        embedding_size=STEM_WIDTH,
        hidden_sizes=list(RESNET101_WIDTHS[: spec.n_stages]),
        depths=list(depths),
        layer_type="bottleneck",
        hidden_act="relu",
        downsample_in_first_stage=False,   # layer1 keeps the resolution (as torchvision)
        downsample_in_bottleneck=False,    # stride in the 3×3 conv: ResNet v1.5 (as torchvision)
    )


def build_backbone(backbone_id: str, depths: tuple[int, ...] | None = None):
    """A truncated ``transformers.ResNetModel`` in eval mode. Its weights are transformers' default init;
    use :func:`init_random_` (seeded) or :func:`load_torchvision_state_dict` to set them."""
    from transformers import ResNetModel

    model = ResNetModel(make_config(backbone_id, depths))
    model.eval()
    return model


def forward_features(model: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """The feature map of the last kept stage, [B, C, h, w]."""
    return model(pixels, return_dict=False)[0]


# ----------------------------------------------------------------------------------------------- init
def init_random_(model: nn.Module, seed: int, calibration: torch.Tensor | None = None) -> nn.Module:
    """Seeded random init, independent of transformers' init code (so it does not change between versions).

    Conv weights are Kaiming-normal (fan_out, ReLU) as torchvision's, BatchNorm γ=1, β=0, except the last
    BatchNorm of every residual branch: γ=0 (torchvision's ``zero_init_residual``, Goyal et al. 2017), so each
    bottleneck starts as its shortcut. Why: with γ=1 the 23 random residual branches of layer3 make the
    features chaotic: on the synthetic CLEVR-Change, the largest per-location feature change separated a
    semantic change from a camera/light distractor in 50% of triplets (chance), against 65% with zero-init
    residuals (84% for colour changes) and 88% on 14×14-downsampled pixels; DUDA then learnt only to say
    "no change". The price: the trunk reduces to the stem and the strided 1×1 shortcuts, so a layer3 cell reads
    one 11×11-pixel patch every 16 pixels (layer4: every 32); measured alternatives (README, CLEVR-DC) gain
    little. With identity BatchNorm statistics a random ResNet-101 grows its activations to ~1e4-1e5 at layer3/layer4 (beyond
    float16), so the BatchNorm running statistics are then calibrated (:func:`calibrate_batchnorm_`) on
    ``calibration``, a batch of normalised images — the extract stage passes a fixed sample of the
    dataset's own images (the extract stage then rescales the output to a fixed mean activation). Without
    it, a seeded Gaussian noise batch is used (data-free; on smooth rendered images this leaves the features
    ~100× larger: fine for tests, not for training). Deterministic for a seed on a given machine (CPU).
    """
    from transformers.models.resnet.modeling_resnet import ResNetBottleNeckLayer

    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    with torch.no_grad():
        for _, module in model.named_modules():
            if isinstance(module, nn.Conv2d):
                fan_out = module.out_channels * module.kernel_size[0] * module.kernel_size[1] // module.groups
                w = torch.empty(module.weight.shape, dtype=torch.float32)
                w.normal_(0.0, math.sqrt(2.0 / fan_out), generator=gen)
                module.weight.copy_(w)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.BatchNorm2d):
                module.weight.fill_(1.0)
                module.bias.zero_()
                module.running_mean.zero_()
                module.running_var.fill_(1.0)
                if module.num_batches_tracked is not None:
                    module.num_batches_tracked.zero_()
        for module in model.modules():
            if isinstance(module, ResNetBottleNeckLayer):
                module.layer[-1].normalization.weight.zero_()  # zero_init_residual
    if calibration is None:
        calibration = torch.randn((4, 3, 128, 128), generator=gen, dtype=torch.float32)
    return calibrate_batchnorm_(model, calibration)


def avg_down_(model: nn.Module) -> int:
    """Give every strided shortcut of the trunk ResNet-D's "average down" form (He et al. 2019, Bag of Tricks
    §4.1): a 2×2 average pool, then the 1×1 convolution at stride 1, instead of the 1×1 convolution at stride 2
    that reads one pixel in four. Only for ``weights: random``: a trained trunk's shortcuts were trained strided.
    Why: with zero-init residuals (:func:`init_random_`) the trunk is its shortcuts, so a strided layer4 cell
    reads one 11×11-pixel patch every 32 pixels; averaged, it summarises its whole 32×32 block. Measured on the
    synthetic Birds-to-Words photos (900 birds, logistic probe on pooled layer4 features, 3-fold): crown colour
    0.35 → 0.78, breast colour 0.60 → 0.94, tail colour 0.30 → 0.77 (majority 0.13-0.17). Call before the
    weights are applied (the BatchNorm calibration must see the new trunk). Returns how many shortcuts changed."""
    from transformers.models.resnet.modeling_resnet import ResNetBottleNeckLayer

    n = 0
    for module in model.modules():
        shortcut = getattr(module, "shortcut", None) if isinstance(module, ResNetBottleNeckLayer) else None
        conv = getattr(shortcut, "convolution", None)
        if isinstance(conv, nn.Conv2d) and conv.stride == (2, 2):
            conv.stride = (1, 1)
            # ceil_mode: odd maps give ceil(h/2) cells, as the residual branch's stride-2 3×3 convolution does
            module.shortcut = nn.Sequential(nn.AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False), shortcut)
            n += 1
    if n == 0:
        raise PipelineError("avg_down_: no strided shortcut found (not a transformers ResNet, or already changed?)")
    return n


def calibrate_batchnorm_(model: nn.Module, pixels: torch.Tensor) -> nn.Module:
    """Set every BatchNorm's running statistics to those of its input on ``pixels`` (one batch), so each
    normalises that batch to zero mean and unit variance."""
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    saved = [(m.momentum, m.training) for m in bns]
    for m in bns:
        m.momentum = None  # cumulative average: one batch → exactly its statistics
        m.train()
    device = next(model.parameters()).device
    with torch.no_grad():
        forward_features(model, pixels.to(device))
    for m, (momentum, training) in zip(bns, saved):
        m.momentum = momentum
        m.train(training)
        m.num_batches_tracked.zero_()
    return model


# ------------------------------------------------------------------------------ torchvision key mapping
_TV_STEM = re.compile(r"^(conv1\.weight|bn1\.(weight|bias|running_mean|running_var|num_batches_tracked))$")
_TV_BLOCK = re.compile(
    r"^layer([1-4])\.(\d+)\.(conv[123]\.weight|bn[123]\.(weight|bias|running_mean|running_var|num_batches_tracked)"
    r"|downsample\.0\.weight|downsample\.1\.(weight|bias|running_mean|running_var|num_batches_tracked))$")


def torchvision_to_transformers_key(key: str) -> str | None:
    """Map one torchvision ResNet key to the transformers ``ResNetModel`` key; None for ``fc.*``.
    Raises KeyError for a key that is not part of a torchvision ResNet."""
    if key.startswith("fc."):
        return None
    if _TV_STEM.match(key):
        name, field = key.split(".", 1)
        part = "convolution" if name == "conv1" else "normalization"
        return f"embedder.embedder.{part}.{field}"
    m = _TV_BLOCK.match(key)
    if not m:
        raise KeyError(key)
    stage, block = int(m.group(1)) - 1, int(m.group(2))
    rest = key.split(".", 2)[2]
    prefix = f"encoder.stages.{stage}.layers.{block}"
    head, field = rest.split(".", 1)
    if head == "downsample":
        idx, field = field.split(".", 1)
        part = "convolution" if idx == "0" else "normalization"
        return f"{prefix}.shortcut.{part}.{field}"
    k = int(head[-1]) - 1
    part = "convolution" if head.startswith("conv") else "normalization"
    return f"{prefix}.layer.{k}.{part}.{field}"


def unwrap_state_dict(obj) -> dict[str, torch.Tensor]:
    """Accept a bare state dict, or one wrapped as ``{"state_dict": ...}`` / ``{"model": ...}``, with an
    optional ``module.`` (DataParallel) prefix."""
    if isinstance(obj, dict):
        for wrapper in ("state_dict", "model"):
            inner = obj.get(wrapper)
            if isinstance(inner, dict) and not isinstance(obj.get("conv1.weight"), torch.Tensor):
                obj = inner
                break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise PipelineError("weights file does not hold a state dict of tensors")
    if obj and all(k.startswith("module.") for k in obj):
        obj = {k[len("module."):]: v for k, v in obj.items()}
    return obj


def load_torchvision_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str = "state dict"
                                ) -> nn.Module:
    """Copy a torchvision-layout ResNet state dict onto a (truncated) transformers ``ResNetModel``.

    Every tensor the model needs must come from ``state_dict`` with the same shape (``num_batches_tracked``
    may be absent, as in old checkpoints). Keys of stages the trunk does not keep (``layer4.*`` for layer3)
    and ``fc.*`` are ignored; any other key the mapping does not know is an error. Errors name the keys.
    """
    target = model.state_dict()
    mapped: dict[str, torch.Tensor] = {}
    unknown, extra, bad_shape = [], [], []
    for key, value in state_dict.items():
        try:
            tkey = torchvision_to_transformers_key(key)
        except KeyError:
            unknown.append(key)
            continue
        if tkey is None:
            continue  # classifier head
        if tkey not in target:
            # A stage (or a block) this trunk does not have: fine for a deeper stage, not for an extra block.
            m = re.match(r"^layer(\d)\.", key)
            n_stages = len(model.config.depths)
            if m and int(m.group(1)) > n_stages:
                continue
            extra.append(key)
            continue
        if tuple(value.shape) != tuple(target[tkey].shape):
            bad_shape.append(f"{key} {tuple(value.shape)} -> {tkey} {tuple(target[tkey].shape)}")
            continue
        mapped[tkey] = value
    missing = [k for k in target if k not in mapped and not k.endswith("num_batches_tracked")]
    problems = []
    if unknown:
        problems.append(f"unknown keys (not a torchvision ResNet): {_short(unknown)}")
    if extra:
        problems.append(f"keys with no counterpart in the {len(model.config.depths)}-stage trunk "
                        f"(depths {list(model.config.depths)}): {_short(extra)}")
    if bad_shape:
        problems.append(f"shape mismatches: {_short(bad_shape)}")
    if missing:
        problems.append(f"missing keys (transformers names): {_short(missing)}")
    if problems:
        raise PipelineError(f"cannot load {source} into the ResNet trunk: " + "; ".join(problems))
    for k in target:
        if k not in mapped:  # num_batches_tracked absent from the source
            mapped[k] = target[k]
    model.load_state_dict(mapped, strict=True)
    return model


def _short(items: list[str], n: int = 8) -> str:
    more = f" ... (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more


# --------------------------------------------------------------------------------- inference speed-ups
def _fold_conv_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> None:
    """Fold an eval-mode BatchNorm into ``conv`` in place: w' = w·γ/σ, b' = (b − μ)·γ/σ + β (computed in
    float64, then cast back)."""
    w = conv.weight.detach().double()
    # on the weight's device: a model already on the GPU (benchmarks/bench_features.py --device cuda) folds there
    b = (conv.bias.detach().double() if conv.bias is not None
         else torch.zeros(w.shape[0], dtype=torch.float64, device=w.device))
    scale = bn.weight.detach().double() / torch.sqrt(bn.running_var.detach().double() + bn.eps)
    new_w = w * scale.reshape(-1, 1, 1, 1)
    new_b = (b - bn.running_mean.detach().double()) * scale + bn.bias.detach().double()
    conv.weight = nn.Parameter(new_w.to(conv.weight.dtype), requires_grad=False)
    conv.bias = nn.Parameter(new_b.to(conv.weight.dtype), requires_grad=False)


def fold_batchnorm(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every conv→BatchNorm pair (``ResNetConvLayer`` and ``ResNetShortCut``) folded
    into a single biased conv. Exact up to float rounding in eval mode; the copy is in eval mode."""
    model = copy.deepcopy(model).eval()
    n = 0
    for module in model.modules():
        conv = getattr(module, "convolution", None)
        bn = getattr(module, "normalization", None)
        if isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d):
            _fold_conv_bn(conv, bn)
            module.normalization = nn.Identity()
            n += 1
        act = getattr(module, "activation", None)
        if isinstance(act, nn.ReLU):
            act.inplace = True  # safe: every ReLU in the trunk acts on a fresh tensor
    if n == 0:
        raise PipelineError("fold_batchnorm: no conv/BatchNorm pairs found (not a transformers ResNet?)")
    return model


class ShortcutOnly(nn.Module):
    """A bottleneck block whose residual branch is exactly zero: ``activation(shortcut(x) + 0)``."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.shortcut, self.activation = block.shortcut, block.activation

    def forward(self, x):
        return self.activation(self.shortcut(x))


def drop_zero_residuals(model: nn.Module) -> int:
    """Replace, in a BatchNorm-folded trunk, every bottleneck whose last conv has all-zero weights and bias
    (its residual branch outputs exact zeros: the zero-init residuals of ``weights: random``) by
    :class:`ShortcutOnly`. Exact, and it skips ~90 % of a random trunk's work; a trained trunk has no such
    block. Returns how many blocks were replaced."""
    from transformers.models.resnet.modeling_resnet import ResNetBottleNeckLayer

    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, ResNetBottleNeckLayer):
                last = child.layer[-1]
                conv = last.convolution
                if (isinstance(last.normalization, nn.Identity) and not conv.weight.any()
                        and (conv.bias is None or not conv.bias.any())):
                    setattr(parent, name, ShortcutOnly(child))
                    n += 1
    return n


def prepare_for_inference(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """The fast inference copy: BatchNorm folded, zero residual branches skipped, channels_last, eval, no
    grads, on ``device``."""
    model = fold_batchnorm(model)
    drop_zero_residuals(model)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.to(device=torch.device(device), memory_format=torch.channels_last)


CPU_MICRO_BATCH = 8  # measured on the 2-core dev machine: batch 32 runs ~20 % faster as 4 chunks of 8


class Extractor:
    """Runs a prepared trunk on a float32 NCHW batch; returns float32 NCHW (contiguous) on the CPU.

    On CUDA it uses bf16 autocast and the whole batch at once; on CPU plain fp32 (bf16 autocast is slower
    there: performance-anchors.md), in chunks of ``micro_batch`` images, which keeps the activations of a
    chunk in cache (same results as one pass: every image is computed independently in eval mode).
    """

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu", autocast: bool | None = None,
                 micro_batch: int | None = None, output_scale: float = 1.0, output_pool: int = 0):
        self.device = torch.device(device)
        self.model = model
        self.output_scale = float(output_scale)  # random backbones only: see pipeline.features.extract
        self.output_pool = int(output_pool)  # average-pool the grid to this side (0: as it is; extract --pool)
        self.autocast = (self.device.type == "cuda") if autocast is None else autocast
        if micro_batch is None:
            micro_batch = CPU_MICRO_BATCH if self.device.type == "cpu" else 0
        self.micro_batch = int(micro_batch)

    @classmethod
    def from_model(cls, model: nn.Module, device: torch.device | str = "cpu", **kw) -> "Extractor":
        return cls(prepare_for_inference(model, device), device, **kw)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        if self.autocast:
            with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16):
                y = forward_features(self.model, x)
        else:
            y = forward_features(self.model, x)
        y = y.float()
        if self.output_pool and y.shape[-1] != self.output_pool:
            y = F.avg_pool2d(y, y.shape[-1] // self.output_pool)
        y = y.contiguous().cpu()
        return y * self.output_scale if self.output_scale != 1.0 else y

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            n, step = pixels.shape[0], self.micro_batch
            if step <= 0 or n <= step:
                return self._run(pixels)
            first = self._run(pixels[:step])
            out = torch.empty((n,) + tuple(first.shape[1:]), dtype=first.dtype)
            out[:step] = first
            for i in range(step, n, step):
                out[i:i + step] = self._run(pixels[i:i + step])
            return out
