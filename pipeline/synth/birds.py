"""A synthetic bird world shared by the Birds-to-Words, CUB and NABirds layouts (``pipeline.synth.birds_to_words``,
``pipeline.synth.cub``, ``pipeline.synth.nabirds``).

**Taxonomy** (``taxonomy(seed)``, a pure function of the seed): a class of birds split into ``N_ORDERS`` orders,
each into families, genera and species. Attributes are inherited down the tree, so that birds of one genus look
alike and birds of two orders do not:
- a family fixes the body plan: ``size`` (small, medium, large), ``beak`` shape (short, conical, long, hooked)
  and ``tail`` shape (short, long, forked);
- a genus fixes the patterns and the back: ``wing_pattern`` (plain, barred, spotted), ``breast_pattern``
  (plain, streaked, spotted), ``back`` colour and ``beak_color``;
- a species sets the colours that tell it from its congeners: ``crown``, ``breast``, ``wing``, ``tail_color``
  and ``eye_ring`` (none, white, yellow). No two species have the same attributes.
Some species have a second plumage (``female``: crown and breast dull, as NABirds' "Female/juvenile" classes).

**Photos** (``draw_bird``): a blurred foliage background and a branch, and the bird drawn from its parts (tail,
body, breast with its pattern, wing with its pattern, head with its crown, eye with its eye ring, beak, legs)
under a pose (position, scale, tilt, facing left or right) and a colour jitter drawn per photo: two photos of
one species differ by pose and light only. Pixel work is numpy and PIL; a 224 x 168 photo takes a few ms.

**Text**: ``cub_captions`` gives a photo 10 single-image captions in the style of Reed et al.'s ("this bird
has a red crown , a short black beak and barred wings"); ``comparison`` gives a Birds-to-Words paragraph
(lower-case, tokenised, the birds named ``animal1`` / ``animal2``) stating the attribute differences of two
birds (and a similarity or two), or their likeness when they are of one species.
"""

from __future__ import annotations

import functools
import hashlib
import math

import numpy as np

TAXONOMY_STREAM = 1 << 41
N_ORDERS, FAMILIES_PER_ORDER, GENERA_PER_FAMILY, SPECIES_PER_GENUS = 3, 3, 3, 3
P_FEMALE = 0.3  # species with a second plumage (NABirds' visual categories)

COLORS = {"red": (200, 40, 35), "orange": (235, 130, 35), "yellow": (240, 210, 45), "olive": (120, 125, 50),
          "green": (60, 150, 70), "blue": (50, 90, 200), "brown": (120, 80, 45), "buff": (215, 185, 140),
          "grey": (140, 140, 145), "black": (30, 30, 32), "white": (240, 240, 236), "rufous": (170, 75, 35)}
BEAK_COLORS = ("black", "yellow", "orange", "grey")
SIZES = {"small": 0.42, "medium": 0.55, "large": 0.7}  # body length / photo width
BEAKS = ("short", "conical", "long", "hooked")
TAILS = ("short", "long", "forked")
WING_PATTERNS = ("plain", "barred", "spotted")
BREAST_PATTERNS = ("plain", "streaked", "spotted")
EYE_RINGS = ("none", "white", "yellow")
FAMILY_KEYS = ("size", "beak", "tail")
GENUS_KEYS = ("wing_pattern", "breast_pattern", "back", "beak_color")
SPECIES_KEYS = ("crown", "breast", "wing", "tail_color", "eye_ring")
ATTRIBUTES = FAMILY_KEYS + GENUS_KEYS + SPECIES_KEYS
NOUNS = ("warbler", "finch", "sparrow", "tanager", "vireo", "wren", "thrush", "flycatcher", "oriole", "jay",
         "bunting", "kingbird", "grosbeak", "swallow", "tern", "gull", "plover", "sandpiper")
ORDER_NAMES = ("Passeriformes", "Charadriiformes", "Piciformes", "Coraciiformes", "Columbiformes")
_SYLLABLES = ("lo", "ra", "vi", "ta", "mel", "spi", "zo", "ca", "nth", "por", "eri", "sa", "pha", "cu", "lus")


def _latin(rng: np.random.Generator, n: int, end: str) -> str:
    return "".join(_SYLLABLES[int(i)] for i in rng.integers(len(_SYLLABLES), size=n)) + end


@functools.lru_cache(maxsize=8)
def taxonomy(seed: int) -> dict:
    """``{"orders": [...], "families": [...], "genera": [...], "species": [...]}``: each node a dict with ``name``
    and its parent's index (``order``, ``family``, ``genus``); a species also has ``attrs`` (every key of
    ``ATTRIBUTES``), its scientific name ``latin``, its common ``name`` and ``female`` (the attrs of its second
    plumage, or None). Species are listed genus by genus."""
    rng = np.random.default_rng([int(seed), TAXONOMY_STREAM])
    tax: dict = {"orders": [], "families": [], "genera": [], "species": []}
    seen: set[tuple] = set()
    names: set[str] = set()
    colors = list(COLORS)
    for o in range(N_ORDERS):
        tax["orders"].append({"name": ORDER_NAMES[o % len(ORDER_NAMES)]})
        for _ in range(FAMILIES_PER_ORDER):
            fam = {"size": str(rng.choice(list(SIZES))), "beak": str(rng.choice(BEAKS)), "tail": str(rng.choice(TAILS))}
            noun = NOUNS[len(tax["families"]) % len(NOUNS)]
            plural = noun + ("es" if noun.endswith(("sh", "ch", "s")) else "s")
            tax["families"].append({"name": plural.capitalize(), "order": o, "noun": noun, "attrs": fam})
            f = len(tax["families"]) - 1
            for _ in range(GENERA_PER_FAMILY):
                gen = {**fam, "wing_pattern": str(rng.choice(WING_PATTERNS)),
                       "breast_pattern": str(rng.choice(BREAST_PATTERNS)), "back": str(rng.choice(colors)),
                       "beak_color": str(rng.choice(BEAK_COLORS))}
                genus = _latin(rng, 2, "a").capitalize()
                tax["genera"].append({"name": genus, "family": f, "attrs": gen})
                g = len(tax["genera"]) - 1
                for _ in range(SPECIES_PER_GENUS):
                    while True:
                        sp = {**gen, "crown": str(rng.choice(colors)), "breast": str(rng.choice(colors)),
                              "wing": str(rng.choice(colors)), "tail_color": str(rng.choice(colors)),
                              "eye_ring": str(rng.choice(EYE_RINGS))}
                        key = tuple(sp[k] for k in ATTRIBUTES)
                        if key not in seen and sp["breast"] != sp["back"]:
                            break
                    seen.add(key)
                    name = f"{sp['crown'].capitalize()}-crowned {noun.capitalize()}"
                    if name in names:
                        name = f"{sp['breast'].capitalize()}-breasted {noun.capitalize()}"
                    if name in names:
                        name = f"{sp['crown'].capitalize()}-crowned {genus} {noun.capitalize()}"
                    k = 2
                    while name in names:
                        name, k = f"{name.rsplit(' #', 1)[0]} #{k}", k + 1
                    names.add(name)
                    female = None
                    if rng.random() < P_FEMALE:
                        female = {**sp, "crown": "brown" if sp["crown"] != "brown" else "buff",
                                  "breast": "buff" if sp["breast"] != "buff" else "grey"}
                    tax["species"].append({"name": name, "latin": f"{genus} {_latin(rng, 2, 'us')}", "genus": g,
                                           "attrs": sp, "female": female})
    return tax


def lineage(tax: dict, s: int) -> tuple[int, int, int]:
    """(order, family, genus) of species ``s``."""
    g = tax["species"][s]["genus"]
    f = tax["genera"][g]["family"]
    return tax["families"][f]["order"], f, g


# ---------------------------------------------------------------------------------------------------- drawing
def _ellipse(cx, cy, rx, ry, n: int = 28, a0: float = 0.0, a1: float = 2 * math.pi):
    t = np.linspace(a0, a1, n, endpoint=a1 - a0 < 2 * math.pi - 1e-9)
    return np.stack([cx + rx * np.cos(t), cy + ry * np.sin(t)], 1)


def _jitter(rng: np.random.Generator, light: float):
    cache: dict[str, tuple] = {}

    def color(name: str, k: float = 1.0) -> tuple:
        if name not in cache:
            base = np.asarray(COLORS[name], float) * light + rng.normal(0, 8, 3)
            cache[name] = tuple(base)
        return tuple(int(np.clip(c * k, 0, 255)) for c in cache[name])
    return color


def background(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """Blurred foliage (or sky, or water) of low-frequency noise, as behind a bird photographed in the wild."""
    from PIL import Image

    palette = [((70, 110, 50), (150, 180, 110)), ((120, 160, 210), (210, 225, 240)), ((90, 80, 60), (170, 150, 120)),
               ((40, 90, 110), (120, 170, 180))][int(rng.integers(4))]
    lo = rng.random((6, 8)).astype(np.float32)
    noise = np.asarray(Image.fromarray((lo * 255).astype(np.uint8)).resize((w, h), Image.BICUBIC), np.float32) / 255
    a, b = (np.asarray(c, np.float32) for c in palette)
    img = a + (b - a) * noise[..., None]
    img += rng.normal(0, 3, (h, w, 1)).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def plumage(species: dict, female: bool) -> dict:
    """The attributes a photo of ``species`` shows: its second plumage where ``female``."""
    return species["female"] if female else species["attrs"]


def photo(seed: int, index: int, attrs: dict, w: int) -> tuple[np.ndarray, tuple[int, int, int, int], str]:
    """Photo ``index`` of a world drawn with ``seed``, ``w`` x 3w/4: (RGB, bird bounding box, sha256 of the pixels).
    Each photo has its own random stream, so a world renders in any order, in parallel and resumably."""
    rgb, bbox = draw_bird(attrs, np.random.default_rng([seed, index]), w, w * 3 // 4)
    return rgb, bbox, hashlib.sha256(rgb.tobytes()).hexdigest()


def draw_bird(attrs: dict, rng: np.random.Generator, w: int, h: int) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """One photo of a bird with ``attrs``: (uint8 RGB ``h x w x 3``, its bounding box ``(x, y, width,
    height)``). The pose and light draw from ``rng``."""
    from PIL import Image, ImageDraw

    img = Image.fromarray(background(rng, w, h))
    d = ImageDraw.Draw(img)
    color = _jitter(rng, float(rng.uniform(0.85, 1.1)))
    length = SIZES[attrs["size"]] * w * float(rng.uniform(0.9, 1.1))
    angle = float(rng.uniform(-0.25, 0.25))
    face = 1.0 if rng.random() < 0.5 else -1.0
    cx = w * float(rng.uniform(0.45, 0.55))
    cy = h * float(rng.uniform(0.42, 0.52))
    ca, sa = math.cos(angle), math.sin(angle)
    # the branch the bird perches on
    by = cy + 0.42 * length
    d.line([(0, by + w * 0.03 * float(rng.uniform(-1, 1))), (w, by + w * 0.03 * float(rng.uniform(-1, 1)))],
           fill=(85, 60, 40), width=max(2, int(w / 40)))
    pts_all = []

    def tr(p):
        p = np.asarray(p, float).reshape(-1, 2)
        x, y = p[:, 0] * face, p[:, 1]
        out = np.stack([cx + length * (x * ca - y * sa), cy + length * (x * sa + y * ca)], 1)
        pts_all.append(out)
        return [tuple(map(float, q)) for q in out]

    def poly(p, fill, outline=None):
        d.polygon(tr(p), fill=fill, outline=outline)

    def line(p, fill, width):
        d.line(tr(p), fill=fill, width=max(1, int(width * length)))

    # legs
    for lx in (-0.02, 0.08):
        line([(lx, 0.2), (lx - 0.03, 0.42)], (60, 50, 40), 0.02)
    # tail
    tail = {"short": [(-0.38, -0.05), (-0.62, -0.02), (-0.62, 0.08), (-0.38, 0.08)],
            "long": [(-0.38, -0.05), (-0.92, 0.02), (-0.9, 0.12), (-0.38, 0.08)],
            "forked": [(-0.38, -0.05), (-0.85, -0.08), (-0.62, 0.03), (-0.85, 0.14), (-0.38, 0.08)]}[attrs["tail"]]
    poly(tail, color(attrs["tail_color"]), color(attrs["tail_color"], 0.6))
    # body (back) and breast
    poly(_ellipse(0, 0, 0.45, 0.24), color(attrs["back"]))
    breast = _ellipse(0.12, 0.07, 0.3, 0.17)
    poly(breast, color(attrs["breast"]))
    dark = color(attrs["breast"], 0.55)
    if attrs["breast_pattern"] == "streaked":
        for bx in np.linspace(-0.05, 0.3, 6):
            line([(bx, 0.0), (bx - 0.03, 0.14)], dark, 0.018)
    elif attrs["breast_pattern"] == "spotted":
        for bx, byy in zip(np.linspace(-0.06, 0.32, 7), (0.02, 0.12, 0.05, 0.15, 0.03, 0.11, 0.06)):
            poly(_ellipse(bx, byy, 0.022, 0.022, 10), dark)
    # wing
    poly([(0.22, -0.1), (0.05, -0.2), (-0.25, -0.16), (-0.5, -0.02), (-0.2, 0.07), (0.12, 0.04)], color(attrs["wing"]),
         color(attrs["wing"], 0.6))
    if attrs["wing_pattern"] == "barred":
        for bx in (-0.28, -0.14, 0.0, 0.12):
            line([(bx, -0.16), (bx - 0.06, 0.05)], color("white" if attrs["wing"] != "white" else "black"), 0.025)
    elif attrs["wing_pattern"] == "spotted":
        for bx, byy in ((-0.3, -0.06), (-0.15, -0.1), (-0.05, -0.02), (0.08, -0.08), (-0.2, 0.01)):
            poly(_ellipse(bx, byy, 0.025, 0.02, 10), color("white" if attrs["wing"] != "white" else "black"))
    # head and crown
    hx, hy, hr = 0.42, -0.2, 0.16
    poly(_ellipse(hx, hy, hr, hr), color(attrs["back"]))
    poly(_ellipse(hx, hy, hr, hr * 0.75, 16, math.pi, 2 * math.pi), color(attrs["crown"]))
    poly(_ellipse(hx + 0.03, hy + 0.06, hr * 0.8, hr * 0.55, 16, 0, math.pi), color(attrs["breast"]))
    # beak
    bx0 = hx + hr * 0.92
    beak = {"short": [(bx0, hy - 0.035), (bx0 + 0.1, hy + 0.01), (bx0, hy + 0.045)],
            "conical": [(bx0, hy - 0.06), (bx0 + 0.13, hy + 0.01), (bx0, hy + 0.07)],
            "long": [(bx0, hy - 0.03), (bx0 + 0.3, hy + 0.02), (bx0, hy + 0.035)],
            "hooked": [(bx0, hy - 0.05), (bx0 + 0.12, hy - 0.03), (bx0 + 0.15, hy + 0.05), (bx0 + 0.1, hy + 0.02),
                       (bx0, hy + 0.05)]}[attrs["beak"]]
    poly(beak, color(attrs["beak_color"]), color(attrs["beak_color"], 0.5))
    # eye ring and eye
    ex, ey = hx + 0.06, hy - 0.03
    if attrs["eye_ring"] != "none":
        poly(_ellipse(ex, ey, 0.045, 0.045, 14), color(attrs["eye_ring"]))
    poly(_ellipse(ex, ey, 0.025, 0.025, 12), (15, 15, 15))
    pts = np.concatenate(pts_all)
    x0, y0 = np.clip(pts.min(0), 0, [w - 1, h - 1])
    x1, y1 = np.clip(pts.max(0), 0, [w - 1, h - 1])
    return np.asarray(img), (int(x0), int(y0), int(x1 - x0) + 1, int(y1 - y0) + 1)


# ---------------------------------------------------------------------------------------------------- text
_PART = {"crown": "crown", "breast": "breast", "wing": "wings", "tail_color": "tail", "back": "back",
         "beak_color": "beak"}
_SIZE_WORD = {"small": "small", "medium": "medium sized", "large": "large"}
_BEAK_WORD = {"short": "short", "conical": "thick conical", "long": "long thin", "hooked": "hooked"}
_TAIL_WORD = {"short": "short", "long": "long", "forked": "forked"}


def _a(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def _phrase(attrs: dict, key: str, rng: np.random.Generator) -> str:
    """A noun phrase stating one attribute, with its pattern or shape ("a streaked red breast", "barred black
    wings", "a long thin yellow beak")."""
    v = attrs[key]
    if key == "breast":
        pattern = attrs["breast_pattern"]
        return _a(f"{pattern + ' ' if pattern != 'plain' else ''}{v} breast")
    if key in ("crown", "back"):
        return _a(f"{v} {_PART[key]}")
    if key == "wing":
        pattern = attrs["wing_pattern"]
        return f"{pattern + ' ' if pattern != 'plain' else ''}{v} wings"
    if key == "tail_color":
        return _a(f"{_TAIL_WORD[attrs['tail']]} {v} tail")
    if key == "beak_color":
        return _a(f"{_BEAK_WORD[attrs['beak']]} {v} {'beak' if rng.random() < 0.6 else 'bill'}")
    if key == "eye_ring":
        return _a(f"{v} eye ring") if v != "none" else "no eye ring"
    raise ValueError(key)


CAPTION_KEYS = ("crown", "breast", "back", "wing", "tail_color", "beak_color", "eye_ring")


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def cub_captions(attrs: dict, rng: np.random.Generator, n: int = 10) -> list[str]:
    """``n`` distinct captions of one photo in the style of Reed et al.'s, each stating 2-4 attributes."""
    out: list[str] = []
    keys = list(CAPTION_KEYS)
    while len(out) < n:
        ks = [keys[int(i)] for i in rng.choice(len(keys), size=int(rng.integers(2, 5)), replace=False)]
        parts = [_phrase(attrs, k, rng) for k in ks]
        size = _SIZE_WORD[attrs["size"]]
        form = int(rng.integers(5))
        if form == 0:
            s = f"this bird has {_join(parts)}"
        elif form == 1:
            s = f"a {size} bird with {_join(parts)}"
        elif form == 2:
            s = f"this {size} bird has {_join(parts)}"
        elif form == 3:
            s = f"the bird has {_join(parts)}"
        else:
            s = f"this is a {size} bird with {_join(parts)}"
        if rng.random() < 0.3:
            s += "."
        if s not in out:
            out.append(s)
    return out


def differences(a: dict, b: dict) -> list[str]:
    return [k for k in ATTRIBUTES if a[k] != b[k]]


def _difference_sentence(k: str, a: dict, b: dict, rng: np.random.Generator) -> str:
    one, two = ("animal1", "animal2") if rng.random() < 0.7 else ("animal2", "animal1")
    x, y = (a, b) if one == "animal1" else (b, a)
    if k == "size":
        order = list(SIZES)
        rel = "larger" if order.index(x["size"]) > order.index(y["size"]) else "smaller"
        return f"{one} is {rel} than {two} ."
    if k == "tail":
        return f"{one} has {_a(_TAIL_WORD[x['tail']])} tail while {two} has {_a(_TAIL_WORD[y['tail']])} tail ."
    if k == "beak":
        return f"{one} has {_a(_BEAK_WORD[x['beak']])} beak , {two} 's beak is {_BEAK_WORD[y['beak']]} ."
    if k in ("wing_pattern", "breast_pattern"):
        part = "wings" if k == "wing_pattern" else "breast"
        verb = "are" if part == "wings" else "is"
        return f"the {part} of {one} {verb} {x[k]} , whereas {two} has {y[k]} {part} ."
    if k == "eye_ring":
        if x[k] == "none":
            one, two, x, y = two, one, y, x
        tail = f"{two} has no eye ring" if y[k] == "none" else f"{two} 's is {y[k]}"
        return f"{one} has {_a(x[k])} eye ring and {tail} ."
    part = _PART[k]
    plural = part.endswith("s")
    if rng.random() < 0.5:
        x_np, y_np = (f"{x[k]} {part}", f"{y[k]} {part}") if plural else (f"{_a(x[k])} {part}", f"{_a(y[k])} {part}")
        return f"{one} has {x_np} , while {two} has {y_np} ."
    verb = "are" if plural else "is"
    return f"{one} 's {part} {verb} {x[k]} and {two} 's {part} {verb} {y[k]} ."


def comparison(a: dict, b: dict, rng: np.random.Generator) -> str:
    """A Birds-to-Words paragraph comparing bird ``a`` (animal1) with bird ``b`` (animal2): 2-4 of their
    differences in random order, and sometimes what they share; two birds alike are said to be alike."""
    diff = differences(a, b)
    shared = [k for k in ("crown", "back", "eye_ring") if a[k] == b[k]]
    sents = []
    if not diff:
        sents.append(str(rng.choice(["animal1 and animal2 look almost identical .",
                                     "both animals appear to be the same kind of bird .",
                                     "there is very little difference between animal1 and animal2 ."])))
    else:
        n = min(len(diff), int(rng.integers(2, 5)))
        for k in (diff[int(i)] for i in rng.choice(len(diff), size=n, replace=False)):
            sents.append(_difference_sentence(k, a, b, rng))
    if shared and (not diff or rng.random() < 0.5):
        k = shared[int(rng.integers(len(shared)))]
        sents.append(f"both have {_phrase(a, k, rng)} .")
    return " ".join(sents)


# Universal POS tags of every word the bird worlds write (their captions feed IDC-PCL's FDA negatives, whose
# Replace and Confuse need adjectives, nouns and noun phrases; stanza's models are not reachable offline).
# "animal1"/"animal2" are nouns, so Confuse can swap them as the paper's example does.
POS_LEXICON: dict[str, str] = {
    **{c: "ADJ" for c in COLORS}, **{c: "ADJ" for c in BEAK_COLORS},
    **{w: "ADJ" for w in ("small", "medium", "sized", "large", "larger", "smaller", "short", "long", "thick",
                          "thin", "conical", "hooked", "forked", "plain", "barred", "spotted", "streaked",
                          "identical", "same", "little")},
    **{w: "NOUN" for w in ("bird", "animal1", "animal2", "animals", "crown", "breast", "back", "wings", "tail",
                           "beak", "bill", "eye", "ring", "difference", "kind")},
    "a": "DET", "an": "DET", "the": "DET", "this": "DET", "no": "DET", "both": "DET",
    "there": "PRON", "'s": "PART", ",": "PUNCT", ".": "PUNCT",
    "is": "AUX", "are": "AUX", "be": "AUX", "has": "VERB", "have": "VERB", "look": "VERB", "appear": "VERB",
    "with": "ADP", "of": "ADP", "than": "ADP", "between": "ADP", "to": "PART",
    "and": "CCONJ", "while": "SCONJ", "whereas": "SCONJ", "almost": "ADV", "very": "ADV",
}
