"""Stage ``pretrain-idc-pcl``: IDC-PCL pre-training (MLM, MVCL, FDA), the first stage of ``idc_pcl``.

One task per batch, alternated with the configured ratio (CLEVR-Change: MLM:MVCL:FDA = 8:1:2, §3.1). The
official code draws the task of each batch at random with these weights; here the tasks follow a fixed
interleaved cycle with exactly those counts (``task_cycle``), so a short run sees the intended mix.
MLM and MVCL batches hold ``batch_size`` (pair, caption) samples of the training split, changed and
distractor pairs alike, each with one of its captions; an FDA batch holds ``batch_size // (1 + K)`` pairs,
each with one caption and its K constructed negatives (``results/<dataset>/text/negatives.jsonl``), as the
official loader (200 // 7 = 28 pairs). Every batch is a pure function of (seed, step).

Training goes through ``pipeline.engine.train`` (Adam, warm-up, optionally the Noam decay of the official
code; resumable). Pre-training has no model selection in the official code (its last checkpoint is used),
so neither here: validation measures masked-word accuracy, the MVCL NCE and FDA ranking accuracy on fixed
validation batches (logged), and ``checkpoint.pt`` holds the weights after the last step.
Writes ``<run-dir>/checkpoint.pt`` (``{"model": state_dict, ...}``), ``train_log.jsonl``, ``pretrain.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import h5py
import numpy as np
import torch

from pipeline import distributed as ddp
from pipeline.datasets.manifest import load as load_manifest
from pipeline.engine import TrainLog, discard_resume_state, load_checkpoint, resolved_precision, train
from pipeline.errors import PipelineError
from pipeline.features.store import FeatureStore
from pipeline.models.idc_pcl import TASKS, IDCPCL
from pipeline.text import Labels, Vocab
from pipeline.train import parse_hparams
from pipeline.utils.io import write_json
from pipeline.utils.seed import seed_everything, set_threads


def task_cycle(ratios: dict[str, int]) -> list[str]:
    """One period of the task schedule: each task ``r`` times in ``sum(r)`` batches, spread evenly
    (the k-th batch of task t sits at (k + ½) / r_t of the period)."""
    unknown = set(ratios) - set(TASKS)
    if unknown:
        raise PipelineError(f"pre-training tasks: unknown {sorted(unknown)} (known: {list(TASKS)})")
    slots = [((k + 0.5) / r, TASKS.index(t), t) for t, r in ratios.items() if r > 0 for k in range(r)]
    if not slots:
        raise PipelineError("pre-training tasks: every ratio is 0")
    return [t for _, _, t in sorted(slots)]


class PretrainBatches:
    """Batches of the pre-training tasks; ``batch(step)`` depends only on (seed, step)."""

    def __init__(self, records: list[dict], labels: Labels, store, vocab: Vocab, max_words: int,
                 negatives: list[dict] | None, batch_size: int, seed: int, ratios: dict[str, int]):
        self.pairs = [(r["pair_id"], r["before"], r["after"]) for r in records]
        if not self.pairs:
            raise PipelineError("pre-training: no pairs")
        self.labels, self.store, self.vocab, self.max_words = labels, store, vocab, max_words
        self.cycle = task_cycle(ratios)
        self.batch_size, self.seed = batch_size, seed
        self.negatives = negatives or []
        if "fda" in self.cycle:
            if not self.negatives:
                raise PipelineError("pre-training task fda needs the negatives file (none given or it is empty)")
            k = {len(r["neg_samples"]) for r in self.negatives}
            if len(k) != 1:
                raise PipelineError(f"negatives: records differ in their number of negatives {sorted(k)}")
            self.n_neg = k.pop()
            self.fda_pairs = max(1, batch_size // (1 + self.n_neg))
            by_pair = {p for p, _, _ in self.pairs}
            missing = [r["pair_id"] for r in self.negatives if r["pair_id"] not in by_pair]
            if missing:
                raise PipelineError(f"negatives: pair {missing[0]!r} is not in this split of the manifest")
            self.pair_of = {p: (b, a) for p, b, a in self.pairs}

    def task(self, step: int) -> str:
        return self.cycle[step % len(self.cycle)]

    def encode(self, caption: str) -> np.ndarray:
        return self.vocab.encode(caption, self.max_words)[0]

    def batch(self, step: int, stream: int = 0) -> dict:
        task = self.task(step)
        rng = np.random.default_rng([self.seed, stream, step])
        if task == "fda":
            picks = rng.choice(len(self.negatives), self.fda_pairs, replace=len(self.negatives) < self.fda_pairs)
            recs = [self.negatives[int(i)] for i in picks]
            text = np.stack([np.stack([self.encode(c) for c in [r["sentences"][0], *r["neg_samples"]]]) for r in recs])
            befores = [self.pair_of[r["pair_id"]][0] for r in recs]
            afters = [self.pair_of[r["pair_id"]][1] for r in recs]
        else:
            picks = rng.choice(len(self.pairs), self.batch_size, replace=len(self.pairs) < self.batch_size)
            chosen = [self.pairs[int(i)] for i in picks]
            text = []
            for pair_id, _, _ in chosen:
                caps = self.labels.of(pair_id)
                text.append(caps[rng.integers(len(caps))])
            text = np.stack(text)
            befores, afters = [c[1] for c in chosen], [c[2] for c in chosen]
        return {"task": torch.tensor(TASKS.index(task)),
                "img1": torch.from_numpy(self.store.get_many(befores)),
                "img2": torch.from_numpy(self.store.get_many(afters)),
                "text": torch.from_numpy(text.astype(np.int64))}


@torch.no_grad()
def evaluate(model: IDCPCL, batches: PretrainBatches, n_batches: int, device, seed: int) -> dict:
    """MLM accuracy, MVCL NCE and FDA accuracy on fixed validation batches (masks drawn from ``seed``;
    the global RNG is left as it was, so validation does not change the training run)."""
    model.eval()
    sums: dict[str, list[float]] = {}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        done = {t: 0 for t in set(batches.cycle)}
        step = 0
        while any(n < n_batches for n in done.values()) and step < 10 * n_batches * len(batches.cycle):
            task = batches.task(step)
            if done[task] < n_batches:
                b = {k: v.to(device) for k, v in batches.batch(step, stream=1).items()}
                _, parts = model.pretraining_loss(b)
                for k, v in parts.items():
                    sums.setdefault(f"val_{k}", []).append(v)
                done[task] += 1
            step += 1
    model.train()
    return {k: round(float(np.mean(v)), 5) for k, v in sums.items()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", required=True, help="pre-training run name (config key under pretraining:)")
    p.add_argument("--dataset", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--hparams", required=True, help="JSON: {'model': {...}, 'tasks': {...}, 'train': {...}}")
    p.add_argument("--manifest", required=True)
    p.add_argument("--text-dir", required=True)
    p.add_argument("--features", required=True)
    p.add_argument("--negatives", default=None, help="negatives.jsonl (needed when the fda ratio is > 0)")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--cross-task", default=None, help="JSON of the cross-task inputs (pipeline.cross_task)")
    p.add_argument("--val-batches", type=int, default=2, help="validation batches per task")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0)


def run(args: argparse.Namespace) -> None:
    from pipeline import negatives as ng

    set_threads(ddp.process_threads(args.threads))
    seed_everything(args.seed)  # the same in every process: their random draws stay in step
    device = ddp.setup(args.device)  # launched by torchrun (train.devices > 1): one process of N
    try:
        hp = json.loads(args.hparams)
    except json.JSONDecodeError as e:
        raise PipelineError(f"--hparams is not valid JSON: {e}") from None
    model_hp, cfg = parse_hparams(json.dumps({"model": hp.get("model", {}), "train": hp.get("train", {})}))
    ratios = {k: int(v) for k, v in hp.get("tasks", {"mlm": 8, "mvcl": 1, "fda": 2}).items()}
    cycle = task_cycle(ratios)
    run_dir = Path(args.run_dir)
    records = load_manifest(args.manifest)
    splits = {s: [r for r in records if r["split"] == s] for s in ("train", "val")}
    if not splits["train"] or not splits["val"]:
        raise PipelineError(f"{args.manifest}: pre-training needs train and val pairs")
    text_dir = Path(args.text_dir)
    vocab = Vocab.load(text_dir / "vocab.json")
    labels = Labels(text_dir / "labels.h5")
    with h5py.File(text_dir / "labels.h5", "r") as f:
        max_words = int(f.attrs["max_words"])
    negs = {"train": None, "val": None}
    if "fda" in cycle:
        if not args.negatives:
            raise PipelineError("pre-training task fda needs --negatives (results/<dataset>/text/negatives.jsonl)")
        allneg = ng.load(args.negatives)
        negs = {s: [r for r in allneg if r.get("split") == s] for s in ("train", "val")}
        tagger = {r.get("tagger") for r in allneg}
        print(f"pretrain: FDA negatives from {args.negatives} (tagger {', '.join(map(str, sorted(tagger)))})", flush=True)

    expansion = None
    if hp.get("cross_task"):  # CUB / NABirds batches beside the pairs' (pipeline.cross_task)
        from pipeline import cross_task

        expansion = cross_task.open_expansion(hp["cross_task"], cross_task.input_paths(args.cross_task), vocab,
                                              max_words, cfg.batch_size, args.seed, ratios,
                                              lambda path: cross_task.negatives_by_split(path, "fda" in cycle))
        model_hp = {**model_hp, **expansion[1]}

    with FeatureStore(args.features) as store:
        model = IDCPCL(vocab_size=len(vocab), feat_dim=store.shape[0], **model_hp)
        model.fit_input_stats(store, [k for r in splits["train"] for k in (r["before"], r["after"])])
        train_b = PretrainBatches(splits["train"], labels, store, vocab, max_words, negs["train"], cfg.batch_size,
                                  args.seed, ratios)
        val_b = PretrainBatches(splits["val"], labels, store, vocab, max_words, negs["val"], cfg.batch_size,
                                args.seed, ratios)
        if expansion:
            train_b, val_b = expansion[0](train_b, "train"), expansion[0](val_b, "val")
        run_dir.mkdir(parents=True, exist_ok=True)
        log_path = run_dir / "train_log.jsonl"
        n_val = [0]

        class Log(TrainLog):
            def rewind(self, step):
                super().rewind(step)
                # validations before the resumed step (every val_every, and the last step): the score below
                # must keep growing across sessions, or a resumed run would keep the weights of an earlier step
                n_val[0] = -(-step // cfg.val_every)

        log = Log(log_path)

        def validate(m):
            # No selection in pre-training (the official code keeps its last checkpoint): the score only grows.
            n_val[0] += 1
            log({"validation": n_val[0], **evaluate(m, val_b, args.val_batches, device, args.seed)})
            return float(n_val[0]), None

        identity = {"stage": "pretrain-idc-pcl", "name": args.name, "dataset": args.dataset, "seed": args.seed,
                    "hparams": hp, "features": dict(store.attrs), "vocab": len(vocab), "n_pairs": len(train_b.pairs),
                    "negatives": args.negatives if "fda" in cycle else None}
        t0 = time.time()
        n_samples = len(train_b.pairs)
        summary = train(model, train_b.batch, validate, cfg, run_dir, n_samples, device, identity, log=log)
        if not ddp.is_main():  # rank 0 writes the outputs
            return
        ck = load_checkpoint(run_dir / "checkpoint.pt")
        ck.update({"method": "idc_pcl_pretrain", "name": args.name, "model_hparams": model_hp, "tasks": ratios,
                   "vocab_size": len(vocab), "feat_dim": store.shape[0]})
        from pipeline.engine import save

        save(run_dir / "checkpoint.pt", ck)
        write_json(run_dir / "pretrain.json", {
            "name": args.name, "dataset": args.dataset, "seed": args.seed, "tasks": ratios, "cycle": cycle,
            "steps": cfg.iterations, "batch_size": cfg.batch_size,
            "fda_pairs_per_batch": getattr(train_b, "fda_pairs", None), "train_pairs": n_samples,
            "backbone": store.attrs.get("backbone"), "weights": store.attrs.get("weights"),
            "steps_per_s": round(summary["steps_per_s"], 3), "train_seconds": round(time.time() - t0, 1),
            "device": device.type, "devices": ddp.world(), "precision": resolved_precision(device, cfg.precision),
            "config": hp, "history": summary["history"], "cross_task": expansion[2] if expansion else None,
        })
    discard_resume_state(run_dir)
    print(f"pretrain: {args.name} seed {args.seed}: {cfg.iterations} steps ({'/'.join(cycle)}), "
          f"{summary['steps_per_s']:.2f} steps/s")
