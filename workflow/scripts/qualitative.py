"""Qualitative page of a table (rule `report_qualitative`): a few test pairs, one row each: before and after
image, the attention maps of the methods that have them (DUDA's dual attention on each image; SCORER's and
DIRL's decoder attention over the difference tokens, on the after image), the ground truth and each method's
test caption (seed 0's predictions_test.json). Glue only: the maps come from ``pipeline.attention_maps``."""


import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from pipeline.attention_maps import attention_maps  # noqa: E402
from pipeline.data import eval_batches  # noqa: E402
from pipeline.datasets.manifest import load as load_manifest  # noqa: E402
from pipeline.engine import autocast, load_checkpoint  # noqa: E402
from pipeline.features.store import FeatureStore  # noqa: E402
from pipeline.models import build_model  # noqa: E402
from pipeline.text import Vocab  # noqa: E402
from pipeline.utils.io import read_json  # noqa: E402


def pick_pairs(records: list[dict], n: int) -> list[dict]:
    """``n`` test pairs, round-robin over the change types (sorted) in manifest order, each pair once."""
    by_type, seen = defaultdict(list), set()
    for r in records:
        key = (r["before"], r.get("after"))
        if key not in seen:
            seen.add(key)
            by_type[r.get("change_type", "")].append(r)
    queues, out = [by_type[t] for t in sorted(by_type)], []
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out


def maps_of(method: str, checkpoint: str, features: str, vocab: Vocab, pairs: list[dict]) -> dict:
    """{pair_id: {"caption": str, map name: [h, w] array}} for ``pairs`` (one batch, CPU)."""
    ck = load_checkpoint(checkpoint)
    model = build_model(ck["method"], ck["vocab_size"], ck["feat_dim"], ck["model_hparams"])
    model.load_state_dict(ck["model"])
    device = torch.device("cpu")
    with FeatureStore(features) as store:
        ids, before, after = next(eval_batches(pairs, store, len(pairs)))
    with autocast(device, ck.get("precision", "auto")):  # as `decode` ran: the same caption
        out = attention_maps(method, model, before, after, ck["max_decode_len"])
    return {i: {"caption": vocab.decode(out["caption"][j]),
                **{k: v[j].float().numpy() for k, v in out.items() if k != "caption"}} for j, i in enumerate(ids)}


def overlay(ax, image, att, title):
    ax.imshow(image)
    if att is not None:
        h, w = image.shape[:2]
        ax.imshow(att, cmap="jet", alpha=0.45, extent=(0, w, h, 0), interpolation="bilinear")
    ax.set_title(title, fontsize=8)
    ax.axis("off")


def draw(pairs, raw_dir: Path, captions: dict, maps: dict, title: str, out: str) -> None:
    panels = [("before", None, None), ("after", None, None)]
    for m, per_pair in maps.items():
        names = [k for k in next(iter(per_pair.values())) if k != "caption"]
        panels += [(("before" if k == "before" else "after"), m, k) for k in names]
    ncol = len(panels) + 1
    row_height = max(2.2, 0.2 * (3 + len(captions)))  # room for the ground truth and every method's caption
    fig = plt.figure(figsize=(1.9 * len(panels) + 5.5, row_height * len(pairs) + 0.6))
    grid = fig.add_gridspec(len(pairs), ncol, width_ratios=[1] * len(panels) + [2.9])
    for row, r in enumerate(pairs):
        images = {side: np.asarray(Image.open(raw_dir / r[side]).convert("RGB")) for side in ("before", "after")}
        for col, (side, m, k) in enumerate(panels):
            att = maps[m][r["pair_id"]][k] if m else None
            label = side if m is None else f"{m}: {'attention' if k != 'tokens' else 'token attention'} ({side})"
            overlay(fig.add_subplot(grid[row, col]), images[side], att, "\n".join(textwrap.wrap(label, 24)))
        ax = fig.add_subplot(grid[row, -1])
        ax.axis("off")
        lines = [f"pair {r['pair_id']} ({r.get('change_type', '')})", f"ground truth: {r['captions'][0]}"]
        lines += [f"{m}: {captions[m].get(r['pair_id'], '(no prediction)')}" for m in captions]
        ax.text(0, 1, "\n".join(textwrap.fill(s, 62, subsequent_indent="    ") for s in lines), va="top",
                fontsize=7.5, family="monospace", transform=ax.transAxes)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(sm) -> None:
    records = load_manifest(sm.input.manifest, "test")
    pairs = pick_pairs(records, sm.params.n_pairs)
    captions = {m: {p["image_id"]: p["caption"] for p in read_json(f)}
                for m, f in zip(sm.params.methods, sm.input.predictions)}
    vocab = Vocab.load(Path(sm.input.vocab))
    maps = {m: maps_of(m, a["checkpoint"], a["features"], vocab, pairs) for m, a in sm.params.attention.items()}
    draw(pairs, Path(sm.params.raw_data), captions, maps, f"{sm.wildcards.table}: qualitative test pairs", sm.output[0])


if __name__ == "__main__":
    sys.stdout = sys.stderr = open(snakemake.log[0], "w")  # noqa: F821, SIM115 - injected by Snakemake; the rule's log
    main(snakemake)  # noqa: F821
