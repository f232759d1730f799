"""Stage ``train``: train one method with one seed; select the checkpoint on validation CIDEr.

Writes into ``--run-dir``: ``checkpoint.pt`` (the selected weights), ``predictions_val.json`` (greedy
decoding of the selected checkpoint), ``train_log.jsonl`` and ``run.json``. The test split is never
touched here: it is decoded once, by the ``decode`` stage, with the selected checkpoint.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pipeline import distributed as ddp
from pipeline.data import TrainBatches, eval_batches
from pipeline.datasets.manifest import load as load_manifest
from pipeline.engine import (TrainConfig, TrainLog, autocast, discard_resume_state, load_checkpoint,
                             resolved_precision, train)
from pipeline.errors import PipelineError
from pipeline.features.store import FeatureStore
from pipeline.models import build_model
from pipeline.text import Labels, Vocab
from pipeline.utils.io import write_json
from pipeline.utils.seed import set_threads, seed_everything

TRAIN_KEYS = {f for f in TrainConfig.__dataclass_fields__} - {"extra"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--hparams", required=True, help="JSON: {'model': {...}, 'train': {...}}")
    p.add_argument("--manifest", required=True)
    p.add_argument("--text-dir", required=True)
    p.add_argument("--features", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--init", default=None, help="checkpoint of a previous stage (pre-training, adaptation) "
                   "to initialise from; its tensors are copied by name")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")


def decode_split(model, records, store, vocab: Vocab, device, batch_size: int, max_len: int,
                 precision: str = "auto") -> list[dict]:
    model.eval()
    out = []
    with torch.no_grad(), autocast(device, precision):
        for ids, before, after in eval_batches(records, store, batch_size):
            tokens = model.generate(before.to(device), after.to(device), max_len).cpu()
            out.extend({"image_id": i, "caption": vocab.decode(t)} for i, t in zip(ids, tokens))
    return out


def parse_hparams(text: str) -> tuple[dict, TrainConfig]:
    try:
        hp = json.loads(text)
    except json.JSONDecodeError as e:
        raise PipelineError(f"--hparams is not valid JSON: {e}") from None
    tr = dict(hp.get("train", {}))
    extra = {k: tr.pop(k) for k in list(tr) if k not in TRAIN_KEYS}
    try:
        cfg = TrainConfig(**tr, extra=extra)
    except TypeError as e:
        raise PipelineError(f"train hyper-parameters: {e}") from None
    return hp.get("model", {}), cfg


def run(args: argparse.Namespace) -> None:
    from pipeline.evaluate import score

    set_threads(ddp.process_threads(args.threads))
    seed_everything(args.seed)  # the same in every process: their random draws stay in step
    device = ddp.setup(args.device)  # launched by torchrun (train.devices > 1): one process of N
    model_hp, cfg = parse_hparams(args.hparams)
    run_dir = Path(args.run_dir)
    records = load_manifest(args.manifest)
    train_recs = [r for r in records if r["split"] == "train"]
    val_recs = [r for r in records if r["split"] == "val"]
    if not val_recs:
        raise PipelineError(f"{args.manifest}: no validation pairs (model selection needs them)")
    vocab = Vocab.load(Path(args.text_dir) / "vocab.json")
    labels = Labels(Path(args.text_dir) / "labels.h5")
    max_len = int(cfg.extra.get("max_decode_len", 24))
    # the papers' main metric of the dataset (IDC-PCL: ROUGE-L on Birds-to-Words); pycocoevalcap's names
    select_metric = cfg.extra.get("select_metric", "CIDEr")
    refs = {r["pair_id"]: r["captions"] for r in val_recs}

    with FeatureStore(args.features) as store:
        feat_dim = store.shape[0]
        model = build_model(args.method, len(vocab), feat_dim, model_hp)
        if args.init:
            init = load_checkpoint(args.init)
            try:
                copied = model.init_from(init["model"])
            except ValueError as e:
                raise PipelineError(f"--init {args.init}: {e}") from None
            print(f"train: initialised {len(copied)} tensors from {args.init}", flush=True)
        elif hasattr(model, "fit_input_stats"):  # input statistics of the training images (a model's own hook)
            model.fit_input_stats(store, [k for r in train_recs for k in (r["before"], r["after"])])
        batches = TrainBatches(train_recs, labels, store, cfg.batch_size, args.seed,
                               cfg.extra.get("distractor_swap", 0.5))
        best_preds: dict = {}

        # A generic checkpoint (one paragraph for every pair) can score as high as a describing one on ROUGE-L
        # (measured on Birds-to-Words' synthetic world): train.select_min_distinct makes it ineligible.
        min_distinct = float(cfg.extra.get("select_min_distinct", 0.0)) * len(val_recs)

        def validate(m):
            preds = decode_split(m, val_recs, store, vocab, device, 128, max_len, cfg.precision)
            s = score(refs, {p["image_id"]: p["caption"] for p in preds}, metrics=(select_metric,))
            return s[select_metric], preds, len({p["caption"] for p in preds}) >= min_distinct

        def on_best(preds):
            best_preds["val"] = preds

        log_path = run_dir / "train_log.jsonl"
        run_dir.mkdir(parents=True, exist_ok=True)
        log = TrainLog(log_path)

        identity = {"method": args.method, "dataset": args.dataset, "seed": args.seed, "hparams": json.loads(args.hparams),
                    "init": args.init,
                    "features": dict(store.attrs), "n_train": len(batches), "vocab": len(vocab)}
        t0 = time.time()
        summary = train(model, batches.batch, validate, cfg, run_dir, len(batches), device, identity, on_best, log)
        if not ddp.is_main():  # rank 0 writes the outputs
            return
        if "val" not in best_preds:  # resumed after the best step: decode the selected checkpoint again
            ck = load_checkpoint(run_dir / "checkpoint.pt")
            model.load_state_dict(ck["model"])
            best_preds["val"] = decode_split(model, val_recs, store, vocab, device, 128, max_len, cfg.precision)
        write_json(run_dir / "predictions_val.json", best_preds["val"], indent=None)
        sources = sorted({r["source"] for r in records})
        write_json(run_dir / "run.json", {
            "method": args.method, "dataset": args.dataset, "seed": args.seed, "kind": "reproduced",
            "source": ",".join(sources), "backbone": store.attrs.get("backbone"),
            # a model that holds its own pretrained network (CLIP4IDC) names its weights; else the features'
            "weights": getattr(model, "weights_identity", None) or store.attrs.get("weights"),
            "selected_step": summary["best_step"],
            **({"val_CIDEr": summary["best_score"]} if select_metric == "CIDEr" else
               {"val_CIDEr": None, f"val_{select_metric}": summary["best_score"]}),
            "selection": f"greedy decoding, validation {'CIDEr-D' if select_metric == 'CIDEr' else select_metric}", "train_seconds": round(time.time() - t0, 1),
            "steps_per_s": round(summary["steps_per_s"], 3), "device": device.type, "devices": ddp.world(),
            "precision": resolved_precision(device, cfg.precision),
            "config": json.loads(args.hparams), "vocab_size": len(vocab), "n_train_items": len(batches),
            "pairing": batches.mode,
        })
    # The model file carries what decode needs to rebuild the network.
    ck = load_checkpoint(run_dir / "checkpoint.pt")
    ck.update({"method": args.method, "model_hparams": model_hp, "vocab_size": len(vocab), "feat_dim": feat_dim,
               "max_decode_len": max_len, "precision": cfg.precision})
    from pipeline.engine import save

    save(run_dir / "checkpoint.pt", ck)
    discard_resume_state(run_dir)
    print(f"train: {args.method} seed {args.seed}: selected step {summary['best_step']} "
          f"(val {select_metric} {summary['best_score']:.3f}), {summary['steps_per_s']:.2f} steps/s")
