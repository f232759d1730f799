"""Data-parallel training over N processes (``train.devices: N``, launched by torchrun): who this process is,
and the few collectives that make N processes at batch B/N each equal one process at batch B.

Each process holds a contiguous 1/N of the rows of every batch (``shard``: rank 0 the first rows), and the
gradients are averaged over the processes (``average_gradients``). So a loss term that is a mean over rows,
equally many per process, needs nothing more. The other terms use:

- ``mean_over(total, count)``: a mean whose count differs between shards (caption tokens, masked cells) is
  normalised by the count of the whole batch;
- ``gather(x)``: a term over the whole batch (in-batch negatives, correlations over samples, candidate sets)
  is computed on the rows of every process, identically in each; its gradient reaches every row's process;
- ``draw(fn, shape)``: random draws made per row are drawn for the whole batch in every process (all
  processes are seeded alike, so their generators stay in step) and cut to the process's rows; ``any`` and
  ``max_int`` make the decisions that steer a draw (or a shape) the same everywhere.

With one process, or inside ``alone()`` (validation runs on rank 0 only), every helper is the identity, so
one-process training computes exactly what it did before this module existed.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline.errors import PipelineError

_alone = False


def active() -> bool:
    return not _alone and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world() -> int:
    return dist.get_world_size() if active() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


@contextlib.contextmanager
def alone():
    """Run one process's code (rank 0's validation) without collectives: the helpers act as with N = 1."""
    global _alone
    prev, _alone = _alone, True
    try:
        yield
    finally:
        _alone = prev


def requested(hparams: str | None) -> int:
    """``train.devices`` of a stage's ``--hparams`` (1 when absent; a malformed text is the stage's to report)."""
    try:
        return int(json.loads(hparams or "{}").get("train", {}).get("devices", 1))
    except (ValueError, TypeError, AttributeError):
        return 1


def relaunch(argv: list[str], n: int) -> int | None:
    """Run ``python -m pipeline <argv>`` again as N processes under torchrun (``torch.distributed.run``, the
    same interpreter), inside the caller's job; returns its exit status. None: nothing to do (N = 1, or this
    process is one of the N already)."""
    if n <= 1 or "WORLD_SIZE" in os.environ:
        return None
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           "-m", "pipeline", *argv]
    print(f"launching {n} processes: {' '.join(cmd)}", flush=True)
    return subprocess.call(cmd)


def process_threads(requested: int) -> int:
    """Torch threads of each of the N processes: the job's ``--threads`` (0: every core) shared among them."""
    n = int(os.environ.get("WORLD_SIZE", "1"))
    if n == 1:
        return requested
    from pipeline.utils.seed import available_cores

    return max(1, (requested or available_cores()) // n)


def setup(device_name: str = "auto") -> torch.device:
    """Join the process group when launched by torchrun (``WORLD_SIZE`` > 1): NCCL and one GPU per process
    where CUDA is, gloo on the CPU. Returns this process's device."""
    n = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() and device_name in ("auto", "cuda")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    # One GPU per process: NCCL refuses two ranks on one GPU, and rank k without a GPU k would stop on a raw
    # "invalid device ordinal" (seen on a one-GPU H200 with train.devices: 2, 2026-11-30).
    if cuda and local >= torch.cuda.device_count():
        raise PipelineError(f"train.devices: {n} runs one process per GPU (NCCL), but this machine has "
                            f"{torch.cuda.device_count()} GPU(s): lower train.devices, or train on the CPU "
                            f"(--device cpu: gloo)")
    if n > 1 and not dist.is_initialized():
        # Rank 0 validates alone while the others wait: the default 30 min would cut a long validation.
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=6))
    if cuda:
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu" if device_name == "auto" else device_name)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def shard(batch: dict) -> dict:
    """This process's rows of a batch: every tensor with a leading dimension is cut into ``world()`` equal
    blocks (scalars such as ``step`` stay whole)."""
    n = world()
    if n == 1:
        return batch
    r, out = rank(), {}
    for k, v in batch.items():
        if v.dim() == 0:
            out[k] = v
            continue
        if v.size(0) % n:
            raise PipelineError(f"batch entry {k!r} has {v.size(0)} rows, not divisible by train.devices = {n}")
        m = v.size(0) // n
        out[k] = v[r * m:(r + 1) * m]
    return out


class _Gather(torch.autograd.Function):
    """All processes' rows in rank order; the backward pass sums every process's gradient of a row and
    hands it to the row's process (each process computes the same whole-batch term)."""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        ctx.rows = x.size(0)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        r = dist.get_rank()
        return g[r * ctx.rows:(r + 1) * ctx.rows]


def gather(x: torch.Tensor) -> torch.Tensor:
    """The whole batch's rows of ``x`` (rows of equal count in every process), differentiable."""
    if not active():
        return x
    if x.requires_grad:
        return _Gather.apply(x)
    if x.dtype == torch.bool:  # gloo gathers no bools
        return gather(x.to(torch.uint8)).bool()
    parts = [torch.empty_like(x) for _ in range(world())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def rows(x: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """This process's rows of a whole-batch tensor (the inverse of ``gather``). ``groups``: the rows are that
    many stacked blocks of the batch (pairs, then their distractor partners), each cut alike."""
    n = world()
    if n == 1:
        return x
    blocks = x.chunk(groups)
    m = blocks[0].size(0) // n
    return torch.cat([blk[rank() * m:(rank() + 1) * m] for blk in blocks])


def draw(fn, shape, groups: int = 1) -> torch.Tensor:
    """``fn(shape)`` drawn for the whole batch (leading dimension x N), cut to this process's rows."""
    shape = tuple(shape)
    return rows(fn((shape[0] * world(), *shape[1:])), groups)


def _reduced(x: torch.Tensor, op=None) -> torch.Tensor:
    """The all-reduced copy of ``x`` (on the device NCCL needs: counts and flags are often made on the CPU)."""
    home = x.device
    x = x.detach().to(_comm_device(), copy=True)
    dist.all_reduce(x, op=op or dist.ReduceOp.SUM)
    return x.to(home)


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mean_over(total: torch.Tensor, count: torch.Tensor, floor: float | None = None) -> torch.Tensor:
    """``total / count`` over the whole batch: this process's ``total`` over the batch's count, times N (the
    gradient average divides by N again). ``floor`` clamps the count from below, as one process did."""
    if not active():
        return total / (count if floor is None else count.clamp(min=floor))
    count = _reduced(torch.as_tensor(count, dtype=torch.float64, device=total.device))
    if floor is not None:
        count = count.clamp(min=floor)
    return total * world() / count.to(total.dtype)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy`` (mean over the rows) over the whole batch's rows, however many each process has."""
    if not active():
        return F.cross_entropy(logits, target)
    return mean_over(F.cross_entropy(logits, target, reduction="sum"), torch.tensor(float(target.numel())))


def mean(x: torch.Tensor) -> torch.Tensor:
    """``x.mean()`` over the elements of the whole batch (the shards may hold different counts)."""
    if not active():
        return x.mean()
    return mean_over(x.sum(), torch.tensor(float(x.numel()), device=x.device))


def any(flag: torch.Tensor) -> bool:  # noqa: A001 - the collective twin of Tensor.any
    if not active():
        return bool(flag.any())
    return bool(_reduced(flag.any().to(torch.int64).reshape(1)).item())


def max_int(n: int) -> int:
    if not active():
        return n
    return int(_reduced(torch.tensor([n], dtype=torch.int64), dist.ReduceOp.MAX).item())


def sum_int(n: int) -> int:
    if not active():
        return n
    return int(_reduced(torch.tensor([n], dtype=torch.int64)).item())


def average_gradients(params: list[torch.Tensor]) -> None:
    """Average the gradients over the processes, one flat buffer per dtype. A parameter no process used this
    step keeps ``grad is None`` (as in one process, so Adam skips it); one used by only some gets zeros."""
    n = world()
    if n == 1:
        return
    present = _reduced(torch.tensor([p.grad is not None for p in params], dtype=torch.int64))
    used = [p for p, k in zip(params, present.tolist()) if k]
    for p in used:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for dtype in sorted({p.grad.dtype for p in used}, key=str):
        grads = [p.grad for p in used if p.grad.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= n
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def mean_scalars(values: dict) -> dict:
    """The mean over the processes of each number in ``values`` (keys some process lacks: over those with it)."""
    if world() == 1:
        return values
    every = [None] * world()
    dist.all_gather_object(every, values)
    out = {}
    for k, v in values.items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, (int, float)):
            got = [d[k].item() if isinstance(d.get(k), torch.Tensor) else d[k] for d in every if k in d]
            out[k] = sum(float(x) for x in got) / len(got)
        else:
            out[k] = v
    return out


def broadcast(value):
    """Rank 0's ``value`` in every process (a picklable object)."""
    if world() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if world() > 1:
        dist.barrier()
