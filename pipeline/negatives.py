"""Stage ``negatives``: the hard negative captions of IDC-PCL's Fine-grained Difference Aligning task.

IDC-PCL (AAAI 2022) §2.2 and appendix A.2 rewrite every caption three ways; the official repository ships
only the finished files (``*_neg_tfidf6.json``), so this module is where the construction is written down:

- **Retrieve**: the captions of *other* pairs most similar to the caption by TF-IDF cosine (scikit-learn,
  fitted on the training captions). Similarities are sparse-times-sparse (or, for a small vocabulary, dense
  BLAS) products of the L2-normalised TF-IDF matrix in row chunks, with a top-k per row: never a Python loop
  over pairs of captions. Identical strings are retrieved once (a caption text's neighbours do not depend on
  which pair wrote it), and a neighbour equal to a reference of the caption's own pair is skipped, so what
  is left is always another pair's caption.
- **Replace**: the adjectives and nouns of the caption (POS tagger: ``pipeline.pos_tagging``) are ranked
  by their TF-IDF weight in the sentence; the top ``replace_fraction`` (50 %, at least one) are replaced by
  words of the same tag drawn at random from per-tag vocabularies. The vocabularies follow the appendix:
  the top-50 % annotated words of every training sentence, kept when their document frequency in the
  training captions is at least ``min_df`` (10).
- **Confuse**: the subject (the first noun phrase) is swapped, either with the subject of another
  sentence (partners taken in TF-IDF order, so the rest of the sentence stays plausible) or, within the
  sentence, with the last noun phrase that opens like the subject (``the red cube … behind the blue
  sphere`` ↔, ``animal1 … than animal2`` ↔). Noun phrases are maximal runs of DET/NUM/ADJ/NOUN/PROPN
  tokens ending in a noun; a sentence with none uses a leading pronoun (``nothing has changed``).

Six negatives per caption, retrieve:replace:confuse = 2:2:2 (§3.1), all distinct and none equal to any
reference caption of the pair. When a kind cannot produce its share for a caption (no taggable word, no
noun phrase), the slot is filled by the next retrieved caption and counted under ``fallbacks``.

Output ``negatives.jsonl``: one JSON line per (pair, caption) of the train and val splits, in the official
record layout (``img1``, ``img2``, ``sentences`` = [the caption], ``neg_samples`` = [6 captions]; captions
pre-tokenised, space-joined, as the official loader splits them on spaces), plus ``neg_kinds``,
``pair_id``, ``split``, ``caption_index`` and ``tagger`` (which tagger produced the file). Retrieval looks
only inside the caption's own split (validation negatives never leak training captions, and vice versa).
``negatives_stats.json`` beside it: counts, fallbacks, the appendix's Table 7 statistics (average replaced
words, average length, %) and Table 8 (per-tag vocabulary sizes and their most frequent words).
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pipeline.errors import PipelineError
from pipeline.text import tokenize
from pipeline.utils.io import read_jsonl, write_json, write_jsonl

KINDS = ("retrieve", "replace", "confuse")
SPLITS = ("train", "val")
# The paper: "adjectives and nouns" (CoreNLP, Penn Treebank tags). A word counts when its Universal tag says so,
# or its PTB tag does (PTB tags "nothing" NN, as the paper's tagger did; Universal POS says PRON).
REPLACEABLE = frozenset({"ADJ", "NOUN", "JJ", "JJR", "JJS", "NN", "NNS"})
NP_TOKENS = frozenset({"DET", "NUM", "ADJ", "NOUN", "PROPN"})
NP_HEADS = frozenset({"NOUN", "PROPN"})


@dataclass(frozen=True)
class Settings:
    n_retrieve: int = 2
    n_replace: int = 2
    n_confuse: int = 2
    replace_fraction: float = 0.5
    min_df: int = 10
    seed: int = 0
    neighbours: int = 32  # neighbours kept per caption text; a caption needing more gets its full row
    max_tries: int = 20  # random draws per Replace negative before giving up on that slot

    @property
    def n_total(self) -> int:
        return self.n_retrieve + self.n_replace + self.n_confuse


# ---------------------------------------------------------------------------------------------- TF-IDF
def fit_tfidf(train_texts: list[str]):
    """scikit-learn TF-IDF (smooth idf, L2 norm) over pre-tokenised, space-joined training captions."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    vec = TfidfVectorizer(analyzer=str.split, dtype=np.float32)
    vec.fit(train_texts)
    return vec


def _chunk_rows(m: int, budget: int = 16_000_000) -> int:
    return max(1, min(4096, budget // max(m, 1)))


def similarity_rows(X, rows: np.ndarray) -> np.ndarray:
    """Cosine similarities of ``rows`` of the L2-normalised sparse matrix ``X`` with all its rows: [len, m]."""
    return np.asarray((X[rows] @ X.T).todense(), dtype=np.float32)


def top_neighbours(X, k: int, dense_limit: int = 50_000_000) -> tuple[np.ndarray, np.ndarray]:
    """For every row of ``X`` (L2-normalised, [m, V], sparse), its ``k`` most similar *other* rows by cosine.

    Returns (index [m, k], cosine [m, k]), best first, equal cosines in index order. Works in row chunks:
    ``X[chunk] @ X.T`` then a top-k per row (a small vocabulary multiplies dense with BLAS instead, same
    numbers); memory is bounded by the chunk, never m×m.
    """
    import torch

    m, v = X.shape
    k = max(0, min(k, m - 1))
    idx = np.zeros((m, k), dtype=np.int64)
    sim = np.zeros((m, k), dtype=np.float32)
    if k == 0:
        return idx, sim
    dense = torch.from_numpy(X.toarray()) if v * m <= dense_limit else None
    step = _chunk_rows(m)
    for a in range(0, m, step):
        b = min(m, a + step)
        if dense is not None:
            s = dense[a:b] @ dense.T
        else:
            s = torch.from_numpy(similarity_rows(X, np.arange(a, b)))
        s[torch.arange(b - a), torch.arange(a, b)] = -math.inf  # not itself
        # one spare candidate so that a tie at the cut can be ordered by index below
        vals, cand = torch.topk(s, min(k + 1, m), dim=1)
        vals, cand = vals.numpy(), cand.numpy()
        order = np.lexsort((cand, -vals), axis=1)[:, :k]
        idx[a:b] = np.take_along_axis(cand, order, 1)
        sim[a:b] = np.take_along_axis(vals, order, 1)
    return idx, sim


def full_ranking(X, row: int) -> np.ndarray:
    """All other rows by decreasing cosine with ``row`` (ties in index order): the fallback of a caption
    whose kept neighbours were all references of its own pair."""
    s = similarity_rows(X, np.array([row]))[0]
    s[row] = -np.inf
    order = np.lexsort((np.arange(len(s)), -s))
    return order[:-1]


# --------------------------------------------------------------------------------------------- Replace
def word_scores(tokens: list[str], idf: dict[str, float]) -> list[float]:
    """TF-IDF weight of each token in its sentence (tf = count in the sentence; unknown words weigh 0)."""
    tf = Counter(tokens)
    return [tf[w] * idf.get(w, 0.0) for w in tokens]


def ranked_annotated(tokens, tags, idf) -> list[int]:
    """Positions of the adjectives and nouns, most important (TF-IDF) first, then left to right."""
    scores = word_scores(tokens, idf)
    pos = [i for i, (u, t) in enumerate(tags) if u in REPLACEABLE or t in REPLACEABLE]
    return sorted(pos, key=lambda i: (-scores[i], i))


def build_replace_vocab(sentences, tagged, idf, df: Counter, fraction: float, min_df: int) -> dict[str, list[str]]:
    """Per-tag vocabularies (appendix A.2): the top ``fraction`` annotated words of every training sentence,
    kept when their document frequency is at least ``min_df``; words sorted by frequency, then alphabetically."""
    seen: dict[str, Counter] = {}
    for tokens, tags in zip(sentences, tagged):
        ranked = ranked_annotated(tokens, tags, idf)
        for i in ranked[: math.ceil(fraction * len(ranked))]:
            seen.setdefault(tags[i][1], Counter())[tokens[i]] += 1
    vocab = {}
    for tag, words in sorted(seen.items()):
        kept = sorted((w for w in words if df[w] >= min_df), key=lambda w: (-df[w], w))
        if kept:
            vocab[tag] = kept
    return vocab


def replace_once(tokens, tags, ranked: list[int], vocab: dict[str, list[str]], fraction: float,
                 rng: random.Random) -> tuple[list[str], int]:
    """One Replace rewrite: the top ``fraction`` of the ranked annotated words (those whose tag vocabulary
    offers another word; the next ranked word stands in for one that has none) get a random word of the
    same tag. Returns (tokens, number replaced)."""
    usable = [i for i in ranked if any(w != tokens[i] for w in vocab.get(tags[i][1], ()))]
    n = min(len(usable), math.ceil(fraction * len(ranked))) if ranked else 0
    out = list(tokens)
    for i in usable[:n]:
        choices = [w for w in vocab[tags[i][1]] if w != tokens[i]]
        out[i] = choices[rng.randrange(len(choices))]
    return out, n


# --------------------------------------------------------------------------------------------- Confuse
def noun_phrases(tags) -> list[tuple[int, int]]:
    """Spans [start, end) of the noun phrases: maximal runs of DET/NUM/ADJ/NOUN/PROPN cut after their last
    noun; a run without a noun is none. A sentence without any uses a leading pronoun as its subject."""
    spans, i, n = [], 0, len(tags)
    while i < n:
        if tags[i][0] not in NP_TOKENS:
            i += 1
            continue
        j = i
        while j < n and tags[j][0] in NP_TOKENS:
            j += 1
        heads = [p for p in range(i, j) if tags[p][0] in NP_HEADS]
        if heads:
            spans.append((i, heads[-1] + 1))
        i = j
    if not spans and n and tags[0][0] == "PRON":
        spans.append((0, 1))
    return spans


def swap_within(tokens, tags, spans) -> list[str] | None:
    """Subject ↔ object: the first noun phrase with the last later one that opens with the same kind of
    word (determiner with determiner, bare noun with bare noun)."""
    if len(spans) < 2:
        return None
    s0, e0 = spans[0]
    for s1, e1 in reversed(spans[1:]):
        if tags[s1][0] == tags[s0][0] and tokens[s0:e0] != tokens[s1:e1]:
            return tokens[:s0] + tokens[s1:e1] + tokens[e0:s1] + tokens[s0:e0] + tokens[e1:]
    return None


def swap_subject(tokens, spans, partner_tokens, partner_spans) -> list[str] | None:
    """This sentence with the partner sentence's subject in place of its own."""
    if not spans or not partner_spans:
        return None
    s0, e0 = spans[0]
    p0, q0 = partner_spans[0]
    subject = partner_tokens[p0:q0]
    if subject == tokens[s0:e0]:
        return None
    return tokens[:s0] + subject + tokens[e0:]


# ------------------------------------------------------------------------------------------- assembly
class SplitIndex:
    """The unique caption texts of one split with their tags, noun phrases and TF-IDF neighbours."""

    def __init__(self, texts: list[str], vec, tagger, k: int):
        self.texts = sorted(set(texts))
        self.id = {t: i for i, t in enumerate(self.texts)}
        self.tokens = [t.split() for t in self.texts]
        self.tags = tagger.tag(self.tokens) if self.texts else []
        self.spans = [noun_phrases(t) for t in self.tags]
        self.X = vec.transform(self.texts)
        self.nbr, self.nbr_sim = top_neighbours(self.X, k)

    def neighbours(self, i: int, exhausted: bool = False) -> np.ndarray:
        return full_ranking(self.X, i) if exhausted else self.nbr[i]


def _ranked_candidates(index: SplitIndex, q: int):
    """Neighbour ids of text ``q`` in TF-IDF order: the kept top-k, then (if ever needed) the rest."""
    yield from index.neighbours(q)
    kept = set(index.neighbours(q).tolist())
    for j in index.neighbours(q, exhausted=True):
        if int(j) not in kept:
            yield int(j)


def negatives_for_caption(text: str, refs: set[str], index: SplitIndex, idf, vocab, s: Settings,
                          rng: random.Random, stats: dict) -> tuple[list[str], list[str]]:
    """The ``s.n_total`` negatives of one caption and their kinds, in retrieve, replace, confuse order."""
    q = index.id[text]
    tokens, tags, spans = index.tokens[q], index.tags[q], index.spans[q]
    taken: set[str] = set()
    out: dict[str, list[str]] = {k: [] for k in KINDS}

    def ok(cand: str) -> bool:
        return cand not in refs and cand not in taken

    def add(kind: str, cand: str) -> None:
        taken.add(cand)
        out[kind].append(cand)

    retrieved = (index.texts[j] for j in _ranked_candidates(index, q))

    def next_retrieved() -> str | None:
        for cand in retrieved:
            if ok(cand):
                return cand
        return None

    for _ in range(s.n_retrieve):
        cand = next_retrieved()
        if cand is None:
            break
        add("retrieve", cand)

    ranked = ranked_annotated(tokens, tags, idf)
    for _ in range(s.n_replace):
        for _try in range(s.max_tries):
            new, n = replace_once(tokens, tags, ranked, vocab, s.replace_fraction, rng)
            cand = " ".join(new)
            if n and ok(cand):
                add("replace", cand)
                stats["replaced_words"].append(n)
                stats["replaced_ratio"].append(n / len(tokens))
                break

    within = swap_within(tokens, tags, spans)
    if within is not None and ok(" ".join(within)) and s.n_confuse:
        add("confuse", " ".join(within))
    if len(out["confuse"]) < s.n_confuse and spans:
        for j in itertools.islice(_ranked_candidates(index, q), len(index.nbr[q]) + 512):
            new = swap_subject(tokens, spans, index.tokens[j], index.spans[j])
            if new is not None and ok(" ".join(new)):
                add("confuse", " ".join(new))
                if len(out["confuse"]) == s.n_confuse:
                    break

    negs, kinds = [], []
    for kind, want in zip(KINDS, (s.n_retrieve, s.n_replace, s.n_confuse)):
        got = out[kind][:want]
        negs += got
        kinds += [kind] * len(got)
        for _ in range(want - len(got)):  # this kind could not make its share: next retrieved caption
            cand = next_retrieved()
            if cand is None:
                raise PipelineError(f"caption {text!r}: its split has fewer than {s.n_total} distinct captions outside "
                                    "its pair's references; cannot build the negatives")
            taken.add(cand)
            negs.append(cand)
            kinds.append("retrieve")
            stats["fallbacks"][kind] += 1
    return negs, kinds


def build(records: list[dict], tagger, s: Settings = Settings(), splits=SPLITS, log=print) -> tuple[list[dict], dict]:
    """Negatives of every caption of ``splits`` (manifest records); returns (output records, statistics)."""
    t0 = time.time()
    by_split = {sp: [r for r in records if r["split"] == sp] for sp in splits}
    train_texts = [" ".join(tokenize(c)) for r in by_split.get("train", []) for c in r["captions"]]
    if not train_texts:
        raise PipelineError("no training captions: the TF-IDF statistics and Replace vocabularies need them")
    vec = fit_tfidf(train_texts)
    idf = dict(zip(vec.get_feature_names_out(), vec.idf_.astype(float)))
    df = Counter(w for t in train_texts for w in set(t.split()))
    indexes = {}
    for sp, recs in by_split.items():
        texts = [" ".join(tokenize(c)) for r in recs for c in r["captions"]]
        max_refs = max((len(r["captions"]) for r in recs), default=0)
        indexes[sp] = SplitIndex(texts, vec, tagger, max(s.neighbours, max_refs + 2 * s.n_total))
        log(f"negatives: {sp}: {len(texts)} captions, {len(indexes[sp].texts)} distinct; "
            f"neighbours in {time.time() - t0:.1f}s")
    train_index = indexes["train"]
    train_tagged = {t: tg for t, tg in zip(train_index.texts, train_index.tags)}
    vocab = build_replace_vocab([t.split() for t in train_texts], [train_tagged[t] for t in train_texts], idf, df,
                                s.replace_fraction, s.min_df)
    out, stats_by_split = [], {}
    for sp, recs in by_split.items():
        st = {"replaced_words": [], "replaced_ratio": [], "fallbacks": {k: 0 for k in KINDS}, "kinds": Counter()}
        n_caps, lengths = 0, []
        for r in recs:
            texts = [" ".join(tokenize(c)) for c in r["captions"]]
            refs = set(texts)
            for j, text in enumerate(texts):
                rng = random.Random(f"{s.seed}/{r['pair_id']}/{j}")
                negs, kinds = negatives_for_caption(text, refs, indexes[sp], idf, vocab, s, rng, st)
                st["kinds"].update(kinds)
                lengths.append(len(text.split()))
                n_caps += 1
                out.append({"img1": Path(r["before"]).name, "img2": Path(r["after"]).name, "sentences": [text],
                            "neg_samples": negs, "neg_kinds": kinds, "pair_id": r["pair_id"], "split": sp,
                            "caption_index": j, "tagger": tagger.name})
        rw, rr = st["replaced_words"], st["replaced_ratio"]
        stats_by_split[sp] = {
            "pairs": len(recs), "captions": n_caps, "distinct_captions": len(indexes[sp].texts),
            "negatives_by_kind": dict(sorted(st["kinds"].items())), "fallbacks": st["fallbacks"],
            "table7": {"avg_replaced_words": round(float(np.mean(rw)), 3) if rw else None,
                       "avg_len": round(float(np.mean(lengths)), 3) if lengths else None,
                       "percent": round(100 * float(np.mean(rr)), 2) if rr else None,
                       "replace_negatives": len(rw)},
        }
        log(f"negatives: {sp}: {n_caps} captions done in {time.time() - t0:.1f}s")
    stats = {
        "tagger": tagger.name,
        "settings": asdict(s),
        "splits": stats_by_split,
        "table7": stats_by_split.get("train", {}).get("table7"),
        "table8": {tag: {"size": len(words), "words": words[:10]} for tag, words in vocab.items()},
        "replace_vocab": vocab,
        "seconds": round(time.time() - t0, 2),
    }
    return out, stats


def load(path, split: str | None = None, n_negatives: int | None = None) -> list[dict]:
    """Read a negatives file (this stage's output or an official ``*_neg_tfidf6.json``), checking the layout."""
    recs = read_jsonl(path)
    for i, r in enumerate(recs, 1):
        for key in ("img1", "img2", "sentences", "neg_samples"):
            if key not in r:
                raise PipelineError(f"{path}:{i}: record lacks {key!r} (official layout: img1, img2, sentences, neg_samples)")
        if n_negatives is not None and len(r["neg_samples"]) != n_negatives:
            raise PipelineError(f"{path}:{i}: {len(r['neg_samples'])} negatives, expected {n_negatives}")
    if split is not None:
        recs = [r for r in recs if r.get("split", split) == split]
    return recs


# ------------------------------------------------------------------------------------------------ CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--manifest", required=True)
    p.add_argument("--dataset", required=True, help="dataset id (chooses the synthetic world's lexicon)")
    p.add_argument("--out", required=True, help="results/<dataset>/text/negatives.jsonl")
    p.add_argument("--stats", required=True, help="results/<dataset>/text/negatives_stats.json")
    p.add_argument("--tagger", choices=("lexicon", "stanza"), default="stanza")
    p.add_argument("--stanza-dir", default="resources/stanza")
    p.add_argument("--per-kind", type=int, nargs=3, default=[2, 2, 2], metavar=("RETRIEVE", "REPLACE", "CONFUSE"))
    p.add_argument("--replace-fraction", type=float, default=0.5)
    p.add_argument("--min-df", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> None:
    from pipeline import cross_task
    from pipeline.pos_tagging import make_tagger

    if not 0 < args.replace_fraction <= 1:
        raise PipelineError(f"--replace-fraction must be in (0, 1], got {args.replace_fraction}")
    s = Settings(*args.per_kind, replace_fraction=args.replace_fraction, min_df=args.min_df, seed=args.seed)
    records = read_jsonl(args.manifest)
    if records and cross_task.is_single_image(records[0]):  # GIC captions (CUB): pseudo pairs, no Confuse
        records, s = cross_task.pseudo_pairs(records), cross_task.gic_settings(s)
    tagger = make_tagger(args.tagger, args.dataset, args.stanza_dir)
    out, stats = build(records, tagger, s)
    write_jsonl(args.out, out)
    stats["manifest"] = str(args.manifest)
    write_json(args.stats, stats)
    print(f"negatives: {len(out)} records -> {args.out} (tagger {tagger.name}); Table 7 {stats['table7']}; "
          f"Table 8 sizes {({t: v['size'] for t, v in stats['table8'].items()})}; {stats['seconds']}s")
