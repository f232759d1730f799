"""Every method learns from its images (issue 12, item 5): it overfits 8 pairs, and what it says depends on them.

A fixed batch of 8 synthetic triplets: the "before" images share one base (plus small per-pair noise); each
pair's change is visible only in its semantic "after" (the before plus a pattern at a pair-specific cell of
the grid) and its distractor "after" is the before seen from a shifted viewpoint (rolled by one cell). The 8
changed pairs have 8 distinct captions over a small vocabulary; every distractor pair says "nothing has
changed". Each method is trained on that batch through its own ``training_loss`` (the configured objective of
``config/config.yaml`` with its auxiliary terms, only sizes shrunk and dropout off), with Adam, and must

(a) overfit: the captioning cross-entropy falls ≥ 10× and the whole objective ≥ 5× from the first step, and
    greedy decoding reproduces at least 6 of the 8 changed pairs' captions and the no-change caption on (7 of
    8) distractor pairs;
(b) read the images: decoding pair i's before with pair j's after gives pair j's caption (never pair i's).

A captioner that ignores its images cannot pass (a): the changed and the distractor pair of an index share
their before image; one that reads the before image only cannot pass (b). ``test_checks_reject_a_model_blind_to_
the_after_image`` pins that the checks do fail for such a model.

IDC-PCL without its difference encoder or without distractor judging is a strict xfail: fine-tuned from scratch
(no pre-training) it learns the word order but not to read the change within a test-sized budget, where the
full model does. Whole file: ~4 CPU-minutes on one thread.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from pipeline.config import run_config
from pipeline.data import type_ids
from pipeline.models import build_model
from pipeline.models.common import CaptionModel
from pipeline.text import Vocab

CONFIG = Path(__file__).resolve().parents[1] / "config" / "config.yaml"

# 8 changed pairs (caption, change type) and the distractors' caption.
CHANGES = [("the red cube changed its color", "color"), ("the blue ball changed its color", "color"),
           ("the red ball changed its material", "material"), ("someone added a blue cube", "add"),
           ("someone added a red ball", "add"), ("the blue cube disappeared", "drop"),
           ("the red cube moved", "move"), ("the blue ball moved", "move")]
NO_CHANGE = "nothing has changed"
N, GRID, LENGTH = len(CHANGES), 4, 10  # pairs, grid side, label length (<START> + ≤ 8 words + <END>, padded)
VOCAB = Vocab.build([c for c, _ in CHANGES] + [NO_CHANGE])

# Tiny sizes per model family (everything else comes from the method's block in config/config.yaml).
DUDA = dict(att_hidden=32, embed_dim=32, hidden=64, dropout=0.0, pool=None)  # att_hidden: a multiple of GroupNorm's 32 groups; pool: the 4×4 grid as it is
TRANSFORMER = dict(dim=32, heads=2, layers=1, grid=GRID, word_dim=32, decoder_heads=2, decoder_layers=1,
                   decoder_ffn_dim=64, dropout=0.0, pool=None)  # pool: the 4×4 grid as it is
IDC_PCL = dict(hidden=32, heads=2, ff=64, layers=1, single_layers=1, pair_layers=1, dropout=0.0)
CLIP_SHAPE = dict(vision_width=32, vision_layers=2, vision_heads=2, patch_size=8, image_size=8 * GRID, embed_dim=32,
                  text_width=32, text_layers=1, text_heads=2)
CLIP = dict(clip=CLIP_SHAPE, layers=1, heads=2, ffn=64, dropout=0.0, type_embedding=0.3)  # as on CLEVR-Change
AUX = dict(primary_model=DUDA, embed_dim=32, word_dim=32, img_hidden=32, text_dropout=0.0)

# method -> (model overrides, input kind, Adam steps, lr)
CASES = {
    # DUDA: 500 steps and the auxiliary scheme 700: at 300 the fit passed on this batch but not on other
    # draws of it (data seed 2 for DUDA; the CI machine's arithmetic for DUDA+TIRG easy); at 500/700 data
    # seeds 0-4 all pass.
    "duda": (DUDA, "grid", 500, 3e-3),
    "duda_aux": (AUX, "grid", 700, 3e-3),
    "duda_aux_easy": (AUX, "grid", 700, 3e-3),
    # IDC-PCL: 1500 steps, since its learned image positions (config: img_positions learned) start at std 0.02
    # and this batch's changes are told apart by their cell (300 suffice with the paper's fixed sinusoids). At 600
    # the full model reproduced 6+ captions on the 2026-11-29 machine and CI, 5/8 on an Intel Xeon (torch seeds 1-3,
    # 2026-11-30); at 1500 it passes there with seeds 1-3 and the two ablations still fail (strict xfail below).
    "idc_pcl": (IDC_PCL, "grid", 1500, 1e-3),
    "idc_pcl_no_de": (IDC_PCL, "grid", 1500, 1e-3),
    "idc_pcl_no_dj": (IDC_PCL, "grid", 1500, 1e-3),
    "clip4idc": ({**CLIP, "n_intra": 1}, "pixels", 100, 2e-3),
    "clip_ft": ({**CLIP, "n_intra": 2}, "pixels", 100, 2e-3),
    "scorer_cbr": (TRANSFORMER | dict(cbr_heads=2), "grid", 300, 1e-3),
    "scorer": (TRANSFORMER | dict(cbr_heads=2), "grid", 300, 1e-3),
    "subtraction": (TRANSFORMER | dict(cbr_heads=2), "grid", 300, 1e-3),
    "rr": (TRANSFORMER | dict(cbr_heads=2), "grid", 300, 1e-3),
    "rr_cbr": (TRANSFORMER | dict(cbr_heads=2), "grid", 300, 1e-3),
    "dirl_ccr": (TRANSFORMER | dict(mlp_dim=64), "grid", 300, 1e-3),
    "dirl": (TRANSFORMER | dict(mlp_dim=64), "grid", 300, 1e-3),
    "dirl_nonpert": (TRANSFORMER | dict(mlp_dim=64), "grid", 300, 1e-3),
    "dirl_discrim": (TRANSFORMER | dict(mlp_dim=64), "grid", 300, 1e-3),
    "transformer": (TRANSFORMER | dict(mlp_dim=64), "grid", 300, 1e-3),
    "transformer_ccr": (TRANSFORMER | dict(mlp_dim=64), "grid", 300, 1e-3),
}
FEAT_DIM = {"grid": 32, "pixels": 3}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread is as fast and leaves the machine's other cores alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------ data
def encode(caption: str) -> torch.Tensor:
    ids, _ = VOCAB.encode(caption, LENGTH - 2)
    return torch.from_numpy(ids).long()


def triplets(kind: str, seed: int = 0) -> dict:
    """The fixed batch of ``pipeline.data.TrainBatches``'s contract (``step``/``epoch`` added per step).

    ``grid``: feature maps [8, 32, 4, 4] in [0, ~3]; ``pixels``: images [8, 3, 32, 32] in 0..255, whose 8×8
    patches are the grid cells (CLIP's patch size here)."""
    g = torch.Generator().manual_seed(seed)
    c = FEAT_DIM[kind]
    base = torch.rand(c, GRID, GRID, generator=g)
    before = base + 0.05 * torch.rand(N, c, GRID, GRID, generator=g)
    cells = torch.randperm(GRID * GRID, generator=g)[:N]  # a distinct cell per pair
    patterns = torch.zeros(N, c, GRID * GRID)
    patterns[torch.arange(N), :, cells] = 2.0 * torch.rand(N, c, generator=g) + 0.5
    sc = before + patterns.view(N, c, GRID, GRID)
    nsc = before.roll(1, dims=3)  # a viewpoint shift: every cell differs a little, no object changed
    if kind == "pixels":
        up = lambda x: (F.interpolate(x / 3.0, scale_factor=8, mode="nearest") * 255).clamp(0, 255)
        noise = 20 * torch.rand(1, 3, 8 * GRID, 8 * GRID, generator=g)  # texture shared by every image
        before, sc, nsc = (up(x) * 0.9 + noise for x in (before, sc, nsc))
    return {"before": before, "after": sc, "distractor": nsc,
            "labels": torch.stack([encode(cap) for cap, _ in CHANGES]),
            "distractor_labels": encode(NO_CHANGE).expand(N, -1).clone(),
            "type": torch.tensor([type_ids(t for _, t in CHANGES)[t] for _, t in CHANGES]),
            "changed": torch.ones(N, dtype=torch.bool)}


def words(ids: torch.Tensor) -> str:
    return VOCAB.decode(ids.tolist())


# ------------------------------------------------------------------------------------------ training
def method_hparams(method: str) -> dict:
    # As the method trains on the main table's dataset (CLEVR-Change, with its overrides).
    block = run_config(yaml.safe_load(CONFIG.read_text()), "clevr_change", method)["model"]
    overrides = CASES[method][0]
    merged = {**block, **overrides}
    if "primary_model" in block:  # the auxiliary scheme's captioner: its configured block, shrunk
        merged["primary_model"] = {**block["primary_model"], **overrides["primary_model"]}
    return merged


def build(method: str) -> CaptionModel:
    torch.manual_seed(0)
    return build_model(method, len(VOCAB), FEAT_DIM[CASES[method][1]], method_hparams(method))


def captioning_ce(parts: dict) -> float:
    """The captioning cross-entropy among a step's reported parts: ``ce_pos`` + ``ce_neg`` (``ce`` on plain
    pairs), or IDC-PCL's masked-word loss ``mlm``."""
    return sum(v for k, v in parts.items() if k in ("ce", "ce_pos", "ce_neg", "mlm"))


def fit(model: CaptionModel, batch: dict, steps: int, lr: float) -> tuple[list[float], list[float]]:
    """Adam on the fixed batch through the model's own objective; one step per epoch (8 triplets, batch 8),
    as ``pipeline.data.TrainBatches`` numbers them. Returns every step's loss and captioning cross-entropy."""
    groups = model.param_groups(lr) if hasattr(model, "param_groups") else model.parameters()
    opt = torch.optim.Adam(groups, lr=lr)
    model.train()
    losses, ces = [], []
    for step in range(steps):
        loss, parts = model.training_loss({**batch, "step": torch.tensor(step), "epoch": torch.tensor(step)})
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        ces.append(captioning_ce(parts))
    model.eval()
    return losses, ces


@functools.lru_cache(maxsize=None)
def trained(method: str, blind: bool = False):
    """(model, batch, (losses, captioning CEs)) of one method, trained once per test session (both properties
    read it). ``blind``: the negative control, the model behind ``BlindToAfter``."""
    _, kind, steps, lr = CASES[method]
    batch = triplets(kind)
    model = BlindToAfter(build(method)) if blind else build(method)
    with torch.random.fork_rng():
        torch.manual_seed(1)  # the models' own draws (IDC-PCL's masks, the auxiliary scheme's candidates)
        curves = fit(model, batch, steps, lr)
    return model, batch, curves


class BlindToAfter(CaptionModel):
    """Negative control: a captioner that never sees the after image (it is shown the before image twice)."""

    def __init__(self, inner: CaptionModel):
        super().__init__()
        self.inner = inner

    def training_loss(self, batch):
        return self.inner.training_loss({**batch, "after": batch["before"], "distractor": batch["before"]})

    def generate(self, before, after, max_len):
        return self.inner.generate(before, before, max_len)


# ------------------------------------------------------------------------------------------ checks
def decode(model: CaptionModel, before: torch.Tensor, after: torch.Tensor) -> list[str]:
    return [words(row) for row in model.generate(before, after, LENGTH)]


def mean_last(xs: list[float], n: int = 5) -> float:
    return sum(xs[-n:]) / len(xs[-n:])


def overfit_problems(model, batch, curves) -> list[str]:
    """What is wrong with the fit (empty: it overfits).

    The captioning cross-entropy must fall ≥ 10× from the first step and the whole objective ≥ 5×: the
    contrastive terms (SCORER's alignment, CBR, CCR) cannot go below ~ln 8 on the distractor pairs, whose
    8 captions are the same sentence, so the total of a CCR model bottoms out near 1/12 of its start."""
    losses, ces = curves
    problems = []
    if not all(math.isfinite(x) for x in losses + ces):
        problems.append("non-finite loss")
    if not mean_last(ces) * 10 <= ces[0]:
        problems.append(f"captioning cross-entropy fell only from {ces[0]:.3f} to {mean_last(ces):.3f} (< 10x)")
    if not mean_last(losses) * 5 <= losses[0]:
        problems.append(f"training loss fell only from {losses[0]:.3f} to {mean_last(losses):.3f} (< 5x)")
    said = decode(model, batch["before"], batch["after"])
    hits = sum(s == cap for s, (cap, _) in zip(said, CHANGES))
    if hits < 6:
        problems.append(f"{hits}/8 changed-pair captions reproduced: {said}")
    null = decode(model, batch["before"], batch["distractor"])
    if sum(s == NO_CHANGE for s in null) < 7:
        problems.append(f"distractor pairs decoded as {null}")
    return problems


def image_dependence_problems(model, batch) -> list[str]:
    """What shows that the captions do not follow the after image (empty: they do). Pair i is decoded with
    pair j's after image (j = i + 3 mod 8): never pair i's caption if it had learnt it, and pair j's at
    least 5 times out of 8."""
    own = decode(model, batch["before"], batch["after"])
    j = [(i + 3) % N for i in range(N)]
    swapped = decode(model, batch["before"], batch["after"][j])
    problems = [f"pair {i} with pair {j[i]}'s after image still says {swapped[i]!r}"
                for i in range(N) if own[i] == CHANGES[i][0] and swapped[i] == own[i]]
    follows = sum(swapped[i] == CHANGES[j[i]][0] for i in range(N))
    if follows < 5:
        problems.append(f"only {follows}/8 pairs with another pair's after image say that pair's caption: {swapped}")
    return problems


# ------------------------------------------------------------------------------------------ tests
IDC_PCL_SLOW = pytest.mark.xfail(strict=True, reason=(
    "IDC-PCL without the difference encoder or without distractor judging, fine-tuned from scratch, learns the "
    "captions' word order but not to read the change within this budget (the full model does)"))
PARAMS = [pytest.param(m, marks=IDC_PCL_SLOW) if m in ("idc_pcl_no_de", "idc_pcl_no_dj") else m for m in CASES]


@pytest.mark.parametrize("method", PARAMS)
def test_overfits_eight_pairs(method):
    assert overfit_problems(*trained(method)) == []


@pytest.mark.parametrize("method", PARAMS)
def test_captions_follow_the_after_image(method):
    model, batch, _ = trained(method)
    assert image_dependence_problems(model, batch) == []


def test_checks_reject_a_model_blind_to_the_after_image():
    """The same training and checks on DUDA shown the before image in place of every after image: both fail."""
    model, batch, curves = trained("duda", blind=True)
    assert any("captions reproduced" in p for p in overfit_problems(model, batch, curves))
    assert image_dependence_problems(model, batch) != []


# ------------------------------------------------------------------------------------------ plain pairs
def plain_pairs(kind: str, seed: int = 0) -> dict:
    """A CLEVR-DC-shaped batch, as ``pipeline.data.TrainBatches`` gives it in plain-pair mode: 8 pairs, each its
    own before image, no distractor partner. Pairs 0-5 are changed pairs of ``triplets`` (their semantic after
    image and caption), pairs 6-7 no-change pairs (the viewpoint-shifted after, "nothing has changed")."""
    t = triplets(kind, seed)
    k = 6
    types = [c for _, c in CHANGES[:k]] + ["no_change"] * (N - k)
    ids = type_ids(types)
    return {"before": t["before"], "after": torch.cat([t["after"][:k], t["distractor"][k:]]),
            "labels": torch.cat([t["labels"][:k], t["distractor_labels"][k:]]),
            "type": torch.tensor([ids[c] for c in types]), "changed": torch.arange(N) < k}


@pytest.mark.parametrize("method", list(CASES))
def test_trains_on_plain_pairs(method):
    """Every method's objective runs on plain pairs (no ``distractor`` keys: a model that reads them fails) and
    40 Adam steps on the 8 pairs (IDC-PCL, slower to start: 100) bring its captioning cross-entropy below half
    its first value."""
    _, kind, _, lr = CASES[method]
    batch = plain_pairs(kind)
    model = build(method)
    _, parts = model.training_loss({**batch, "step": torch.tensor(0), "epoch": torch.tensor(0)})
    assert not {"ce_pos", "ce_neg"} & set(parts) and {"ce", "mlm"} & set(parts), parts
    if method in ("idc_pcl", "idc_pcl_no_de"):  # distractor judging: changed against no_change pairs
        assert "dj" in parts
    with torch.random.fork_rng():
        torch.manual_seed(1)
        losses, ces = fit(model, batch, 100 if method.startswith("idc_pcl") else 40, lr)
    assert all(math.isfinite(x) for x in losses + ces)
    assert mean_last(ces) < 0.5 * ces[0], (ces[0], mean_last(ces))
    assert mean_last(losses) < losses[0], (losses[0], mean_last(losses))
