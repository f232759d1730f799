"""Every method of a table at the configuration's own sizes: seconds per training step, steps to the validation
plateau and the whole job's time per stage, side by side.

- Step time: the method's model built from its ``model:`` block (config/config.yaml by default), one
  training step (forward, loss, backward, Adam step as ``pipeline.engine`` builds it, under the engine's
  autocast for ``train.precision``) on a random batch of the method's ``train.batch_size`` with the right
  shapes (``benchmarks/batches.py``: ResNet layer3 1024×14×14 or as ``features.<backbone>.pool`` stores it, layer4
  2048×7×7, CLIP pixels 3×224×224),
  median after one warm-up, wall and process CPU time. The reference is a DUDA step at the ``duda`` block's
  sizes measured in the same run, before and after the others (its drift is printed): ``x DUDA`` is each
  method's step time over the mean of the two.
- Plateau: from an existing run's ``results/<dataset>/<method>/seed<k>/train_log.jsonl`` (the last run logged
  there, ``pipeline.plots.read_log``): the first validation step whose score is within 1 % of the best, out
  of the configured steps; ``n/a`` without a log.
- Stage times: Snakemake's benchmark files ``logs/benchmarks/<dataset>/<run>/seed<k>/*.tsv`` (column ``s``,
  mean over seeds) of the method's training and of its first stage (``init_from``: pre-training or adaptation);
  ``n/a`` where the job has not run here.

    python benchmarks/bench_methods.py [--table clevr_change] [--methods duda scorer ...] [--steps 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import time
from pathlib import Path

import torch
import yaml

from batches import feature_batch
from pipeline.config import run_config
from pipeline.engine import autocast
from pipeline.models import build_model

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 80  # CLEVR-Change vocabulary (76) + the special tokens
# The backbones' grids at 224 px; main() applies the configuration's stored pooling.
SHAPES = {"resnet101_layer3": (1024, 14, 14), "resnet101_layer4": (2048, 7, 7), "clip_pixels224": (3, 224, 224)}
PLATEAU = 0.01  # within 1 % of the best validation score


def make_batch(backbone: str, b: int, device, seed: int = 0) -> dict:
    batch = feature_batch(b, vocab=VOCAB, seed=seed)
    shape = SHAPES[backbone]
    g = torch.Generator().manual_seed(seed + 1)
    for k in ("before", "after", "distractor"):
        if backbone == "clip_pixels224":  # the pixel cache holds uint8 values, read as float
            batch[k] = torch.randint(0, 256, (b, *shape), generator=g).float()
        else:
            batch[k] = torch.randn(b, *shape, generator=g)
    return {k: v.to(device) for k, v in batch.items()}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_time(method: str, block: dict, steps: int, device) -> tuple[float, float]:
    """Median wall and process-CPU seconds of one training step (after one warm-up step)."""
    torch.manual_seed(0)
    shape = SHAPES[block["backbone"]]
    model = build_model(method, VOCAB, shape[0], dict(block.get("model", {}))).to(device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    lr = block["train"].get("lr", 1e-4)
    groups = model.param_groups(lr) if hasattr(model, "param_groups") else params
    opt = torch.optim.Adam(groups, lr=lr, **getattr(model, "optimizer_options", {}))
    batch = make_batch(block["backbone"], block["train"]["batch_size"], device)
    mixed = autocast(device, block["train"].get("precision", "auto"))
    wall, cpu = [], []
    for i in range(steps + 1):
        batch["step"] = torch.tensor(i)
        sync(device)
        t, c = time.perf_counter(), time.process_time()
        with mixed:
            loss, _ = model.training_loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync(device)
        if i:
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
    del model, opt
    return statistics.median(wall), statistics.median(cpu)


def plateau(results: Path, dataset: str, method: str, seeds, iterations) -> str:
    from pipeline.plots import read_log

    found = []
    for s in seeds:
        log = results / dataset / method / f"seed{s}" / "train_log.jsonl"
        recs = read_log(log) if log.exists() else []
        if not recs:
            continue
        best = max(r["val_score"] for r in recs)
        first = next(r["step"] for r in recs if r["val_score"] >= best - PLATEAU * abs(best))
        found.append(f"{first}/{recs[-1]['step']}" + (f" (seed {s})" if len(seeds) > 1 else ""))
    return "; ".join(found) if found else "n/a"


def stage_seconds(logs: Path, dataset: str, run: str | None, seeds) -> str:
    if not run:
        return "-"
    secs = []
    for s in seeds:
        for tsv in sorted((logs / dataset / run / f"seed{s}").glob("*.tsv")):
            with open(tsv, newline="") as f:
                rows = list(csv.DictReader(f, delimiter="\t"))
            secs += [float(r["s"]) for r in rows if r.get("s")]
    return f"{statistics.mean(secs):.0f}" if secs else "n/a"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(ROOT / "config" / "config.yaml"))
    ap.add_argument("--table", default="clevr_change")
    ap.add_argument("--methods", nargs="*", help="default: the table's methods")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per method (after one warm-up)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--results", default=str(ROOT / "results"))
    ap.add_argument("--logs", default=str(ROOT / "logs" / "benchmarks"))
    ap.add_argument("--json", help="also write the rows to this JSON file")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    cfg = yaml.safe_load(Path(a.config).read_text())
    for backbone, settings in cfg.get("features", {}).items():  # a grid stored pooled (features.<backbone>.pool)
        pool = settings.get("pool") or 0
        if backbone in SHAPES and 0 < pool < SHAPES[backbone][1]:
            SHAPES[backbone] = (SHAPES[backbone][0], pool, pool)
    table = cfg["tables"][a.table]
    dataset = table.get("dataset", a.table)
    methods = a.methods or table["methods"]
    seeds = cfg.get("seeds", [0])
    load = "" if device.type == "cuda" else f", load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    print(f"{a.table}: {len(methods)} methods at {Path(a.config).name} sizes, {device.type}, torch threads "
          f"{torch.get_num_threads()}{load}")

    # Each block as it trains on the table's dataset (its datasets.<dataset>.overrides merged in), as the DAG runs it.
    blocks = {m: run_config(cfg, dataset, m) for m in {*methods, "duda"}}
    ref_before = step_time("duda", blocks["duda"], a.steps, device)
    rows = []
    for m in methods:
        block = blocks[m]
        wall, cpu = step_time(m, block, a.steps, device)
        rows.append({"method": m, "backbone": block["backbone"], "batch": block["train"]["batch_size"],
                     "steps": block["train"].get("iterations"), "s_per_step": wall, "cpu_s_per_step": cpu})
        print(f"  measured {m}: {wall:.3f} s/step", flush=True)
    ref_after = step_time("duda", blocks["duda"], a.steps, device)
    ref = (ref_before[0] + ref_after[0]) / 2
    logs, results = Path(a.logs), Path(a.results)
    for r in rows:
        block = blocks[r["method"]]
        r["x_duda"] = r["s_per_step"] / ref
        r["plateau"] = plateau(results, dataset, r["method"], seeds, r["steps"])
        r["train_job_s"] = stage_seconds(logs, dataset, r["method"], seeds)
        r["first_stage"] = block.get("init_from") or "-"
        r["first_stage_job_s"] = stage_seconds(logs, dataset, block.get("init_from"), seeds)

    head = ("method", "backbone", "batch", "s/step", "CPU s/step", "x DUDA", "steps", "steps x s/step",
            "plateau step/last", "train job s", "first stage", "first stage job s")
    lines = [head] + [(r["method"], r["backbone"], str(r["batch"]), f"{r['s_per_step']:.3f}", f"{r['cpu_s_per_step']:.3f}",
                       f"{r['x_duda']:.2f}", str(r["steps"]),
                       f"{r['steps'] * r['s_per_step']:.0f}" if isinstance(r["steps"], int) else "n/a",
                       r["plateau"], r["train_job_s"], r["first_stage"], r["first_stage_job_s"]) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for i, line in enumerate(lines):
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print(f"reference: DUDA step {ref_before[0]:.3f} s before, {ref_after[0]:.3f} s after the others "
          f"(drift {100 * (ref_after[0] / ref_before[0] - 1):+.0f}%); plateau = first validation within "
          f"{100 * PLATEAU:.0f}% of the best; job times from {logs} (n/a: not run here)")
    if a.json:
        Path(a.json).write_text(json.dumps({"reference_duda_s": ref, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
