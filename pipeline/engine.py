"""The training engine: optimisation steps, periodic validation, checkpoint selection, resumption.

No file formats here beyond the checkpoint: data comes from a ``batch(step)`` callable and validation
from a ``validate(model) -> (score, extra[, eligible])`` callable, so every method trains through the same loop.

Resumption: every ``val_every`` steps the full state (model, optimiser, scheduler, RNG, step, best
score, history, and the selected weights themselves) is saved to ``resume.pt``; a restarted run with the
same configuration continues from it and ends with exactly the weights and selection an uninterrupted run
would have (batches are a pure function of the step, see ``pipeline.data``). ``resume.pt`` is not a
declared output, so it survives what Snakemake does to an interrupted job (it deletes the job's outputs,
``checkpoint.pt`` included): the engine writes ``checkpoint.pt`` again from the copy in ``resume.pt``.
Checkpoints are byte-identical between identical runs, resumed or not (``save``).

Logging (``log(record)``, which the stages append to ``<run_dir>/train_log.jsonl``): ``{"event": "started"}``
or ``{"event": "resumed", "step"}`` when a session begins, then one record per validation: ``step``, ``loss``
and every numeric part returned by ``training_loss`` as their MEANS over the steps since the previous
validation (a part present in only some steps, e.g. one pre-training task of several, is averaged over the
steps that returned it), ``train_steps`` (how many steps were averaged), ``lr`` (after the step),
``val_score`` and ``elapsed_s`` (training seconds since step 0, summed over resumed sessions; the time lost
between the last validation and an interruption is not counted). The averages restart at every validation,
which is when the resume state is saved, so a resumed run logs what an uninterrupted one would.
``TrainLog`` is that file: a fresh start empties it, a resumed session first cuts it back to the resumed step
(the records an interrupted session logged after its last saved state are not repeated twice).

Several processes (``train.devices: N``, ``pipeline.distributed``): each trains on its 1/N of every batch and
the gradients are averaged, so N processes take the steps one process takes at the same batch size. Every
process reads ``resume.pt`` when it starts; only rank 0 validates, logs and writes files, and the loss it logs
is the mean over the processes (what one process would have logged).
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from pipeline import distributed as ddp
from pipeline.errors import PipelineError
from pipeline.utils.io import atomic_path, remove_stale_temporaries


class LossMeans:
    """Running sums of the loss and of each numeric part since the last validation (``means`` resets them)."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.steps = 0

    def add(self, loss: float, parts: dict) -> None:
        self.steps += 1
        values = {**parts, "loss": loss}  # a part named "loss" cannot shadow the total
        for k, v in values.items():
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if isinstance(v, (int, float)):  # bools and ints too (e.g. a stage flag: its mean is a fraction)
                self.sums[k] = self.sums.get(k, 0.0) + float(v)
                self.counts[k] = self.counts.get(k, 0) + 1

    def means(self) -> dict:
        keys = ["loss"] + [k for k in self.sums if k != "loss"]
        out = {k: self.sums[k] / self.counts[k] for k in keys if k in self.sums}
        out["train_steps"] = self.steps
        self.__init__()
        return out


@dataclass
class TrainConfig:
    iterations: int
    lr: float
    batch_size: int
    val_every: int
    weight_decay: float = 0.0
    lr_step_epochs: float | None = None  # StepLR in epochs (DUDA); None = constant
    lr_gamma: float = 0.1
    warmup_steps: int = 0
    grad_clip: float | None = None
    betas: tuple[float, float] = (0.9, 0.999)
    noam: bool = False  # after the warm-up, lr ∝ 1/√step (the Transformer/Noam schedule; IDC-PCL pre-training)
    # After the warm-up, lr falls linearly to 0 at ``iterations`` (BertAdam's ``warmup_linear``: CLIP4IDC's official
    # schedule in both stages).
    linear_decay: bool = False
    precision: str = "auto"  # see ``autocast``
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise TypeError(f"precision {self.precision!r}: expected one of {sorted(PRECISIONS)}")


PRECISIONS = {"auto", "bf16", "fast", "fp32"}


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` runs bf16 matrix products in hardware (CUDA, or a CPU with AVX512-BF16 or AMX).

    oneDNN's own check (``torch.ops.mkldnn._is_mkldnn_bf16_supported``) is true on any AVX-512 CPU because it
    emulates bf16 there, and that emulation is slow: measured on a 2-core AVX-512 Xeon without AVX512-BF16
    (2026-12-03), a 2048^2 product runs at 307 GFLOP/s in fp32 and 63 in bf16. So an x86 CPU also needs the
    instruction itself (torch's cpuinfo queries); elsewhere (ARM) oneDNN's check already asks the hardware.
    """
    if device.type == "cuda":
        return True
    if device.type != "cpu" or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolved_precision(device: torch.device, precision: str) -> str:
    """The autocast actually used: ``bf16`` or ``fp32`` (what a run records)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {sorted(PRECISIONS)}")
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if precision == "fast":
        return "bf16" if native_bf16(device) else "fp32"
    return precision


def autocast(device: torch.device, precision: str = "auto"):
    """The autocast context of training and decoding.

    ``auto``: bf16 autocast on CUDA, plain fp32 elsewhere (the default). ``bf16``: bf16 autocast on any device;
    on a CPU with AMX or AVX512-BF16 the linear layers run about 3x faster (SCORER+CBR step at batch 32:
    5.3 -> 3.7 s, DIRL+CCR 4.3 -> 1.8 s on the development machine), on other CPUs it is slower than fp32.
    ``fast``: bf16 where the hardware runs it natively (CUDA; a CPU with AVX512-BF16 or AMX), fp32 elsewhere,
    so a CPU-sized default is never slowed down by emulated bf16 (the run records which, ``resolved_precision``).
    ``fp32``: never (also on CUDA). Token-wise matching keeps float32 on a CPU either way.
    """
    bf16 = resolved_precision(device, precision) == "bf16"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


def config_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def lr_factor(step: int, cfg: TrainConfig, steps_per_epoch: float) -> float:
    f = 1.0
    if cfg.warmup_steps:
        f *= min(1.0, (step + 1) / cfg.warmup_steps)
        if cfg.noam:
            f *= min(1.0, math.sqrt(cfg.warmup_steps / (step + 1)))
    if cfg.linear_decay and step >= cfg.warmup_steps:
        f *= max(0.0, (cfg.iterations - step) / (cfg.iterations - cfg.warmup_steps))
    if cfg.lr_step_epochs:
        # Decay applied at the start of each epoch block, as the official DUDA schedule does.
        epoch = math.floor(step / steps_per_epoch)
        f *= cfg.lr_gamma ** (epoch // cfg.lr_step_epochs)
    return f


# Part of the resume key: a resume.pt of an older layout (without the selected weights) is not resumed.
RESUME_FORMAT = 2


def save(path: Path, obj) -> None:
    """``torch.save`` atomically and reproducibly: given a path, torch names the zip archive's records after
    the file (here a random temporary name), so the same weights gave different bytes; a file object makes
    it use the fixed name ``archive``."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        torch.save(obj, f)


def load_checkpoint(path: str | Path) -> dict:
    """A checkpoint written by ``save``; a missing, truncated or foreign file raises PipelineError naming it."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"missing checkpoint: {path}")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, EOFError, UnpicklingError, ... by cause
        raise PipelineError(f"{path}: not a readable checkpoint (truncated or corrupt? {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}); delete it and run its stage again") from None
    if not isinstance(ck, dict) or "model" not in ck:
        raise PipelineError(f"{path}: not a checkpoint of this pipeline (no 'model' entry)")
    return ck


def discard_resume_state(run_dir: Path) -> None:
    """Delete ``resume.pt`` once a stage has written all its outputs: it only serves to continue an interrupted
    run (a finished run is never resumed: another configuration starts over, the same one is up to date),
    and it is large (optimiser moments: 1.3-1.5 GB for each CLIP run). Temporaries a killed save left go too."""
    resume = Path(run_dir) / "resume.pt"
    resume.unlink(missing_ok=True)
    remove_stale_temporaries(resume)


class TrainLog:
    """``<run_dir>/train_log.jsonl``: each record is printed (the job's log) and appended to the file.

    ``rewind(step)`` is called by ``train`` when a session begins: at step 0 the file is emptied (a fresh
    start does not keep a dead run's history), when resuming it keeps the records up to the validation record
    of the resumed step (what the interrupted session logged after its last saved state is logged again)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __call__(self, rec: dict) -> None:
        print(json.dumps(rec), flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def rewind(self, step: int) -> None:
        lines = self.path.read_text().splitlines() if step > 0 and self.path.is_file() else []
        keep = 0
        for i, line in enumerate(lines):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill: nothing after it is kept
                break
            if isinstance(rec, dict) and rec.get("step") == step and "val_score" in rec:
                keep = i + 1
        with atomic_path(self.path) as tmp:
            tmp.write_text("".join(line + "\n" for line in lines[:keep]))


def _quiet(rec: dict) -> None:
    """The log of a process other than rank 0."""


def train(model: torch.nn.Module, batch: Callable[[int], dict], validate: Callable, cfg: TrainConfig,
          run_dir: Path, n_train: int, device: torch.device, identity: dict,
          on_best: Callable[[dict], None] | None = None, log: Callable[[dict], None] = print,
          stop_after: int | None = None) -> dict:
    """Train for ``cfg.iterations`` steps; return the selection summary.

    ``identity`` (method, config, seed, data) is hashed into the resume state: a state written under
    another configuration is ignored. ``on_best(extra)`` is called when validation improves (the caller
    stores what it wants, e.g. validation predictions). ``stop_after`` simulates an interruption (tests).
    """
    main = ddp.is_main()
    if cfg.batch_size % ddp.world():
        raise PipelineError(f"train.batch_size {cfg.batch_size} is not divisible by train.devices = {ddp.world()}: "
                            f"every process takes an equal share of each batch")
    if not main:  # only rank 0 writes the log
        log = _quiet
    run_dir.mkdir(parents=True, exist_ok=True)
    resume_path, best_path = run_dir / "resume.pt", run_dir / "checkpoint.pt"
    key = config_hash({"identity": identity, "resume_format": RESUME_FORMAT})
    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    # A model may ask for per-part learning rates (e.g. CLIP4IDC: 1e-7 for the CLIP encoder, 1e-4 elsewhere)
    # with ``param_groups(lr) -> [{"params": [...], "lr": ...}]``; the schedule scales every group alike.
    groups = model.param_groups(cfg.lr) if hasattr(model, "param_groups") else params
    # A model may also pass options to Adam (e.g. IDC-PCL: ``{"fused": True}``, one pass over its 17M parameters).
    opt = torch.optim.Adam(groups, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                           **getattr(model, "optimizer_options", {}))
    steps_per_epoch = n_train / cfg.batch_size
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg, steps_per_epoch))
    state = {"step": 0, "best_score": -math.inf, "best_step": None, "best_eligible": False, "history": []}
    best = None  # the selected checkpoint's content (weights cloned): kept in resume.pt too
    notes = []
    ck = None
    if resume_path.exists():
        try:
            ck = torch.load(resume_path, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - only state for resuming: an unreadable one means starting over
            notes.append({"event": f"resume state unreadable ({type(e).__name__}): starting over",
                          "path": str(resume_path)})
    if isinstance(ck, dict) and ck.get("key") == key:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        torch.set_rng_state(ck["torch_rng"])
        if device.type == "cuda" and ck.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(ck["cuda_rng"])
        state, best = ck["state"], ck["best"]
        if best is not None and main:
            # Snakemake deletes checkpoint.pt (a declared output) of an interrupted job; same bytes as before.
            save(best_path, best)
    del ck
    if hasattr(log, "rewind"):
        log.rewind(state["step"])
    for note in notes:
        log(note)
    if state["step"] == 0:
        log({"event": "started", "step": 0, "iterations": cfg.iterations, "val_every": cfg.val_every})
    else:
        log({"event": "resumed", "step": state["step"]})
    mixed = autocast(device, cfg.precision)
    t0, step0 = time.time(), state["step"]
    elapsed0 = state.get("elapsed_s", 0.0)  # training seconds of earlier sessions (up to their last validation)
    means = LossMeans()
    bar = tqdm(total=cfg.iterations, initial=state["step"], desc="train", unit="step", mininterval=5, disable=not main)
    while state["step"] < cfg.iterations:
        step = state["step"]
        model.train()
        b = {k: v.to(device, non_blocking=True) for k, v in ddp.shard(batch(step)).items()}
        with mixed:
            loss, parts = model.training_loss(b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        ddp.average_gradients(params)
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        state["step"] = step + 1
        bar.update(1)
        # The processes' mean: the one-process loss (pipeline.distributed); parts likewise.
        avg = ddp.mean_scalars({**parts, "loss": loss.detach()})
        loss_value = float(avg.pop("loss"))
        parts = {k: avg[k] for k in parts}
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss became {loss_value} at step {step}")
        means.add(loss_value, parts)
        if state["step"] % cfg.val_every == 0 or state["step"] == cfg.iterations:
            model.eval()
            train_means = means.means()
            score, extra, eligible = None, None, True
            if main:
                with ddp.alone():
                    score, extra, *rest = validate(model)
                    eligible = bool(rest[0]) if rest else True
            score, eligible = ddp.broadcast((score, eligible))
            state["elapsed_s"] = elapsed0 + (time.time() - t0)
            rec = {"step": state["step"], **train_means, "lr": sched.get_last_lr()[0],
                   "val_score": score, **({} if eligible else {"eligible": False}),
                   "elapsed_s": round(state["elapsed_s"], 1)}
            state["history"].append(rec)
            log(rec)
            # (eligible, score) order: an eligible checkpoint beats any ineligible one (train.select_min_distinct)
            if (eligible, score) > (state.get("best_eligible", True), state["best_score"]):
                state["best_score"], state["best_step"], state["best_eligible"] = score, state["step"], eligible
                if main:
                    # A copy on the CPU: training goes on changing the live tensors.
                    best = {"model": {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
                            "step": state["step"], "score": score, "identity": identity}
                    save(best_path, best)
                    if on_best:
                        on_best(extra)
            if main:
                save(resume_path, {"key": key, "model": model.state_dict(), "optimizer": opt.state_dict(),
                                   "scheduler": sched.state_dict(), "torch_rng": torch.get_rng_state(),
                                   "cuda_rng": torch.cuda.get_rng_state() if device.type == "cuda" else None,
                                   "state": state, "best": best})
        if stop_after is not None and state["step"] >= stop_after:
            break
    bar.close()
    ddp.barrier()  # the other processes end once rank 0 has written its files
    steps_done = state["step"] - step0
    return {"best_step": state["best_step"], "best_score": state["best_score"], "history": state["history"],
            "steps_per_s": steps_done / max(time.time() - t0, 1e-9), "finished": state["step"] >= cfg.iterations}
