"""FDA negative construction throughput on 100k CLEVR-Change-style captions (target: under a minute).

The captions are written by the synthetic world's own caption generator (``pipeline.synth.captions``) on
random scenes (objects placed without rendering, the default camera naming them): CLEVR-Change's change
captions of all five types and its no-change captions, six per pair, half the pairs distractors, 80 % of
the pairs in the training split and 20 % in validation. Construction runs ``pipeline.negatives.build`` with
the lexicon tagger (stanza's models are not on this machine); caption synthesis is not timed.

    python benchmarks/bench_negatives.py [--captions 100000] [--threads 2]
"""

import argparse
import time

import numpy as np
import torch

from pipeline.negatives import Settings, build
from pipeline.pos_tagging import LexiconTagger
from pipeline.synth import captions as cap
from pipeline.synth.scene import MATERIALS, SceneObject, default_view, random_attributes, random_position, SIZES

TYPES = ("color", "material", "add", "drop", "move")


def synth_records(n_captions: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    camera = default_view().camera
    records, n, index = [], 0, 0
    while n < n_captions:
        objs = []
        for _ in range(int(rng.integers(3, 11))):
            a = random_attributes(rng)
            pos = random_position(rng, SIZES[a["size"]], objs)
            if pos is not None:
                objs.append(SceneObject(x=pos[0], y=pos[1], **a))
        target = int(rng.integers(len(objs)))
        ctype = TYPES[index % len(TYPES)]
        new = None
        if ctype == "color":
            new = str(rng.choice([c for c in cap.COLOR_NAMES if c != objs[target].color]))
        elif ctype == "material":
            new = next(m for m in MATERIALS if m != objs[target].material)
        try:
            caps = cap.change_captions(rng, ctype, objs, target, camera, new, n=6)
        except ValueError:  # the target cannot be named uniquely: draw another scene
            continue
        split = "train" if index % 5 else "val"
        key = f"{index:06d}.png"
        records.append({"pair_id": key, "split": split, "before": f"images/CLEVR_default_{key}",
                        "after": f"sc_images/CLEVR_semantic_{key}", "change_type": ctype, "captions": caps})
        records.append({"pair_id": key + "_n", "split": split, "before": f"images/CLEVR_default_{key}",
                        "after": f"nsc_images/CLEVR_nonsemantic_{key}", "change_type": "no_change",
                        "captions": cap.no_change_captions(rng, 6)})
        n += len(caps) + 6
        index += 1
    return records


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--captions", type=int, default=100_000)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t = time.time()
    records = synth_records(args.captions)
    n = sum(len(r["captions"]) for r in records)
    print(f"synthesised {n} captions of {len(records)} pairs in {time.time() - t:.1f}s (not timed)")
    tagger = LexiconTagger.for_dataset("clevr_change")
    t = time.time()
    out, stats = build(records, tagger, Settings(), log=lambda m: print("  " + m))
    dt = time.time() - t
    print(f"negatives: {len(out)} captions x 6 negatives in {dt:.1f}s = {len(out) / dt:,.0f} captions/s "
          f"(target: {n} captions in under 60 s: {'met' if dt < 60 else 'NOT met'})")
    print("distinct captions: " + ", ".join(f"{sp} {s['distinct_captions']}" for sp, s in stats["splits"].items()))
    print(f"fallbacks (train): {stats['splits']['train']['fallbacks']}; Table 7: {stats['table7']}")


if __name__ == "__main__":
    main()
