"""Stage ``aux-retrieval``: composed-query retrieval by the auxiliary (TIRG) network of a model trained with
the auxiliary task (``pipeline.models.aux_training``), on one split, with the selected checkpoint.

Queries are the split's changed pairs (A, B) (distractor pairs pose no composed query, see
``aux_training``), two ways:
- ``gt_caption``: k(A, W_emb[C]) once per reference caption C: the auxiliary task itself;
- ``generated_caption``: k(A, P·W_emb) with the captioner's own soft caption of (A, B), as in training
  stage 1: how well the primary's captions let the auxiliary network find B (the cycle of §4).
The gallery is every distinct image of the split (before, changed-after and distractor-after images), the
query's own A included: ranking B above A and above A's distractor view is what the caption must enable.
Recall@1/5/10, median and mean rank; ties count against the model (``pipeline.retrieval``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from pipeline.datasets.manifest import NO_CHANGE
from pipeline.datasets.manifest import load as load_manifest
from pipeline.engine import autocast, load_checkpoint
from pipeline.errors import PipelineError
from pipeline.features.store import FeatureStore
from pipeline.models import build_model
from pipeline.retrieval import retrieval_metrics
from pipeline.text import Labels, Vocab
from pipeline.utils.io import write_json
from pipeline.utils.seed import pick_device, set_threads


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--manifest", required=True)
    p.add_argument("--text-dir", required=True)
    p.add_argument("--features", required=True)
    p.add_argument("--split", default="test")
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0)


def load_model(path: Path):
    ck = load_checkpoint(path)
    if "method" not in ck:
        raise PipelineError(f"{path}: not a finished training checkpoint (no method recorded)")
    model = build_model(ck["method"], ck["vocab_size"], ck["feat_dim"], ck["model_hparams"])
    if not hasattr(model, "retrieval_queries"):
        raise PipelineError(f"{path}: method {ck['method']!r} has no auxiliary retrieval network")
    model.load_state_dict(ck["model"])
    return model, ck


def retrieval_scores(model, records: list[dict], labels: Labels, store, device, batch_size: int, max_len: int,
                     precision: str = "auto") -> dict:
    changed = [r for r in records if r["change_type"] != NO_CHANGE]
    if not changed:
        raise PipelineError("no changed pairs in the split: nothing to retrieve")
    gallery_keys = sorted({k for r in records for k in (r["before"], r["after"])})
    col = {k: i for i, k in enumerate(gallery_keys)}
    model.eval()

    def maps(keys):
        return torch.from_numpy(store.get_many(keys)).to(device)

    with torch.no_grad(), autocast(device, precision):
        gallery = torch.cat([model.retrieval_gallery(maps(gallery_keys[i:i + batch_size])).float().cpu()
                             for i in range(0, len(gallery_keys), batch_size)])
        # One query per reference caption.
        gt_rows = [(r["before"], cap, col[r["after"]]) for r in changed for cap in labels.of(r["pair_id"])]
        q_gt = []
        for i in range(0, len(gt_rows), batch_size):
            chunk = gt_rows[i:i + batch_size]
            caps = torch.from_numpy(np.stack([c for _, c, _ in chunk]).astype(np.int64)).to(device)
            q_gt.append(model.retrieval_queries(maps([k for k, _, _ in chunk]), labels=caps).float().cpu())
        q_gen = []
        for i in range(0, len(changed), batch_size):
            chunk = changed[i:i + batch_size]
            q_gen.append(model.retrieval_queries(maps([r["before"] for r in chunk]), after=maps([r["after"] for r in chunk]),
                                                 max_len=max_len).float().cpu())
    g = gallery.double().numpy()
    return {
        "gallery": "every distinct image of the split, the query image included",
        "n_gallery": len(gallery_keys),
        "gt_caption": retrieval_metrics(torch.cat(q_gt).double().numpy() @ g.T, np.array([c for _, _, c in gt_rows])),
        "generated_caption": retrieval_metrics(torch.cat(q_gen).double().numpy() @ g.T,
                                               np.array([col[r["after"]] for r in changed])),
    }


def run(args: argparse.Namespace) -> None:
    set_threads(args.threads)
    device = pick_device(args.device)
    path = Path(args.checkpoint)
    model, ck = load_model(path)
    vocab = Vocab.load(Path(args.text_dir) / "vocab.json")
    if len(vocab) != ck["vocab_size"]:
        raise PipelineError(f"{path}: trained with a vocabulary of {ck['vocab_size']} words, "
                            f"{args.text_dir}/vocab.json has {len(vocab)}")
    labels = Labels(Path(args.text_dir) / "labels.h5")
    records = load_manifest(args.manifest, args.split)
    model.to(device)
    with FeatureStore(args.features) as store:
        out = retrieval_scores(model, records, labels, store, device, args.batch_size, ck["max_decode_len"],
                               ck.get("precision", "auto"))
    out = {"split": args.split, "method": ck["method"], "checkpoint": str(path), **out}
    write_json(args.out, out)
    print(f"aux-retrieval: {args.split} gt-caption R@1 {out['gt_caption']['R@1']:.3f} R@5 {out['gt_caption']['R@5']:.3f} "
          f"R@10 {out['gt_caption']['R@10']:.3f}; generated-caption R@1 {out['generated_caption']['R@1']:.3f} "
          f"({out['gt_caption']['n']} / {out['generated_caption']['n']} queries, {out['n_gallery']} images)")
