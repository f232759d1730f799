"""CLEVR-Change-style captions for the synthetic world.

The changed object is named by the fewest attributes (a subset of size, color, material, shape, written
``the [size] [color] [material] <shape|object|thing>``) that single it out among the scene's objects.
When no attribute subset does, a spatial relation to another, uniquely named object is added
(``that is behind / in front of / left of / to the right of / on the left side of ... the <ref>``),
computed from camera-space positions. Synonyms and predicates are drawn at random, so one index gets
several distinct captions. Every word is inside the official 72-word CLEVR-Change vocabulary.

The objects are duck-typed: anything with ``size, color, material, shape, x, y`` attributes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

ATTRIBUTES = ("size", "color", "material", "shape")

SIZE_WORDS = {"small": ("small", "tiny"), "large": ("large", "big")}
MATERIAL_WORDS = {"rubber": ("rubber", "matte"), "metal": ("metal", "metallic", "shiny")}
# the words used when the material is the new value of a material change ("... turned shiny")
MATERIAL_PREDICATE_WORDS = {"rubber": ("rubber", "matte"), "metal": ("metal", "shiny")}
SHAPE_WORDS = {"sphere": ("sphere", "ball"), "cube": ("cube", "block"), "cylinder": ("cylinder",)}
GENERIC_NOUNS = ("object", "thing")
COLOR_NAMES = ("gray", "red", "blue", "green", "brown", "purple", "cyan", "yellow")

RELATIONS = ("behind", "front", "left", "right")
RELATION_PHRASES = {
    "behind": ("behind",),
    "front": ("in front of",),
    "left": ("left of", "to the left of", "on the left side of"),
    "right": ("right of", "to the right of", "on the right side of"),
}
# a relation used to name an object must hold by at least this much (scene units) ...
RELATION_MARGIN = 0.4
# ... and must not hold at all (margin 0) for any other object the attributes alone leave possible.

CHANGE_TEMPLATES = {
    "color": ("{x} changed to {v}", "{x} turned {v}", "{x} became {v}"),
    "material": ("{x} changed to {v}", "{x} turned {v}", "{x} became {v}"),
    "add": ("{x} has been added", "{x} has appeared", "{x} has been newly placed"),
    "drop": ("{x} has disappeared", "{x} is missing", "{x} is gone", "{x} is no longer there"),
    "move": ("{x} moved", "{x} changed its location", "{x} is in a different location"),
}

NO_CHANGE_CAPTIONS = (
    "no change was made",
    "there is no change",
    "the two scenes seem identical",
    "the scene is the same as before",
    "the scene remains the same",
    "nothing has changed",
    "nothing was modified",
    "no change has occurred",
    "there is no difference",
)

MAX_CAPTION_WORDS = 22

# The official training vocabulary (72 words; + <NULL> <UNK> <START> <END> = 76), datasets.md §1.5.
OFFICIAL_VOCABULARY = frozenset(
    """a added appeared as ball became been before behind big block blue brown change changed cube cyan
    cylinder difference different disappeared front gone gray green has identical in is its large left
    location longer made matte metal metallic missing modified moved newly no nothing object occurred of on
    placed purple red remains right rubber same scene scenes seem shiny side small sphere that the there
    thing tiny to turned two was yellow""".split()
)

# Universal POS tags for every word the generator can write (one tag per word: its most frequent use here).
POS_LEXICON: dict[str, str] = {
    # determiners, numerals, pronouns
    "the": "DET", "a": "DET", "no": "DET", "two": "NUM",
    "that": "PRON", "its": "PRON", "there": "PRON", "nothing": "PRON",
    # attributes
    "small": "ADJ", "tiny": "ADJ", "large": "ADJ", "big": "ADJ",
    "gray": "ADJ", "red": "ADJ", "blue": "ADJ", "green": "ADJ", "brown": "ADJ", "purple": "ADJ",
    "cyan": "ADJ", "yellow": "ADJ",
    "rubber": "NOUN", "metal": "NOUN", "matte": "ADJ", "metallic": "ADJ", "shiny": "ADJ",
    # nouns
    "sphere": "NOUN", "ball": "NOUN", "cube": "NOUN", "block": "NOUN", "cylinder": "NOUN",
    "object": "NOUN", "thing": "NOUN", "location": "NOUN", "change": "NOUN", "difference": "NOUN",
    "scene": "NOUN", "scenes": "NOUN", "side": "NOUN", "front": "NOUN", "left": "NOUN", "right": "NOUN",
    # adpositions
    "behind": "ADP", "in": "ADP", "of": "ADP", "on": "ADP", "to": "ADP", "as": "ADP",
    # auxiliaries and verbs
    "is": "AUX", "has": "AUX", "been": "AUX", "was": "AUX",
    "changed": "VERB", "turned": "VERB", "became": "VERB", "added": "VERB", "appeared": "VERB",
    "placed": "VERB", "disappeared": "VERB", "moved": "VERB", "made": "VERB", "seem": "VERB",
    "remains": "VERB", "modified": "VERB", "occurred": "VERB",
    # adjectives and adverbs of the predicates
    "missing": "ADJ", "gone": "ADJ", "different": "ADJ", "identical": "ADJ", "same": "ADJ",
    "newly": "ADV", "longer": "ADV", "before": "ADV",
    # CLEVR-DC's attribute-comparison references ("the other ... that is the same shape as ...")
    "other": "ADJ", "size": "NOUN", "color": "NOUN", "material": "NOUN", "shape": "NOUN",
}


@dataclass(frozen=True)
class Reference:
    """How to name object ``target``: by ``attrs`` alone, or by ``attrs`` + ``relation`` to object ``ref``
    (itself named by ``ref_attrs``)."""

    target: int
    attrs: tuple[str, ...]
    relation: str | None = None
    ref: int | None = None
    ref_attrs: tuple[str, ...] = ()


# ----------------------------------------------------------------------------------------------------
# identification
# ----------------------------------------------------------------------------------------------------


def _same(a, b, attrs) -> bool:
    return all(getattr(a, k) == getattr(b, k) for k in attrs)


def matching(objects, template, attrs) -> list[int]:
    """Indices of the objects that agree with ``template`` on every attribute in ``attrs``."""
    return [k for k, o in enumerate(objects) if _same(o, template, attrs)]


def minimal_attribute_sets(objects, target: int) -> list[tuple[str, ...]]:
    """All smallest attribute subsets that identify ``objects[target]`` uniquely ([] if none does)."""
    t = objects[target]
    for k in range(1, len(ATTRIBUTES) + 1):
        found = [s for s in itertools.combinations(ATTRIBUTES, k) if matching(objects, t, s) == [target]]
        if found:
            return found
    return []


def camera_axes(camera) -> tuple[np.ndarray, np.ndarray]:
    """Horizontal (right, forward) unit vectors of the camera, in the ground plane."""
    fx = float(camera.target[0]) - float(camera.position[0])
    fy = float(camera.target[1]) - float(camera.position[1])
    n = math.sqrt(fx * fx + fy * fy)
    fwd = np.array([fx / n, fy / n])
    right = np.array([fwd[1], -fwd[0]])  # forward x up, in the plane
    return right, fwd


def relation_holds(a, b, relation: str, camera, margin: float = RELATION_MARGIN) -> bool:
    """Whether object ``a`` is ``relation`` (behind/front/left/right) of object ``b`` seen from ``camera``."""
    right, fwd = camera_axes(camera)
    dx, dy = float(a.x) - float(b.x), float(a.y) - float(b.y)
    lateral = dx * float(right[0]) + dy * float(right[1])
    depth = dx * float(fwd[0]) + dy * float(fwd[1])
    if relation == "left":
        return lateral < -margin
    if relation == "right":
        return lateral > margin
    if relation == "behind":
        return depth > margin
    if relation == "front":
        return depth < -margin
    raise ValueError(f"unknown relation {relation!r}")


def referring_expressions(objects, target: int, camera) -> list[Reference]:
    """All minimal ways to name ``objects[target]`` uniquely ([] if it cannot be named)."""
    sets = minimal_attribute_sets(objects, target)
    if sets:
        return [Reference(target, s) for s in sets]
    t = objects[target]
    # landmarks: the other objects that can be named by attributes alone
    landmarks = []
    for b in range(len(objects)):
        if b != target:
            bs = minimal_attribute_sets(objects, b)
            if bs:
                landmarks.append((b, bs))
    for k in range(0, len(ATTRIBUTES) + 1):
        found = []
        for attrs in itertools.combinations(ATTRIBUTES, k):
            rivals = [c for c in matching(objects, t, attrs) if c != target]
            for b, bsets in landmarks:
                for rel in RELATIONS:
                    if not relation_holds(t, objects[b], rel, camera):
                        continue
                    if any(c != b and relation_holds(objects[c], objects[b], rel, camera, margin=0.0) for c in rivals):
                        continue
                    found.extend(Reference(target, attrs, rel, b, bs_) for bs_ in bsets)
        if found:
            return found
    return []


def resolve(objects, ref: Reference, camera) -> list[int]:
    """The objects a reference can denote (a correct reference denotes exactly its target)."""
    cands = matching(objects, objects[ref.target], ref.attrs)
    if ref.relation is None:
        return cands
    landmarks = matching(objects, objects[ref.ref], ref.ref_attrs)
    if len(landmarks) != 1:
        return cands
    b = objects[landmarks[0]]
    return [c for c in cands if c != landmarks[0] and relation_holds(objects[c], b, ref.relation, camera, margin=0.0)]


# ----------------------------------------------------------------------------------------------------
# wording
# ----------------------------------------------------------------------------------------------------


def _pick(rng: np.random.Generator, options):
    return options[int(rng.integers(len(options)))]


def noun_phrase(rng: np.random.Generator, obj, attrs) -> str:
    """``the [size] [color] [material] <noun>`` with random synonyms."""
    words = ["the"]
    if "size" in attrs:
        words.append(_pick(rng, SIZE_WORDS[obj.size]))
    if "color" in attrs:
        words.append(obj.color)
    if "material" in attrs:
        words.append(_pick(rng, MATERIAL_WORDS[obj.material]))
    words.append(_pick(rng, SHAPE_WORDS[obj.shape]) if "shape" in attrs else _pick(rng, GENERIC_NOUNS))
    return " ".join(words)


def describe(rng: np.random.Generator, objects, ref: Reference) -> str:
    phrase = noun_phrase(rng, objects[ref.target], ref.attrs)
    if ref.relation is not None:
        lead = _pick(rng, ("that is ", "", "that is "))  # "that is" twice as often as none
        landmark = noun_phrase(rng, objects[ref.ref], ref.ref_attrs)
        phrase += f" {lead}{_pick(rng, RELATION_PHRASES[ref.relation])} {landmark}"
    return phrase


def predicate(rng: np.random.Generator, change_type: str, subject: str, new_value: str | None) -> str:
    """One caption: ``subject`` (a noun phrase) with a random predicate of the change; ``new_value`` is the new
    colour or material of a color / material change."""
    # the template is drawn before the value: the worlds' captions depend on the order
    template = _pick(rng, CHANGE_TEMPLATES[change_type])
    if change_type == "color":
        v = new_value
    elif change_type == "material":
        v = _pick(rng, MATERIAL_PREDICATE_WORDS[new_value])
    else:
        v = ""
    return template.format(x=subject, v=v)


def change_captions(
    rng: np.random.Generator,
    change_type: str,
    objects,
    target: int,
    camera,
    new_value: str | None = None,
    n: int = 6,
    max_tries: int = 80,
) -> list[str]:
    """Up to ``n`` distinct captions of one change.

    ``objects`` is the scene the target is named in (after scene for add, before scene otherwise) and
    ``new_value`` the new colour or material for color/material changes.
    """
    if change_type not in CHANGE_TEMPLATES:
        raise ValueError(f"unknown change type {change_type!r}")
    refs = referring_expressions(objects, target, camera)
    if not refs:
        raise ValueError(f"object {target} cannot be named uniquely")
    out: list[str] = []
    for _ in range(max_tries):
        x = describe(rng, objects, _pick(rng, refs))
        cap = predicate(rng, change_type, x, new_value)
        if cap not in out:
            out.append(cap)
            if len(out) == n:
                break
    return out


def no_change_captions(rng: np.random.Generator, n: int = 6) -> list[str]:
    order = rng.permutation(len(NO_CHANGE_CAPTIONS))[:n]
    return [NO_CHANGE_CAPTIONS[int(k)] for k in order]


def generator_words() -> set[str]:
    """Every word the generator can write."""
    words = set()
    for d in (SIZE_WORDS, MATERIAL_WORDS, MATERIAL_PREDICATE_WORDS, SHAPE_WORDS):
        for v in d.values():
            words.update(v)
    words.update(GENERIC_NOUNS, COLOR_NAMES, ["that", "is"])
    for v in RELATION_PHRASES.values():
        for p in v:
            words.update(p.split())
    for ts in CHANGE_TEMPLATES.values():
        for t in ts:
            words.update(w for w in t.split() if not w.startswith("{"))
    for c in NO_CHANGE_CAPTIONS:
        words.update(c.split())
    return words


# ----------------------------------------------------------------------------------------------------
# CLEVR-DC: viewpoint-free references
# ----------------------------------------------------------------------------------------------------
# The after camera moves drastically in CLEVR-DC, so left / behind relations do not survive the change of
# view; its captions name an object by its attributes or compare it with another one ("the other large red
# object that is the same shape as the brown metal object"). Neither depends on the camera.


@dataclass(frozen=True)
class SameAs:
    """Object ``target`` named as "the other <attrs> that is the same <same> as <ref named by ref_attrs>"."""

    target: int
    attrs: tuple[str, ...]
    same: str
    ref: int
    ref_attrs: tuple[str, ...]


def same_as_references(objects, target: int) -> list[SameAs]:
    """All minimal comparison references to ``objects[target]``: fewest own attributes first."""
    t = objects[target]
    landmarks = [(b, minimal_attribute_sets(objects, b)) for b in range(len(objects)) if b != target]
    for k in range(0, len(ATTRIBUTES)):
        found = []
        for attrs in itertools.combinations(ATTRIBUTES, k):
            for same in ATTRIBUTES:
                if same in attrs:
                    continue
                for b, bsets in landmarks:
                    if not bsets or getattr(objects[b], same) != getattr(t, same):
                        continue
                    denoted = [c for c in matching(objects, t, attrs)
                               if c != b and getattr(objects[c], same) == getattr(objects[b], same)]
                    if denoted == [target]:
                        found.extend(SameAs(target, attrs, same, b, bs) for bs in bsets)
        if found:
            return found
    return []


def describe_same_as(rng: np.random.Generator, objects, ref: SameAs) -> str:
    own = noun_phrase(rng, objects[ref.target], ref.attrs).replace("the ", "the other ", 1)
    lead = _pick(rng, ("that is ", ""))
    return f"{own} {lead}the same {ref.same} as {noun_phrase(rng, objects[ref.ref], ref.ref_attrs)}"


def dc_change_captions(rng: np.random.Generator, change_type: str, objects, target: int,
                       new_value: str | None = None, n: int = 6, max_tries: int = 80) -> list[str]:
    """Up to ``n`` distinct CLEVR-DC-style captions of one change (``change_captions``' arguments, no
    camera). Comparison references are preferred when the object has any (2 in 3 captions)."""
    plain = [Reference(target, a) for a in minimal_attribute_sets(objects, target)]
    compared = same_as_references(objects, target)
    if not plain and not compared:
        raise ValueError(f"object {target} cannot be named uniquely")
    out: list[str] = []
    for _ in range(max_tries):
        if compared and (not plain or rng.random() < 2 / 3):
            x = describe_same_as(rng, objects, _pick(rng, compared))
        else:
            x = describe(rng, objects, _pick(rng, plain))
        c = predicate(rng, change_type, x, new_value)
        if c not in out:
            out.append(c)
            if len(out) == n:
                break
    return out


def dc_generator_words() -> set[str]:
    return generator_words() | {"other", "same", "as", "size", "color", "material", "shape"}
