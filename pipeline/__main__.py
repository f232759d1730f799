"""Command line: ``python -m pipeline <stage> [options]``.

Each stage is a module exposing ``add_arguments(parser)`` and ``run(args)``; modules are imported only
when their stage is asked for, so ``--help`` stays fast and a stage's heavy imports stay local.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pipeline.errors import PipelineError

# stage name -> (module, one-line help)
STAGES: dict[str, tuple[str, str]] = {
    "synth-clevr-change": ("pipeline.synth.clevr_change", "render the synthetic CLEVR-Change world in the official layout"),
    "synth-clevr-dc": ("pipeline.synth.clevr_dc", "render the synthetic CLEVR-DC world (drastic camera moves) in the release's layout"),
    "synth-spot-the-diff": ("pipeline.synth.spot_the_diff", "render the synthetic Spot-the-Diff world (a parking lot) in the release's layout"),
    "synth-image-editing-request": ("pipeline.synth.image_editing_request", "render the synthetic Image Editing Request world (procedural photos and their edits) in the release's layout"),
    "synth-birds-to-words": ("pipeline.synth.birds_to_words", "render the synthetic Birds-to-Words world (procedural birds compared in pairs) in the release's layout"),
    "synth-cub": ("pipeline.synth.cub", "render the synthetic CUB-200-2011 world (procedural birds, 10 captions each) in the release's layout"),
    "synth-nabirds": ("pipeline.synth.nabirds", "render the synthetic NABirds world (procedural birds, hierarchical classes) in the release's layout"),
    "fetch": ("pipeline.datasets.fetch", "download (or verify a hand-placed copy of) an official dataset release"),
    "manifest": ("pipeline.datasets.manifest", "parse a dataset's on-disk layout into the normalised manifest"),
    "inspect": ("pipeline.datasets.inspect_tree", "check a dataset tree (pairs, images, captions, types per split) as JSON"),
    "extract-features": ("pipeline.features.extract", "extract backbone features of every image to HDF5"),
    "text": ("pipeline.text", "tokenise captions, build the vocabulary, encode labels"),
    "stanza-models": ("pipeline.pos_tagging", "place stanza's English tokenize,pos models (FDA negatives' tagger)"),
    "negatives": ("pipeline.negatives", "FDA hard negatives (retrieve / replace / confuse) of every caption"),
    "pretrain-idc-pcl": ("pipeline.idc_pcl_pretrain", "IDC-PCL pre-training (MLM, MVCL, FDA alternated by batch)"),
    "train": ("pipeline.train", "train a captioning method, selecting the checkpoint on validation"),
    "decode": ("pipeline.decode", "greedy-decode a split with a trained checkpoint"),
    "aux-retrieval": ("pipeline.aux_retrieval", "composed-query retrieval recall of an auxiliary-task model's TIRG network"),
    "baseline": ("pipeline.baselines", "sanity baselines: most frequent caption, nearest-neighbour retrieval"),
    "evaluate": ("pipeline.evaluate", "score predictions (BLEU, METEOR, ROUGE-L, CIDEr-D, SPICE) overall and by type"),
    "table": ("pipeline.tables", "write a paper table (CSV + Markdown) from run metrics and paper numbers"),
    "plots": ("pipeline.plots", "learning curves (train losses, validation score) of a method's runs, or of a table's methods"),
    "cache-pixels": ("pipeline.features.pixels", "decode and resize every image once to a uint8 pixel file (CLIP4IDC)"),
    "adapt-clip4idc": ("pipeline.clip4idc_adapt", "CLIP4IDC adaptation: image-pair/text retrieval, selected on validation"),
    "retrieval-table": ("pipeline.retrieval_tables", "CLIP4IDC retrieval table (CSV + Markdown) from adaptation runs"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="stage", metavar="stage")
    for name, (_, help_) in STAGES.items():
        sub.add_parser(name, help=help_, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in STAGES:
        build_parser().print_help()
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nerror: unknown stage {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    name = argv[0]
    from pipeline.utils.malloc import keep_freed_memory

    keep_freed_memory()  # before the stage's imports and tensors: see pipeline/utils/malloc.py
    module = importlib.import_module(STAGES[name][0])
    parser = argparse.ArgumentParser(prog=f"python -m pipeline {name}", description=STAGES[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    # A training stage (one with --hparams) with train.devices: N > 1 runs as N processes under torchrun
    # (pipeline.distributed). Other stages never import it: it imports torch (~1.6 s of CPU a process).
    distributed = None
    if getattr(args, "hparams", None) is not None:
        from pipeline import distributed

        status = distributed.relaunch(argv, distributed.requested(args.hparams))
        if status is not None:
            return status
    try:
        module.run(args)
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if distributed is not None:
            distributed.shutdown()  # a stage run by torchrun (train.devices > 1) leaves its process group
    return 0


if __name__ == "__main__":
    sys.exit(main())
