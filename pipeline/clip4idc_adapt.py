"""Stage ``adapt-clip4idc``: CLIP4IDC's IDC adaptation by image-pair ↔ text retrieval (seed paper §2.3).

Trains :class:`pipeline.models.clip4idc.CLIP4IDCAdapt` with the symmetric InfoNCE loss of Eq. 6-8 through
``pipeline.engine`` (resumable; validation and selection by retrieval on the *validation* split, never on test
as the official code does), then scores the selected checkpoint once on the test split.

Data, as the official ``dataloader_clevr_retrieval.py``: changed pairs only, each with one of its change
captions drawn at random; with probability ``distractor_swap`` (official 0.5) the before image is replaced by
the distractor view (still paired with the change caption). Batches come from ``pipeline.data.TrainBatches``
(a pure function of seed and step) with ``changed_only``: on a dataset without distractor partners (plain pairs,
e.g. CLEVR-DC) the split's changed pairs, without the swap. An epoch is one pass over the training pairs (the
official one is over captions).

Retrieval protocol, as the official evaluation: queries and candidates are the split's changed pairs and
*all* their change captions. Text → pair: every caption ranks the pairs. Pair → text: every pair ranks the
pairs' caption sets, a set scoring its best caption (the official ``tensor_video_to_text_sim``). Ranks come from
``pipeline.retrieval`` (ties counted against the model; CLEVR captions are templated, so identical captions of
different pairs do tie). Selection score: the sum of R@1, R@5 and R@10 in both directions.

Outputs in ``--run-dir``: ``checkpoint.pt`` (``{"model": state_dict, ...}``, the selected step),
``retrieval_val.json`` and ``retrieval_test.json`` (``{"split", "n_pairs", "n_captions", "pair_to_text":
{R@1, R@5, R@10, R@20, R@50, MedianR, MeanR, n}, "text_to_pair": {...}, "selected_step"}``), ``train_log.jsonl``, ``run.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from pipeline import distributed as ddp
from pipeline.data import TrainBatches
from pipeline.datasets.manifest import NO_CHANGE
from pipeline.datasets.manifest import load as load_manifest
from pipeline.engine import (TrainLog, autocast, discard_resume_state, load_checkpoint, resolved_precision,
                             save, train)
from pipeline.errors import PipelineError
from pipeline.features.store import FeatureStore
from pipeline.retrieval import retrieval_metrics
from pipeline.text import END, Labels, Vocab
from pipeline.train import parse_hparams
from pipeline.utils.io import write_json
from pipeline.utils.seed import seed_everything, set_threads


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default="clip4idc_adapt", help="the run's name (its pretraining: block)")
    p.add_argument("--dataset", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--hparams", required=True, help="JSON: {'model': {...}, 'train': {...}}")
    p.add_argument("--manifest", required=True)
    p.add_argument("--text-dir", required=True)
    p.add_argument("--features", required=True, help="the pixel cache (clip_pixels224.h5)")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--eval-batch-size", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0)


# ------------------------------------------------------------------------------------------ text tokens
class TextTokens:
    """Caption token ids for the CLIP text encoder, from the pipeline's encoded labels.

    ``words``: the labels themselves (``<START> w.. <END>``, padding 0; end token ``<END>``).
    ``clip_bpe``: each label row decoded to its words and re-encoded with CLIP's BPE (end ``<|endoftext|>``).
    """

    def __init__(self, mode: str, vocab: Vocab, length: int = 32, bpe_vocab: str | None = None,
                 weights_dir: str = "resources/weights"):
        self.mode, self.vocab, self.length = mode, vocab, length
        if mode == "words":
            self.size, self.eos = len(vocab), END
        elif mode == "clip_bpe":
            from pipeline.models.clip4idc import ClipBPE, find_bpe_vocab

            self.bpe = ClipBPE(find_bpe_vocab(bpe_vocab, weights_dir))
            self.size, self.eos = len(self.bpe), self.bpe.eot
        else:
            raise PipelineError(f"text_tokens must be 'words' or 'clip_bpe', got {mode!r}")

    def __call__(self, labels: torch.Tensor) -> torch.Tensor:
        labels = torch.as_tensor(labels).long()
        if self.mode == "words":
            return labels[:, :int((labels > 0).sum(1).max())]
        return self.bpe([self.vocab.decode(row) for row in labels.tolist()], self.length)


# ------------------------------------------------------------------------------------------ retrieval
# R@1/5/10 as CLEVR-Change's Table 6 reports them; R@20/50 for Spot-the-Diff's (R@10/20/50). Selection: rsum.
RECALL_AT = (1, 5, 10, 20, 50)


def pair_text_metrics(sim: np.ndarray, caption_pair: np.ndarray) -> dict:
    """``sim`` [captions, pairs] (cosine), ``caption_pair[c]`` the pair caption c describes.

    Text → pair ranks every caption's pair; pair → text ranks each pair's caption set (its best caption)."""
    sim = np.asarray(sim, dtype=np.float64)
    caption_pair = np.asarray(caption_pair)
    n_pairs = sim.shape[1]
    if sim.shape[0] != len(caption_pair) or set(caption_pair.tolist()) != set(range(n_pairs)):
        raise ValueError("every pair needs at least one caption, and every caption a pair")
    by_set = np.full((n_pairs, n_pairs), -np.inf)  # [query pair, caption set]
    for q in range(n_pairs):
        by_set[:, q] = sim[caption_pair == q].max(0)
    return {"pair_to_text": retrieval_metrics(by_set, ks=RECALL_AT),
            "text_to_pair": retrieval_metrics(sim, caption_pair, ks=RECALL_AT)}


def rsum(metrics: dict) -> float:
    return float(sum(metrics[d][f"R@{k}"] for d in ("pair_to_text", "text_to_pair") for k in (1, 5, 10)))


@torch.no_grad()
def evaluate_retrieval(model, records: list[dict], labels: Labels, store, tokens: TextTokens, device,
                       batch_size: int = 64, precision: str = "auto") -> dict:
    """Retrieval metrics of ``model`` on the changed pairs of ``records`` (see the module docstring)."""
    model.eval()
    pairs = [r for r in records if r["change_type"] != NO_CHANGE]
    if not pairs:
        raise PipelineError("no changed pairs to evaluate retrieval on")
    vs, caps, owner = [], [], []
    with autocast(device, precision):
        for i in range(0, len(pairs), batch_size):
            chunk = pairs[i:i + batch_size]
            before = torch.from_numpy(store.get_many([r["before"] for r in chunk])).to(device)
            after = torch.from_numpy(store.get_many([r["after"] for r in chunk])).to(device)
            vs.append(model.pair_embedding(before, after).float().cpu())
        for j, r in enumerate(pairs):
            rows = labels.of(r["pair_id"])
            caps.extend(rows)
            owner.extend([j] * len(rows))
        gs = []
        caps = np.stack(caps).astype(np.int64)
        for i in range(0, len(caps), 4 * batch_size):
            gs.append(model.text_embedding(tokens(caps[i:i + 4 * batch_size]).to(device)).float().cpu())
    sim = (torch.cat(gs) @ torch.cat(vs).t()).numpy()
    out = pair_text_metrics(sim, np.asarray(owner))
    return {"n_pairs": len(pairs), "n_captions": len(caps), **out}


# ------------------------------------------------------------------------------------------ stage
def run(args: argparse.Namespace) -> None:
    from pipeline.models.clip4idc import CLIP4IDCAdapt

    set_threads(ddp.process_threads(args.threads))
    seed_everything(args.seed)
    device = ddp.setup(args.device)  # launched by torchrun (train.devices > 1): one process of N
    model_hp, cfg = parse_hparams(args.hparams)
    model_hp = dict(model_hp)
    mode = model_hp.pop("text_tokens", "words")
    text_length = int(model_hp.pop("text_length", 32))
    bpe_vocab = model_hp.pop("bpe_vocab", None)
    run_dir = Path(args.run_dir)
    records = load_manifest(args.manifest)
    split = {s: [r for r in records if r["split"] == s] for s in ("train", "val", "test")}
    for s in ("val", "test"):
        if not any(r["change_type"] != NO_CHANGE for r in split[s]):
            raise PipelineError(f"{args.manifest}: no changed {s} pairs (adaptation is selected on val, scored on test)")
    vocab = Vocab.load(Path(args.text_dir) / "vocab.json")
    labels = Labels(Path(args.text_dir) / "labels.h5")
    tokens = TextTokens(mode, vocab, text_length, bpe_vocab, model_hp.get("weights_dir", "resources/weights"))

    with FeatureStore(args.features) as store:
        if store.attrs.get("backbone") != "clip_pixels224":
            raise PipelineError(f"{args.features}: not a pixel cache (backbone {store.attrs.get('backbone')!r}, "
                                f"items {store.shape}); run cache-pixels")
        model = CLIP4IDCAdapt(text_vocab_size=tokens.size, eos_id=tokens.eos, text_tokens=mode, **model_hp)
        batches = TrainBatches(split["train"], labels, store, cfg.batch_size, args.seed,
                               cfg.extra.get("distractor_swap", 0.5), changed_only=True)

        def batch(step):
            b = batches.batch(step)
            return {"before": b["before"], "after": b["after"], "text": tokens(b["labels"]),
                    "step": b["step"], "epoch": b["epoch"]}

        best: dict = {}

        def validate(m):
            res = evaluate_retrieval(m, split["val"], labels, store, tokens, device, args.eval_batch_size, cfg.precision)
            return rsum(res), res

        def on_best(res):
            best["val"] = res

        run_dir.mkdir(parents=True, exist_ok=True)
        log_path = run_dir / "train_log.jsonl"
        log = TrainLog(log_path)

        identity = {"stage": "adapt-clip4idc", "name": args.name, "dataset": args.dataset, "seed": args.seed,
                    "hparams": json.loads(args.hparams), "features": dict(store.attrs), "n_train": len(batches),
                    "vocab": len(vocab)}
        t0 = time.time()
        summary = train(model, batch, validate, cfg, run_dir, len(batches), device, identity, on_best, log)
        if not ddp.is_main():  # rank 0 writes the outputs
            return
        ck = load_checkpoint(run_dir / "checkpoint.pt")
        model.load_state_dict(ck["model"])
        model.to(device)
        if "val" not in best:  # resumed after the best step
            best["val"] = validate(model)[1]
        test = evaluate_retrieval(model, split["test"], labels, store, tokens, device, args.eval_batch_size,
                                  cfg.precision)
        for name, res in (("val", best["val"]), ("test", test)):
            write_json(run_dir / f"retrieval_{name}.json", {"split": name, **res, "selected_step": summary["best_step"],
                                                            "protocol": "changed pairs, all change captions; "
                                                            "ties counted against the model"})
        write_json(run_dir / "run.json", {
            "method": args.name, "stage": "adapt-clip4idc", "dataset": args.dataset, "seed": args.seed,
            "kind": "reproduced", "source": ",".join(sorted({r["source"] for r in records})),
            "backbone": store.attrs.get("backbone"), "weights": model.weights_identity,
            "selected_step": summary["best_step"], "val_rsum": summary["best_score"],
            "selection": "validation retrieval, R@1+R@5+R@10 both directions",
            "train_seconds": round(time.time() - t0, 1), "steps_per_s": round(summary["steps_per_s"], 3),
            "device": device.type, "devices": ddp.world(), "precision": resolved_precision(device, cfg.precision),
            "config": json.loads(args.hparams), "text_tokens": mode,
            "n_train_items": len(batches), "pairing": batches.mode,
        })
    ck.update({"stage": "adapt-clip4idc", "name": args.name, "model_hparams": model_hp, "text_tokens": mode,
               "weights_identity": model.weights_identity})
    save(run_dir / "checkpoint.pt", ck)
    discard_resume_state(run_dir)
    print(f"adapt-clip4idc: {args.name} seed {args.seed}: selected step {summary['best_step']} "
          f"(val R-sum {summary['best_score']:.3f}); test pair->text R@1 {test['pair_to_text']['R@1']:.3f}, "
          f"text->pair R@1 {test['text_to_pair']['R@1']:.3f}; {summary['steps_per_s']:.3f} steps/s")
