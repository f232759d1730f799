"""Stage ``decode``: greedy decoding of one split with a selected checkpoint (COCO results format)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.datasets.manifest import load as load_manifest
from pipeline.engine import load_checkpoint
from pipeline.errors import PipelineError
from pipeline.features.store import FeatureStore
from pipeline.models import build_model
from pipeline.text import Vocab
from pipeline.train import decode_split
from pipeline.utils.io import write_json
from pipeline.utils.seed import pick_device, set_threads


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--manifest", required=True)
    p.add_argument("--text-dir", required=True)
    p.add_argument("--features", required=True)
    p.add_argument("--split", default="test")
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0)


def run(args: argparse.Namespace) -> None:
    set_threads(args.threads)
    device = pick_device(args.device)
    path = Path(args.checkpoint)
    ck = load_checkpoint(path)
    if "method" not in ck:
        raise PipelineError(f"{path}: not a finished training checkpoint (no method recorded)")
    vocab = Vocab.load(Path(args.text_dir) / "vocab.json")
    if len(vocab) != ck["vocab_size"]:
        raise PipelineError(f"{path}: trained with a vocabulary of {ck['vocab_size']} words, "
                            f"{args.text_dir}/vocab.json has {len(vocab)}")
    model = build_model(ck["method"], ck["vocab_size"], ck["feat_dim"], ck["model_hparams"])
    model.load_state_dict(ck["model"])
    model.to(device)
    records = load_manifest(args.manifest, args.split)
    with FeatureStore(args.features) as store:
        preds = decode_split(model, records, store, vocab, device, args.batch_size, ck["max_decode_len"],
                             ck.get("precision", "auto"))
    write_json(args.out, preds, indent=None)
    print(f"decode: {len(preds)} {args.split} pairs -> {args.out}")
