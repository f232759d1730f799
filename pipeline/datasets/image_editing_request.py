"""Image Editing Request (Tan et al., "Expressing Visual Relationships via Language", ACL 2019): the release's
files, parsed into manifest records.

The release (``airsplay/VisualRelationships`` @ ``9bee562``, reference/datasets.md §4) is three JSON files in git,
``dataset/adobe/{train,valid,test}.json`` (each a JSON list of ``{"img0": "<file>", "img1": "<file>", "sents":
[request, ...], "uid": "<Source>_<n>"}``), and the image files (a Google Drive folder, mirrored on archive.org;
the archive names inside are not documented). ``img0`` is the image to edit, ``img1`` the edited one; both are
bare file names with mixed extensions (``.jpg``, ``.png``, ``.JPG``, ``.jpeg``, ``.gif``), used as they are.

The layout this parser reads (``data_dir``, the ``data/`` folder of ``resources/raw/image_editing_request/<source>``):
``train.json``, ``valid.json``, ``test.json`` (the content of the release's ``dataset/adobe/``) and ``images/``
holding every image file by its bare name. The release's ``valid`` split is the manifest's ``val``.

One record per JSON entry: ``pair_id`` its ``uid``, ``index`` its position in the manifest (train, val, test in
file order), ``before`` ``images/<img0>``, ``after`` ``images/<img1>``, ``captions`` its requests in file order
(1 per pair in train, 3 in valid / test in the release), ``change_type`` ``"change"`` (``CHANGE``: the release
labels no edit type, so every pair gets the one type of its own, as Spot-the-Diff's do; the evaluation's
by-type block and the table's by-type columns are then that one block), no distractor partner.

Quirks of the release and how they are read:
- 55 identical ``(img0, img1)`` pairs occur in both valid and test (and 105 ``img0`` / 55 ``img1`` files are
  shared by the two splits; a few files by train and either). They are kept as the official split defines
  them, never dropped: a pair repeated across splits is reported as one warning per pair of splits (the
  ``inspect`` stage prints them), and ``source_counts`` counts them per split. Selecting a checkpoint on val
  then sees 55 test pairs: that is the release's leakage, reported, not repaired.
- A ``uid`` twice in one split is an error; a ``uid`` also used by an earlier split (the reference does not
  say that it never is) keeps the records apart as ``<split>/<uid>`` with a warning.
- datasets.md reports no empty request in the release: an entry whose ``sents`` is empty, not a list of
  strings, or holds only requests without a word, is a structural fault (a PipelineError naming the file and
  the ``uid``). A single request without a word beside others with words (a caption-level fault) is dropped
  and counted in ``warnings`` when a list is given, else it raises.
- Invalid JSON, a missing file or image, an entry without the four keys: one PipelineError naming the file.

``source == "official"`` checks the three files' sha256 (datasets.md §4 gives them; the image files have no
published checksum, only their existence is checked). ``OFFICIAL_COUNTS`` are what ``source_counts`` gives
for the released files (datasets.md's table; the issue's acceptance: 3,061 / 383 / 495 pairs).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.datasets.release import read_split_file, report
from pipeline.text import has_word

# release split name -> manifest split name, in manifest order
SPLITS = {"train": "train", "valid": "val", "test": "test"}
IMAGES = "images"
CHANGE = "change"  # the change type of every pair (the release labels none)
KEYS = ("img0", "img1", "sents", "uid")

# reference/datasets.md §4: airsplay/VisualRelationships @ 9bee562, dataset/adobe/<split>.json
OFFICIAL_SHA256 = {
    "train": "a3d4a84ece2128355714cc0894d78b7cc408c70c64488e58ac24193e26132a2f",
    "valid": "e76516f850015a7d6d27209a476141e8e34881dd207f2f71acc8ea471e3af7aa",
    "test": "703c322534d94990e8af42d061094c3f9fb69a1e0030d6a6389c3865aafeaf93",
}
OFFICIAL_BYTES = {"train": 695320, "valid": 132264, "test": 173213}
# datasets.md §4's counts (the valid/test overlap: 55 identical pairs)
OFFICIAL_COUNTS = {
    "train": {"pairs": 3061, "requests": 3061, "distinct_images": 4516},
    "valid": {"pairs": 383, "requests": 1149, "distinct_images": 684},
    "test": {"pairs": 495, "requests": 1485, "distinct_images": 848},
}
OFFICIAL_SHARED_PAIRS = {("valid", "test"): 55}


def json_path(data_dir: str | Path, split: str) -> Path:
    return Path(data_dir) / f"{split}.json"


def read_splits(data_dir: str | Path, source: str) -> dict[str, list[dict]]:
    """Each release split's entries in file order, validated (see the module docstring); for ``official`` the
    files' sha256 checked first. A fault raises PipelineError naming the file (and the entry's ``uid``)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise PipelineError(f"Image Editing Request data directory not found: {data_dir}")
    out: dict[str, list[dict]] = {}
    for split in SPLITS:
        path = json_path(data_dir, split)
        entries = read_split_file(path, source, (OFFICIAL_SHA256[split], OFFICIAL_BYTES[split],
                                                 "airsplay/VisualRelationships"),
                                  f"Image Editing Request {split}", "{'img0', 'img1', 'sents', 'uid'}")
        seen: set[str] = set()
        for i, e in enumerate(entries):
            if not isinstance(e, dict) or any(k not in e for k in KEYS):
                raise PipelineError(f"{path}: entry {i} is not an object with {', '.join(KEYS)}: {e!r}"[:300])
            uid = e["uid"]
            if not isinstance(uid, str) or not uid.strip():
                raise PipelineError(f"{path}: entry {i}: uid {uid!r} is not a non-empty string")
            for k in ("img0", "img1"):
                name = e[k]
                if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
                    raise PipelineError(f"{path}: uid {uid}: {k} {name!r} is not a bare file name")
            sents = e["sents"]
            if not isinstance(sents, list) or not all(isinstance(s, str) for s in sents):
                raise PipelineError(f"{path}: uid {uid}: 'sents' is not a list of strings")
            if not any(map(has_word, sents)):
                raise PipelineError(f"{path}: uid {uid}: no request ('sents' is {sents!r}); the release has none "
                                    f"such, the pair could be neither trained on nor scored")
            if uid in seen:
                raise PipelineError(f"{path}: uid {uid} occurs twice")
            seen.add(uid)
        out[split] = entries
    return out


def shared_pairs(splits: dict[str, list[dict]]) -> dict[tuple[str, str], list[str]]:
    """For each two release splits (in SPLITS order), the uids (of the later split) whose ``(img0, img1)``
    also occurs in the earlier one. These count entries: a pair listed twice in a split counts twice (the
    release's valid/test overlap is 55 distinct pairs, 66 test entries)."""
    pairs = {s: {(e["img0"], e["img1"]) for e in es} for s, es in splits.items()}
    names = list(splits)
    return {(a, b): [e["uid"] for e in splits[b] if (e["img0"], e["img1"]) in pairs[a]]
            for i, a in enumerate(names) for b in names[i + 1:]}


def source_counts(data_dir: str | Path, source: str) -> dict[str, dict[str, int]]:
    """Per split (manifest names): ``pairs`` (entries), ``distinct_pairs`` (distinct ``(img0, img1)``),
    ``requests`` (all of them), ``distinct_images``, ``requests_without_word``, and for every other split
    ``pairs_also_in_<split>`` (distinct ``(img0, img1)`` pairs both splits hold: 55 for valid/test in the
    release), ``entries_also_in_<split>`` (this split's entries whose pair the other holds: 58 valid / 66
    test) and ``images_also_in_<split>`` (files shared). The ``inspect`` stage adds these to its summary."""
    splits = read_splits(data_dir, source)
    images = {s: {e[k] for e in es for k in ("img0", "img1")} for s, es in splits.items()}
    pairs = {s: {(e["img0"], e["img1"]) for e in es} for s, es in splits.items()}
    out = {}
    for split, entries in splits.items():
        sents = [x for e in entries for x in e["sents"]]
        counts = {"pairs": len(entries), "distinct_pairs": len(pairs[split]), "requests": len(sents),
                  "distinct_images": len(images[split]),
                  "requests_without_word": sum(not has_word(x) for x in sents)}
        for other in splits:
            if other != split:
                counts[f"pairs_also_in_{SPLITS[other]}"] = len(pairs[split] & pairs[other])
                counts[f"entries_also_in_{SPLITS[other]}"] = sum((e["img0"], e["img1"]) in pairs[other]
                                                                for e in entries)
                counts[f"images_also_in_{SPLITS[other]}"] = len(images[split] & images[other])
        out[SPLITS[split]] = counts
    return out


def parse(data_dir: str | Path, source: str, generator_seed: int | None = None, check_images: bool = True,
          warnings: list[str] | None = None) -> list[dict]:
    """Read ``data_dir`` (see the module docstring) and return one manifest record per entry, train, val, test,
    each in file order. Pairs repeated across splits are kept and reported in ``warnings`` (when a list is
    given, else printed once); so are dropped requests without a word (they raise without a list)."""
    data_dir = Path(data_dir)
    splits = read_splits(data_dir, source)
    folder = data_dir / IMAGES
    if check_images and not folder.is_dir():
        raise PipelineError(f"Image Editing Request image folder missing: {folder} (place the Drive folder's "
                            f"image files there)")
    local: list[str] = []
    records: list[dict] = []
    owner: dict[str, str] = {}
    for split, entries in splits.items():
        path = json_path(data_dir, split)
        dropped: list[str] = []
        renamed: list[str] = []
        for e in entries:
            uid = e["uid"]
            for k in ("img0", "img1"):
                if check_images and not (folder / e[k]).is_file():
                    raise PipelineError(f"Image Editing Request image missing: {folder / e[k]} ({k} of uid {uid} "
                                        f"in {path})")
            kept = [x for x in e["sents"] if has_word(x)]
            if len(kept) < len(e["sents"]):
                if warnings is None:
                    raise PipelineError(f"{path}: uid {uid}: a request without a word (e.g. "
                                        f"{next(x for x in e['sents'] if not has_word(x))!r})")
                dropped.append(uid)
            pair_id = uid
            if owner.setdefault(uid, split) != split:
                pair_id = f"{SPLITS[split]}/{uid}"
                renamed.append(uid)
            records.append({"pair_id": pair_id, "index": len(records), "split": SPLITS[split],
                            "before": f"{IMAGES}/{e['img0']}", "after": f"{IMAGES}/{e['img1']}",
                            "change_type": CHANGE, "captions": kept, "labels": {}, "source": source,
                            "generator_seed": generator_seed})
        if dropped:
            local.append(f"{path}: requests without a word dropped (uid {', '.join(dropped[:5])}"
                         f"{' ...' if len(dropped) > 5 else ''})")
        if renamed:
            local.append(f"{path}: {len(renamed)} uid(s) also used by an earlier split, kept as "
                         f"{SPLITS[split]}/<uid>: {', '.join(renamed[:5])}{' ...' if len(renamed) > 5 else ''}")
    for (a, b), uids in shared_pairs(splits).items():
        if uids:
            ids = set(uids)
            distinct = len({(e["img0"], e["img1"]) for e in splits[b] if e["uid"] in ids})
            local.append(f"{distinct} distinct pair(s) ({len(uids)} entries) of {json_path(data_dir, b)} repeat "
                         f"an (img0, img1) pair of "
                         f"{json_path(data_dir, a)}, kept in both splits as released (uid "
                         f"{', '.join(uids[:5])}{' ...' if len(uids) > 5 else ''})")
    report(local, warnings, "Image Editing Request")
    return records
