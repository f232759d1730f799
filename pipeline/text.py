"""Stage ``text``: tokenisation, vocabulary from the training split, encoded labels.

Tokenisation follows the DUDA preprocessing (lower case, ``,`` and ``;`` kept as tokens, ``.`` and ``?``
dropped, whitespace split). The vocabulary is built from the training pairs' captions, change and
no-change alike. Every caption is encoded as ``<START> w1 .. wn <END>`` padded with ``<NULL>`` (0); DUDA's
official code stops on ``<NULL>`` instead of ``<END>``, which is the same decision under another name.
"""

from __future__ import annotations

import argparse
import collections
import re

import h5py
import numpy as np

from pipeline.errors import PipelineError
from pipeline.utils.io import atomic_path, read_json, read_jsonl, write_json

SPECIALS = ["<NULL>", "<UNK>", "<START>", "<END>"]
NULL, UNK, START, END = range(4)


def has_word(caption: str) -> bool:
    """Whether a caption has a letter or digit: the evaluation's tokenizer drops punctuation, and a reference
    left empty breaks the scorers (CIDEr-D of a change type whose references are all empty)."""
    return bool(re.search(r"[^\W_]", caption))


def caption_fault(captions) -> str | None:
    """Why one pair's caption list cannot be used (empty, or a caption without a word), or None."""
    if not isinstance(captions, list) or not captions:
        return "empty caption list"
    for c in captions:
        if not isinstance(c, str) or not has_word(c):
            return f"caption {c!r} has no word (empty or punctuation only)"
    return None


def tokenize(caption: str) -> list[str]:
    s = caption.lower().replace(",", " , ").replace(";", " ; ")
    s = re.sub(r"[.?!]", " ", s)
    return s.split()


class Vocab:
    def __init__(self, itow: list[str]):
        if itow[:4] != SPECIALS:
            raise PipelineError(f"vocabulary must start with {SPECIALS}, got {itow[:4]}")
        self.itow = list(itow)
        self.wtoi = {w: i for i, w in enumerate(self.itow)}

    def __len__(self) -> int:
        return len(self.itow)

    @classmethod
    def build(cls, captions, min_count: int = 1) -> "Vocab":
        counts = collections.Counter(w for c in captions for w in tokenize(c))
        words = sorted(w for w, n in counts.items() if n >= min_count)
        return cls(SPECIALS + words)

    @classmethod
    def load(cls, path) -> "Vocab":
        return cls(read_json(path)["itow"])

    def save(self, path) -> None:
        write_json(path, {"itow": self.itow})

    def encode(self, caption: str, max_words: int) -> tuple[np.ndarray, bool]:
        words = tokenize(caption)
        truncated = len(words) > max_words
        ids = [START] + [self.wtoi.get(w, UNK) for w in words[:max_words]] + [END]
        out = np.zeros(max_words + 2, dtype=np.int32)
        out[: len(ids)] = ids
        return out, truncated

    def decode(self, ids) -> str:
        words = []
        for i in ids:
            i = int(i)
            if i in (END, NULL):
                break
            if i == START:
                continue
            words.append(self.itow[i])
        return " ".join(words)


class Labels:
    """Encoded captions of every pair: ``labels[start[p]:end[p]]`` are pair ``p``'s references."""

    def __init__(self, path):
        with h5py.File(path, "r") as f:
            self.pair_ids = [s.decode() if isinstance(s, bytes) else s for s in f["pair_ids"][:]]
            self.start = f["start"][:]
            self.end = f["end"][:]
            self.labels = f["labels"][:]  # small: a few int32 per caption
        self.row = {p: i for i, p in enumerate(self.pair_ids)}
        self.path = path

    def of(self, pair_id: str) -> np.ndarray:
        if pair_id not in self.row:
            raise PipelineError(f"pair {pair_id!r} has no encoded captions in {self.path}")
        i = self.row[pair_id]
        return self.labels[self.start[i]:self.end[i]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--manifest", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--max-words", type=int, default=22)
    p.add_argument("--min-count", type=int, default=1)


def run(args: argparse.Namespace) -> None:
    import os

    records = read_jsonl(args.manifest)
    train_caps = [c for r in records if r["split"] == "train" for c in r["captions"]]
    if not train_caps:
        raise PipelineError(f"{args.manifest}: no training captions")
    vocab = Vocab.build(train_caps, args.min_count)
    rows, start, end, n_trunc, n_unk = [], [], [], 0, 0
    for r in records:
        start.append(len(rows))
        for c in r["captions"]:
            ids, t = vocab.encode(c, args.max_words)
            n_trunc += t
            n_unk += int((ids == UNK).any())
            rows.append(ids)
        end.append(len(rows))
    os.makedirs(args.out_dir, exist_ok=True)
    vocab.save(os.path.join(args.out_dir, "vocab.json"))
    with atomic_path(os.path.join(args.out_dir, "labels.h5")) as tmp:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("pair_ids", data=np.array([r["pair_id"] for r in records], dtype=object),
                             dtype=h5py.string_dtype())
            f.create_dataset("start", data=np.array(start, dtype=np.int64))
            f.create_dataset("end", data=np.array(end, dtype=np.int64))
            f.create_dataset("labels", data=np.stack(rows))
            f.attrs["max_words"] = args.max_words
            f.attrs["vocab_size"] = len(vocab)
    stats = {"vocab_size": len(vocab), "captions": len(rows), "truncated": n_trunc, "with_unknown_words": n_unk,
             "max_words": args.max_words}
    write_json(os.path.join(args.out_dir, "text_stats.json"), stats)
    print(f"text: {stats}")
