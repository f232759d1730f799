"""FDA hard negatives: retrieve / replace / confuse, the 2:2:2 mix, the official record layout, the taggers."""

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.feature_extraction.text import TfidfVectorizer

from pipeline import negatives as ng
from pipeline.errors import PipelineError
from pipeline.pos_tagging import LexiconTagger, StanzaTagger, stanza_ready
from pipeline.synth import captions as cap
from pipeline.synth.scene import MATERIALS, SIZES, SceneObject, default_view, random_attributes, random_position

ROOT = Path(__file__).resolve().parent.parent
LEX = LexiconTagger.for_dataset("clevr_change")


def synth_records(n_pairs: int, seed: int = 0) -> list[dict]:
    """Changed + distractor pairs with the synthetic world's captions; 3 of 4 indices train, 1 val."""
    rng = np.random.default_rng(seed)
    camera = default_view().camera
    records, index = [], 0
    types = ("color", "material", "add", "drop", "move")
    while len(records) < n_pairs:
        objs = []
        for _ in range(int(rng.integers(3, 8))):
            a = random_attributes(rng)
            pos = random_position(rng, SIZES[a["size"]], objs)
            if pos is not None:
                objs.append(SceneObject(x=pos[0], y=pos[1], **a))
        target, ctype = int(rng.integers(len(objs))), types[index % 5]
        new = None
        if ctype == "color":
            new = next(c for c in cap.COLOR_NAMES if c != objs[target].color)
        elif ctype == "material":
            new = next(m for m in MATERIALS if m != objs[target].material)
        try:
            caps = cap.change_captions(rng, ctype, objs, target, camera, new, n=6)
        except ValueError:
            continue
        split = "val" if index % 4 == 0 else "train"
        key = f"{index:06d}.png"
        records.append({"pair_id": key, "split": split, "before": f"images/CLEVR_default_{key}",
                        "after": f"sc_images/CLEVR_semantic_{key}", "captions": caps})
        records.append({"pair_id": key + "_n", "split": split, "before": f"images/CLEVR_default_{key}",
                        "after": f"nsc_images/CLEVR_nonsemantic_{key}", "captions": cap.no_change_captions(rng, 6)})
        index += 1
    return records


@pytest.fixture(scope="module")
def built():
    records = synth_records(240)
    out, stats = ng.build(records, LEX, ng.Settings(min_df=3), log=lambda m: None)
    return records, out, stats


def refs_of(records):
    return {r["pair_id"]: {" ".join(c.split()) for c in r["captions"]} for r in records}


def test_every_negative_differs_from_every_reference_of_its_pair_and_from_each_other(built):
    records, out, _ = built
    refs = refs_of(records)
    assert len(out) == sum(len(r["captions"]) for r in records)
    for o in out:
        assert len(o["neg_samples"]) == 6 and len(set(o["neg_samples"])) == 6
        assert not set(o["neg_samples"]) & refs[o["pair_id"]], o


def test_retrieve_returns_other_pairs_captions_ranked_by_tfidf_cosine(built):
    records, out, _ = built
    refs = refs_of(records)
    train = [c for r in records if r["split"] == "train" for c in r["captions"]]
    vec = TfidfVectorizer(analyzer=str.split).fit(train)  # independent of the module's own TF-IDF
    checked = 0
    for split in ("train", "val"):
        texts = sorted({c for r in records if r["split"] == split for c in r["captions"]})
        owners = {}
        for r in records:
            if r["split"] == split:
                for c in r["captions"]:
                    owners.setdefault(c, set()).add(r["pair_id"])
        X = vec.transform(texts)
        cos = (X @ X.T).toarray()
        row = {t: i for i, t in enumerate(texts)}
        for o in (o for o in out if o["split"] == split):
            q = row[o["sentences"][0]]
            got = [n for n, k in zip(o["neg_samples"], o["neg_kinds"]) if k == "retrieve"][:2]
            eligible = [t for t in texts if t not in refs[o["pair_id"]]]
            for n in got:
                assert owners[n] - {o["pair_id"]}, "a retrieved caption belongs to another pair"
            best = max(cos[q, row[t]] for t in eligible)
            assert math.isclose(cos[q, row[got[0]]], best, rel_tol=1e-5, abs_tol=1e-6)
            second = max(cos[q, row[t]] for t in eligible if t != got[0])
            assert math.isclose(cos[q, row[got[1]]], second, rel_tol=1e-5, abs_tol=1e-6)
            checked += 1
    assert checked == len(out)


@pytest.mark.parametrize("dense_limit", [10**9, 0])  # dense BLAS path and sparse product path
def test_top_neighbours_equals_brute_force(dense_limit):
    rng = np.random.default_rng(0)
    X = sp.random(300, 40, density=0.15, format="csr", random_state=1, dtype=np.float32)
    X.data = np.round(X.data * 4) / 4 + 0.25  # coarse values: many exact ties
    X = sp.csr_matrix(X.multiply(1 / np.sqrt(X.multiply(X).sum(1) + 1e-12)))
    idx, sim = ng.top_neighbours(X, 7, dense_limit=dense_limit)
    full = (X @ X.T).toarray()
    for i in rng.choice(300, 60, replace=False):
        s = full[i].copy()
        s[i] = -np.inf
        order = np.lexsort((np.arange(300), -s))[:7]
        np.testing.assert_allclose(sim[i], s[order], rtol=1e-5, atol=1e-6)
        assert i not in idx[i]
        # equal cosines are listed in index order
        for a, b, va, vb in zip(idx[i][:-1], idx[i][1:], sim[i][:-1], sim[i][1:]):
            assert va > vb or (va == vb and a < b)
        np.testing.assert_allclose(full[i, idx[i]], sim[i], rtol=1e-5, atol=1e-6)


def test_replace_changes_only_tagged_words_keeps_their_tag_and_takes_the_top_half(built):
    records, out, stats = built
    vocab = stats["replace_vocab"]
    n = 0
    for o in out:
        src = o["sentences"][0].split()
        tags = LEX.tag([src])[0]
        for neg, kind in zip(o["neg_samples"], o["neg_kinds"]):
            if kind != "replace":
                continue
            new = neg.split()
            assert len(new) == len(src)
            changed = [i for i, (a, b) in enumerate(zip(src, new)) if a != b]
            assert changed
            for i in changed:
                assert tags[i][0] in ("ADJ", "NOUN")
                assert LEX.lexicon[new[i]] == tags[i][0]  # same tag
                assert new[i] in vocab[tags[i][1]]
            n_annot = sum(t[0] in ("ADJ", "NOUN") for t in tags)
            assert len(changed) <= math.ceil(0.5 * n_annot)
            n += 1
    assert n > 0.7 * 2 * len(out)


def test_replace_ranks_by_tfidf_and_respects_the_fraction():
    tokens = "the big red cube is behind the small sphere".split()
    tags = LEX.tag([tokens])[0]
    idf = {"the": 1.0, "big": 2.0, "red": 3.0, "cube": 1.5, "is": 1.0, "behind": 1.0, "small": 2.5, "sphere": 4.0}
    # annotated: big(2) red(3) cube(1.5) small(2.5) sphere(4): ranked sphere, red, small, big, cube
    assert ng.ranked_annotated(tokens, tags, idf) == [8, 2, 7, 1, 3]
    vocab = {"ADJ": ["green", "tiny"], "NOUN": ["cylinder"]}
    import random

    new, n = ng.replace_once(tokens, tags, ng.ranked_annotated(tokens, tags, idf), vocab, 0.5, random.Random(0))
    assert n == 3  # ceil(0.5 * 5)
    changed = [i for i, (a, b) in enumerate(zip(tokens, new)) if a != b]
    assert changed == [2, 7, 8] and new[8] == "cylinder" and new[2] in ("green", "tiny")
    # a word whose tag vocabulary has nothing else to offer is skipped for the next ranked one
    new, n = ng.replace_once(tokens, tags, ng.ranked_annotated(tokens, tags, idf), {"ADJ": ["green"]}, 0.5,
                             random.Random(0))
    assert n == 3 and [i for i, (a, b) in enumerate(zip(tokens, new)) if a != b] == [1, 2, 7]


def test_replace_vocabulary_keeps_top_half_words_with_enough_document_frequency():
    from collections import Counter

    sents = [s.split() for s in ["the red cube moved"] * 12 + ["the blue sphere moved"] * 3]
    tagged = LEX.tag(sents)
    idf = {"the": 1.0, "moved": 1.0, "red": 2.0, "cube": 1.0, "blue": 3.0, "sphere": 1.0}
    df = Counter(w for s in sents for w in set(s))
    vocab = ng.build_replace_vocab(sents, tagged, idf, df, 0.5, 10)
    assert vocab == {"ADJ": ["red"]}  # cube/sphere never in a sentence's top half; blue has df 3 < 10


def test_confuse_swaps_subjects_between_and_within_sentences():
    def parts(s):
        t = s.split()
        tags = LEX.tag([t])[0]
        return t, tags, ng.noun_phrases(tags)

    t, tags, spans = parts("the red cube has been added")
    p, ptags, pspans = parts("the small metal sphere moved")
    assert " ".join(ng.swap_subject(t, spans, p, pspans)) == "the small metal sphere has been added"
    t, tags, spans = parts("the red cube that is to the left of the blue sphere moved")
    assert " ".join(ng.swap_within(t, tags, spans)) == "the blue sphere that is to the left of the red cube moved"
    # bird data: bare nouns (as stanza tags animal1/animal2) swap with each other
    toks = "animal1 has a longer tail than animal2".split()
    btags = [("NOUN", "NN"), ("VERB", "VBZ"), ("DET", "DT"), ("ADJ", "JJR"), ("NOUN", "NN"), ("ADP", "IN"), ("NOUN", "NN")]
    assert " ".join(ng.swap_within(toks, btags, ng.noun_phrases(btags))) == "animal2 has a longer tail than animal1"
    t, tags, spans = parts("nothing has changed")  # no noun phrase: the leading pronoun is the subject
    assert spans == [(0, 1)]


def test_confuse_negatives_in_the_output_are_subject_swaps(built):
    records, out, _ = built
    subjects = set()
    for r in records:
        for c in r["captions"]:
            t = c.split()
            spans = ng.noun_phrases(LEX.tag([t])[0])
            if spans:
                subjects.add(" ".join(t[slice(*spans[0])]))
    for o in out:
        t = o["sentences"][0].split()
        tags = LEX.tag([t])[0]
        spans = ng.noun_phrases(tags)
        within = ng.swap_within(t, tags, spans)
        for neg, kind in zip(o["neg_samples"], o["neg_kinds"]):
            if kind != "confuse":
                continue
            if within is not None and neg == " ".join(within):
                continue
            s0, e0 = spans[0]
            head, tail = " ".join(t[:s0]), " ".join(t[e0:])
            assert neg.startswith(head) and neg.endswith(tail)
            middle = neg[len(head):len(neg) - len(tail)].strip()
            assert middle in subjects and middle != " ".join(t[s0:e0])


def test_mix_is_two_retrieve_two_replace_two_confuse(built):
    records, out, stats = built
    fallback_slots = 0
    for o in out:
        t = o["sentences"][0].split()
        tags = LEX.tag([t])[0]
        replaceable = any(u in ("ADJ", "NOUN") for u, _ in tags)
        if replaceable and ng.noun_phrases(tags):
            assert o["neg_kinds"] == ["retrieve"] * 2 + ["replace"] * 2 + ["confuse"] * 2, o
        else:  # e.g. "nothing was modified": no adjective or noun to replace; filled by retrieval, counted
            fallback_slots += 6 - 2 - o["neg_kinds"].count("confuse") - o["neg_kinds"].count("replace")
    assert fallback_slots > 0  # the fixture has such captions
    fb = {k: sum(s["fallbacks"][k] for s in stats["splits"].values()) for k in ng.KINDS}
    assert sum(fb.values()) == fallback_slots
    kinds = sum((o["neg_kinds"] for o in out), [])
    assert kinds.count("replace") == 2 * len(out) - fb["replace"]
    assert kinds.count("confuse") == 2 * len(out) - fb["confuse"]
    assert kinds.count("retrieve") == 2 * len(out) + sum(fb.values())


def test_output_loads_with_the_official_record_layout(built, tmp_path):
    records, out, stats = built
    from pipeline.utils.io import write_jsonl

    path = tmp_path / "train_neg_tfidf6.json"
    write_jsonl(path, [o for o in out if o["split"] == "train"])
    # what the official loader (clver/utils.py load_neg_data) does with each line
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            j = json.loads(line.strip())
            for des in j["sentences"]:
                rows.append({"img1": j["img1"], "img2": j["img2"], "sentences": des.split(" "),
                             "negs": [c.split(" ") for c in j["neg_samples"]]})
    assert len(rows) == sum(len(r["captions"]) for r in records if r["split"] == "train")
    assert all(len(r["negs"]) == 6 and all(r["negs"]) for r in rows)
    assert all(r["img1"].startswith("CLEVR_default_") for r in rows)
    assert {r["img2"].split("_")[1] for r in rows} == {"semantic", "nonsemantic"}  # type parsed as officially
    assert all(o["tagger"] == LEX.name for o in out) and stats["tagger"] == LEX.name
    assert len(ng.load(path, n_negatives=6)) == len(rows)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"img1": "a", "img2": "b", "sentences": ["x"]}) + "\n")
    with pytest.raises(PipelineError, match="neg_samples"):
        ng.load(bad)


def test_statistics_of_tables_7_and_8(built):
    records, out, stats = built
    t7 = stats["table7"]
    reps = [(o["sentences"][0].split(), n.split()) for o in out if o["split"] == "train"
            for n, k in zip(o["neg_samples"], o["neg_kinds"]) if k == "replace"]
    n_rep = [sum(a != b for a, b in zip(s, n)) for s, n in reps]
    assert t7["replace_negatives"] == len(reps)
    assert math.isclose(t7["avg_replaced_words"], np.mean(n_rep), abs_tol=1e-3)
    lens = [len(o["sentences"][0].split()) for o in out if o["split"] == "train"]
    assert math.isclose(t7["avg_len"], np.mean(lens), abs_tol=1e-3)
    assert math.isclose(t7["percent"], 100 * np.mean([k / len(s) for k, (s, _) in zip(n_rep, reps)]), abs_tol=0.01)
    assert set(stats["table8"]) == {"ADJ", "NOUN"}
    assert all(v["size"] == len(stats["replace_vocab"][t]) for t, v in stats["table8"].items())


def test_same_seed_same_negatives_other_seed_other_replacements():
    records = synth_records(40)
    a, _ = ng.build(records, LEX, ng.Settings(min_df=2), log=lambda m: None)
    b, _ = ng.build(records, LEX, ng.Settings(min_df=2), log=lambda m: None)
    c, _ = ng.build(records, LEX, ng.Settings(min_df=2, seed=1), log=lambda m: None)
    assert a == b
    assert [o["neg_samples"] for o in a] != [o["neg_samples"] for o in c]


def test_lexicon_tagger_rejects_words_the_world_never_writes():
    with pytest.raises(PipelineError, match="'zebra'.*stanza"):
        LEX.tag([["the", "zebra", "moved"]])


def test_stanza_tagger_without_models_says_what_to_place_where(tmp_path):
    with pytest.raises(PipelineError, match=str(tmp_path)):
        StanzaTagger(tmp_path)


STANZA_DIR = Path(os.environ.get("IDC_STANZA_DIR", ROOT / "resources" / "stanza"))


@pytest.mark.skipif(not stanza_ready(STANZA_DIR),
                    reason=f"stanza's English tokenize,pos models are not under {STANZA_DIR} (cannot be downloaded on "
                           "this machine; `python -m pipeline stanza-models --dir resources/stanza` where they can, or set "
                           "IDC_STANZA_DIR)")
def test_stanza_path_tags_and_builds_negatives():
    tagger = StanzaTagger(STANZA_DIR)
    (tags,) = tagger.tag([["the", "big", "red", "cube", "has", "been", "added"]])
    assert [u for u, _ in tags][1:4] == ["ADJ", "ADJ", "NOUN"] and tags[3][1] == "NN"
    records = synth_records(40)
    out, stats = ng.build(records, tagger, ng.Settings(min_df=2), log=lambda m: None)
    assert stats["tagger"].startswith("stanza-") and all(o["tagger"] == stats["tagger"] for o in out)
    assert {"JJ", "NN"} <= set(stats["table8"])
    refs = refs_of(records)
    assert all(not set(o["neg_samples"]) & refs[o["pair_id"]] for o in out)
