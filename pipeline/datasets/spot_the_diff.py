"""Spot-the-Diff (Jhamtani & Berg-Kirkpatrick, EMNLP 2018): the released layout, parsed into manifest records.

The release (``harsh19/spot-the-diff``, reference/datasets.md §3) is the repository's ``data/`` folder:
``annotations/{train,val,test}.json`` (in git; each a JSON list of ``{"img_id": "<int>", "sentences":
[sentence, ...]}``) and ``resized_images/`` (``resized_images.zip`` from Drive: ``<img_id>.png`` the before
frame, ``<img_id>_2.png`` the after frame, ``<img_id>_diff.jpg`` a pixel difference this parser does not
read). The image extension may be ``.png`` or ``.jpg`` (converters probe both); ``.png`` is tried first.

Quirks of the release, as the papers' "single-change setting" reads it:
- an ``img_id`` may have 2-3 entries within a split (separate annotators): they are merged into one pair with
  all their sentences, in file order (an ``img_id`` in two splits is an error; the release has none);
- empty sentences (53 / 6 / 7 in train / val / test) are dropped and counted; a pair left with no sentence
  at all is left out (a warning), it could be neither trained on nor scored;
- a pair's ``captions`` are all its remaining sentences: each describes one change, so the training data
  layer's draw of one caption per item and step (``pipeline.data.TrainBatches``, uniform over the pair's
  sentences) is "one target sentence per training example" as CLIP4IDC samples it (VisualRelationships instead
  makes each sentence its own example, which weights a pair by its number of sentences), and the evaluation
  scores the one generated sentence per test pair against all of the pair's sentences.
The release has no change types (and a few "no differences" sentences, on pairs it does not mark): every
record has ``change_type`` ``"change"`` (``CHANGE``) and no distractor partner.

``source == "official"`` checks the annotation files' sha256 (the release's files at ``d26bdcd``); the
released counts (``OFFICIAL_COUNTS``) are what ``python -m pipeline inspect spot_the_diff`` reports for them
(``source_counts``).
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.datasets.release import read_split_file, report
from pipeline.text import has_word

SPLITS = ("train", "val", "test")
ANNOTATIONS = "annotations"
IMAGES = "resized_images"
EXTENSIONS = (".png", ".jpg")
AFTER_SUFFIX = "_2"
CHANGE = "change"  # the change type of every Spot-the-Diff pair (the release labels none)

# reference/datasets.md §3: the annotation files of harsh19/spot-the-diff @ d26bdcd (no checksum is published)
OFFICIAL_SHA256 = {
    "train": "a9b6f0ac21694bf733aae6a345e9552700948ae065a61c0eb68e5d2f82a0962e",
    "val": "8d5518e3a6eabb5207e20c8c16323f9440a22ce725cc5a8d66e5bd58ec2c7df5",
    "test": "72e8e9fd50553a132ee97e401f0586a4bbd75458ee322168787aca565d980e1f",
}
OFFICIAL_BYTES = {"train": 1327514, "val": 245863, "test": 161451}
# What ``source_counts`` gives for those files (sentences include the empty ones).
OFFICIAL_COUNTS = {
    "train": {"entries": 9524, "distinct_pairs": 8566, "sentences": 17676, "empty_sentences": 53},
    "val": {"entries": 1634, "distinct_pairs": 1493, "sentences": 3310, "empty_sentences": 6},
    "test": {"entries": 1404, "distinct_pairs": 1270, "sentences": 2107, "empty_sentences": 7},
}
_IMG_ID = re.compile(r"^[0-9]+$")


def annotation_path(data_dir: str | Path, split: str) -> Path:
    return Path(data_dir) / ANNOTATIONS / f"{split}.json"


def read_annotations(data_dir: str | Path, source: str) -> dict[str, list[tuple[str, list[str]]]]:
    """Each split's entries ``(img_id, sentences)`` in file order, validated; for ``official`` the files'
    sha256 checked first. Any fault (a missing file, invalid JSON, a malformed entry, an ``img_id`` in two
    splits) raises PipelineError naming the file."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise PipelineError(f"Spot-the-Diff data directory not found: {data_dir}")
    out: dict[str, list[tuple[str, list[str]]]] = {}
    owner: dict[str, str] = {}
    for split in SPLITS:
        path = annotation_path(data_dir, split)
        entries = read_split_file(path, source, (OFFICIAL_SHA256[split], OFFICIAL_BYTES[split],
                                                 "harsh19/spot-the-diff"),
                                  "Spot-the-Diff annotation", "{'img_id', 'sentences'}")
        out[split] = []
        for i, e in enumerate(entries):
            if not isinstance(e, dict) or "img_id" not in e or "sentences" not in e:
                raise PipelineError(f"{path}: entry {i} is not an object with 'img_id' and 'sentences': {e!r}"[:300])
            img_id = e["img_id"]
            if isinstance(img_id, int) and not isinstance(img_id, bool) and img_id >= 0:
                img_id = str(img_id)
            if not isinstance(img_id, str) or not _IMG_ID.match(img_id):
                raise PipelineError(f"{path}: entry {i}: img_id {e['img_id']!r} is not a non-negative integer")
            sents = e["sentences"]
            if not isinstance(sents, list) or not all(isinstance(s, str) for s in sents):
                raise PipelineError(f"{path}: entry {i} (img_id {img_id}): 'sentences' is not a list of strings")
            if owner.setdefault(img_id, split) != split:
                raise PipelineError(f"{path}: img_id {img_id} is also in "
                                    f"{annotation_path(data_dir, owner[img_id])}")
            out[split].append((img_id, list(sents)))
    return out


def merge(entries: list[tuple[str, list[str]]]) -> dict[str, list[str]]:
    """Entries of one split merged by ``img_id`` (first appearance order), all their sentences in file order,
    the empty ones (no letter or digit) kept: ``parse`` drops them, ``source_counts`` counts them."""
    merged: dict[str, list[str]] = {}
    for img_id, sents in entries:
        merged.setdefault(img_id, []).extend(sents)
    return merged


def is_empty(sentence: str) -> bool:
    return not has_word(sentence)


def source_counts(data_dir: str | Path, source: str) -> dict[str, dict[str, int]]:
    """Per split, what the annotation files hold: ``entries`` (JSON objects), ``distinct_pairs`` (distinct
    ``img_id``), ``sentences`` (all, the empty ones included), ``empty_sentences``, ``duplicate_ids`` (ids with
    more than one entry) and ``pairs_without_sentences`` (ids whose sentences are all empty). The ``inspect``
    stage adds these to its summary; for the release they are ``OFFICIAL_COUNTS``."""
    out = {}
    for split, entries in read_annotations(data_dir, source).items():
        merged = merge(entries)
        sents = [s for _, ss in entries for s in ss]
        out[split] = {
            "entries": len(entries),
            "distinct_pairs": len(merged),
            "sentences": len(sents),
            "empty_sentences": sum(map(is_empty, sents)),
            "duplicate_ids": sum(1 for n in collections.Counter(i for i, _ in entries).values() if n > 1),
            "pairs_without_sentences": sum(1 for ss in merged.values() if all(map(is_empty, ss))),
        }
    return out


def _image(folder: Path, stem: str, data_dir: Path, check: bool) -> str | None:
    for ext in EXTENSIONS:
        if not check or (folder / (stem + ext)).is_file():
            return str((folder / (stem + ext)).relative_to(data_dir))
    return None


def parse(data_dir: str | Path, source: str, generator_seed: int | None = None, check_images: bool = True,
          warnings: list[str] | None = None) -> list[dict]:
    """Read ``data_dir`` (the release's ``data/``) and return one manifest record per distinct ``img_id``
    (see the module docstring), each split's in ascending ``img_id``.

    Structural faults (a missing or invalid annotation file, a missing image) raise PipelineError naming the
    file. Dropped empty sentences and pairs left without a sentence are summarised per split in
    ``warnings`` when a list is given (the ``inspect`` stage), else printed once."""
    data_dir = Path(data_dir)
    splits = read_annotations(data_dir, source)
    folder = data_dir / IMAGES
    if check_images and not folder.is_dir():
        raise PipelineError(f"Spot-the-Diff image folder missing: {folder} (extract resized_images.zip there)")
    local_warnings: list[str] = []
    records: list[dict] = []
    for split in SPLITS:
        path = annotation_path(data_dir, split)
        merged = merge(splits[split])
        n_empty, empty_ids, no_sentence = 0, [], []
        for img_id in sorted(merged, key=lambda i: (int(i), i)):
            sents = merged[img_id]
            kept = [s for s in sents if not is_empty(s)]
            if len(kept) < len(sents):
                n_empty += len(sents) - len(kept)
                empty_ids.append(img_id)
            if not kept:
                no_sentence.append(img_id)
                continue
            before = _image(folder, img_id, data_dir, check_images)
            after = _image(folder, img_id + AFTER_SUFFIX, data_dir, check_images)
            for key, stem in ((before, img_id), (after, img_id + AFTER_SUFFIX)):
                if key is None:
                    raise PipelineError(f"Spot-the-Diff image missing: {folder / (stem + '.png')} (nor .jpg), "
                                        f"img_id {img_id} of {path}")
            records.append({"pair_id": img_id, "index": int(img_id), "split": split, "before": before,
                            "after": after, "change_type": CHANGE, "captions": kept, "labels": {},
                            "source": source, "generator_seed": generator_seed})
        if n_empty:
            local_warnings.append(f"{path}: {n_empty} empty sentence(s) dropped (img_id "
                                  f"{', '.join(empty_ids[:5])}{' ...' if len(empty_ids) > 5 else ''})")
        if no_sentence:
            local_warnings.append(f"{path}: {len(no_sentence)} img_id(s) left out, no sentence with a word: "
                                  f"{', '.join(no_sentence[:5])}{' ...' if len(no_sentence) > 5 else ''}")
    report(local_warnings, warnings, "Spot-the-Diff")
    return records
