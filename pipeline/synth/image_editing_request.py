"""Stage ``synth-image-editing-request``: render a synthetic photo-edit world in the Image Editing Request layout.

    python -m pipeline synth-image-editing-request --out resources/raw/image_editing_request/synthetic \
        --n-pairs 800 --seed 0

writes ``OUT/data/`` as ``pipeline.datasets.image_editing_request`` reads it (reference/datasets.md §4):
``train.json``, ``valid.json``, ``test.json`` (``[{"img0", "img1", "sents", "uid"}, ...]``, the release's
``dataset/adobe/`` files) and ``images/<bare file name>``, plus ``OUT/SYNTHETIC.json`` (provenance and counts)
and ``OUT/scenes.jsonl`` (every rendered pair's scene and edit).

A pair is a procedural "photo" and its edited version. The photo: a sky gradient over a textured ground (a
palette among meadow, beach, desert, snow, dusk; low-frequency texture and fine grain), sometimes a sun, and
2-4 objects (balls, boxes, cars, houses, trees) standing on the ground in distinct slots, each of a distinct
(colour, kind), so that "the red car" names one object. Photos are ``size`` x ``3/4 size`` (landscape).
The edit is one of ``EDITS``, the kinds the release's requests ask for:
- global: ``brighten``, ``darken``, ``more_contrast``, ``less_contrast``, ``saturate``, ``black_and_white``,
  ``warm`` / ``cool`` (a colour cast), ``crop`` (around one object: a smaller image, as a crop is), ``zoom``
  (the centre enlarged to the full size), ``rotate`` (90 degrees either way, or 180), ``flip`` (mirror),
  ``blur``, ``sharpen``;
- local: ``remove`` (one object gone, the background redrawn), ``recolour`` (one object in another colour),
  ``add_text`` (a word written at the top or bottom).
Each pair gets ``POOL`` distinct imperative requests in the dataset's style (case and punctuation kept, as
users typed them: "Brighten the image", "remove the red car on the left", "change the blue box to green"),
each of which names its edit (and, for a local edit, the object by colour and kind, and the new colour or the
text). As in the release, a train pair has 1 request and a valid / test pair 3 (``REQUESTS``).

The release's quirks are reproduced: file names ``<Reddit|Zhopped>.com_<post>_<post>.<ext>`` (the original)
and ``..._<comment>.<ext>`` (the edit), mixed extensions (``EXTENSIONS``: mostly ``.jpg`` and ``.png``, some
``.JPG`` / ``.jpeg``, rare ``.gif``), uids ``<Reddit|Zhopped>_<n>``, and pairs repeated across valid and test:
``DUP_FRACTION`` of the valid pairs occur again in test (the same two files, another uid and other requests;
the release: 55 of 383), which the parser keeps and reports; and ``SIBLING_FRACTION`` of the test pairs edit a
valid pair's original another way (the same ``img0`` file, another kind of edit: the release shares 105 ``img0``
files between valid and test, 55 of them the repeats). Everything about a rendered pair draws from
``default_rng([seed, index])``; the split, the repeats and the siblings from ``default_rng([seed,
SPLIT_STREAM])``: the world is the same for any worker count (``pipeline.synth.world``).
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import numpy as np

from pipeline.errors import PipelineError
from pipeline.synth.world import add_pair_world_arguments, check_arguments, meta_path, render_world, save_image
from pipeline.utils.io import read_json, write_json, write_jsonl

GENERATOR = "pipeline.synth.image_editing_request"
VERSION = "1.1.0"
SUBDIRS = ("images",)
SPLITS = ("train", "valid", "test")  # the release's file names
DEFAULT_SPLIT_FRACTIONS = (0.78, 0.10, 0.12)  # of the rendered pairs (the release: 3,061 / 383 / 495 entries)
DUP_FRACTION = 55 / 383  # valid pairs repeated in test (datasets.md §4)
SIBLING_FRACTION = 50 / 495  # test pairs editing a valid pair's original otherwise (105 shared img0 - 55 repeats)
SPLIT_STREAM = 1 << 40
REQUESTS = {"train": 1, "valid": 3, "test": 3}  # requests per entry, as released
POOL = 6  # distinct requests drawn per rendered pair: valid / test entries take 3, a repeat in test the next 3
EXTENSIONS = {".jpg": 0.62, ".png": 0.3, ".JPG": 0.04, ".jpeg": 0.035, ".gif": 0.005}

PALETTES = {  # sky top, sky at the horizon, ground
    "meadow": ((70, 130, 210), (190, 220, 240), (80, 140, 60)),
    "beach": ((60, 150, 230), (200, 230, 245), (222, 200, 150)),
    "desert": ((120, 170, 220), (240, 220, 190), (200, 150, 90)),
    "snow": ((150, 170, 200), (225, 230, 240), (235, 238, 245)),
    "dusk": ((40, 40, 100), (240, 140, 90), (70, 60, 70)),
}
COLORS = {"red": (200, 30, 30), "green": (40, 160, 60), "blue": (40, 70, 200), "yellow": (235, 210, 40),
          "orange": (240, 130, 30), "purple": (130, 50, 160), "white": (245, 245, 245), "black": (25, 25, 25),
          "pink": (240, 130, 180)}
KINDS = ("ball", "box", "car", "house", "tree")
NOUNS = {"ball": ("ball",), "box": ("box", "cube"), "car": ("car",), "house": ("house",), "tree": ("tree",)}
WORDS = ("SALE", "HELLO", "LOVE", "BEACH", "TIGER", "OPEN", "HAPPY", "2019", "SUMMER", "NEON")
GLOBAL = ("brighten", "darken", "more_contrast", "less_contrast", "saturate", "black_and_white", "warm", "cool",
          "crop", "zoom", "rotate", "flip", "blur", "sharpen")
LOCAL = ("remove", "recolour", "add_text")
EDITS = GLOBAL + LOCAL
EDIT_P = np.array([1.0] * len(GLOBAL) + [2.5, 2.0, 1.5])
EDIT_P = EDIT_P / EDIT_P.sum()

# Request templates per edit: {obj} the object ("red car"), {where} its place, {new} a colour, {text} the word,
# {way} the rotation. Each states its edit with one of KEYWORDS[edit] (tests check it).
TEMPLATES = {
    "brighten": ("brighten the image", "make the picture brighter", "increase the brightness", "lighten the photo",
                 "make it brighter", "make the whole image lighter", "brighten up the photo a bit"),
    "darken": ("darken the image", "make the picture darker", "decrease the brightness", "make it darker",
               "reduce the brightness of the photo", "darken the whole picture"),
    "more_contrast": ("increase the contrast", "add more contrast", "boost the contrast of the image",
                      "make the contrast stronger", "raise the contrast", "more contrast please"),
    "less_contrast": ("decrease the contrast", "lower the contrast", "reduce the contrast of the image",
                      "make the contrast softer", "less contrast", "tone down the contrast"),
    "saturate": ("increase the saturation", "make the colors more vivid", "make the colors pop",
                 "boost the saturation", "make the image more colorful", "saturate the colors"),
    "black_and_white": ("make the image black and white", "convert the photo to black and white",
                        "remove all the color", "make it grayscale", "turn the picture black and white",
                        "desaturate the image completely"),
    "warm": ("make the image warmer", "add a warm tone", "give the photo a warm orange tint", "warm up the colors",
             "add a yellow tint to the picture", "make the colors warmer"),
    "cool": ("make the image cooler", "add a blue tint", "give the photo a cool tone", "cool down the colors",
             "make the picture more blue", "add a cold blue tone"),
    "crop": ("crop the image around the {obj}", "crop to the {obj}", "crop out everything but the {obj}",
             "crop the picture so only the {obj} shows", "crop the photo to focus on the {obj}",
             "crop around the {obj} {where}"),
    "zoom": ("zoom in on the center", "zoom in", "zoom into the middle of the picture", "enlarge the center",
             "zoom in closer", "zoom in on the middle of the photo"),
    "rotate": ("rotate the image {way}", "rotate the picture {way}", "turn the photo {way}",
               "rotate it {way}", "turn the image {way}", "rotate the whole photo {way}"),
    "flip": ("flip the image horizontally", "mirror the image", "flip the picture left to right",
             "mirror the photo", "flip it horizontally", "make a mirror image"),
    "blur": ("blur the image", "make the picture blurry", "add a blur", "blur the whole photo",
             "make it blurry", "blur everything"),
    "sharpen": ("sharpen the image", "make the picture sharper", "sharpen the photo", "make it sharper",
                "sharpen the details", "increase the sharpness"),
    "remove": ("remove the {obj}", "remove the {obj} {where}", "get rid of the {obj}", "delete the {obj} {where}",
               "take out the {obj}", "erase the {obj}", "remove the {obj} from the picture"),
    "recolour": ("change the {obj} to {new}", "make the {obj} {new}", "change the color of the {obj} to {new}",
                 "turn the {obj} {where} {new}", "color the {obj} {new}", "recolor the {obj} {new}"),
    "add_text": ('add the text "{text}" at the {pos}', "write {text} at the {pos}", 'put the word "{text}" on it',
                 "add the word {text} to the image", 'write "{text}" on the picture',
                 'add text that says "{text}"'),
}
KEYWORDS = {
    "brighten": ("bright", "lighten", "lighter"), "darken": ("dark", "brightness"), "more_contrast": ("contrast",),
    "less_contrast": ("contrast",), "saturate": ("saturat", "vivid", "pop", "colorful"),
    "black_and_white": ("black and white", "grayscale", "color", "desaturate"),
    "warm": ("warm", "yellow tint"), "cool": ("cool", "blue tint", "more blue", "cold"), "crop": ("crop",),
    "zoom": ("zoom", "enlarge"),
    "rotate": ("rotate", "turn"), "flip": ("flip", "mirror"), "blur": ("blur",), "sharpen": ("sharp",),
    "remove": ("remove", "rid", "delete", "take out", "erase"), "recolour": ("change", "make", "turn", "color"),
    "add_text": ("add", "write", "put"),
}
assert all(len(t) >= POOL for t in TEMPLATES.values())  # distinct templates give distinct requests
ROTATIONS = {"left": ("90 degrees to the left", "counterclockwise", "90 degrees counter clockwise"),
             "right": ("90 degrees to the right", "clockwise", "90 degrees clockwise"),
             "half": ("upside down", "180 degrees")}


def _b36(n: int, width: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    s = ""
    while n or len(s) < width:
        n, r = divmod(n, 36)
        s = digits[r] + s
    return s


# ---------------------------------------------------------------------------------------------------- scene
def make_scene(rng: np.random.Generator, width: int, height: int) -> dict:
    palette = str(rng.choice(list(PALETTES)))
    horizon = float(rng.uniform(0.38, 0.6))
    n_slots = 4
    k = int(rng.integers(2, 5))
    slots = sorted(int(s) for s in rng.choice(n_slots, size=k, replace=False))
    objs, used = [], set()
    for slot in slots:
        while True:
            kind, color = str(rng.choice(KINDS)), str(rng.choice(list(COLORS)))
            if (kind, color) not in used and not (kind == "tree" and color in ("black", "white")):
                break
        used.add((kind, color))
        cx = (slot + 0.5 + rng.uniform(-0.2, 0.2)) / n_slots
        size = float(rng.uniform(0.13, 0.2))
        base = float(rng.uniform(horizon + 0.2, 0.95))
        objs.append({"kind": kind, "color": color, "cx": float(cx), "size": size, "base": base})
    objs.sort(key=lambda o: o["base"])  # painted far (higher on the ground) to near
    return {"palette": palette, "horizon": horizon, "sun": bool(rng.random() < 0.4),
            "sun_x": float(rng.uniform(0.1, 0.9)), "texture_seed": int(rng.integers(2 ** 31)), "objects": objs}


def where(o: dict) -> str:
    return "on the left" if o["cx"] < 1 / 3 else "on the right" if o["cx"] > 2 / 3 else "in the middle"


def _background(scene: dict, width: int, height: int) -> np.ndarray:
    from PIL import Image

    top, hor, ground = (np.asarray(c, np.float32) for c in PALETTES[scene["palette"]])
    rng = np.random.default_rng(scene["texture_seed"])
    y = (np.arange(height, dtype=np.float32) / height)[:, None, None]
    h = scene["horizon"]
    sky = top + (hor - top) * np.clip(y / h, 0, 1)
    shade = 0.75 + 0.35 * np.clip((y - h) / (1 - h), 0, 1)  # the ground lighter towards the viewer
    img = np.where(y < h, sky, ground * shade) * np.ones((1, width, 1), np.float32)
    coarse = rng.normal(0, 1, (6, 8)).astype(np.float32)  # low-frequency texture of the ground
    tex = np.asarray(Image.fromarray(coarse, mode="F").resize((width, height), Image.BICUBIC))
    fine = rng.normal(0, 1, (height // 2, width // 2)).astype(np.float32)
    fine = np.asarray(Image.fromarray(fine, mode="F").resize((width, height), Image.BILINEAR))
    ground_mask = (y >= h).astype(np.float32)
    img = img + (tex[..., None] * 14 + fine[..., None] * 9) * ground_mask + fine[..., None] * 2
    return img


def draw(scene: dict, width: int, height: int, skip: int | None = None,
         recolour: tuple[int, str] | None = None) -> np.ndarray:
    """The photo (uint8 RGB), without object ``skip``, object ``recolour[0]`` in colour ``recolour[1]``."""
    from PIL import Image, ImageDraw

    img = Image.fromarray(np.clip(np.rint(_background(scene, width, height)), 0, 255).astype(np.uint8))
    d = ImageDraw.Draw(img)
    if scene["sun"]:
        r = 0.06 * width
        x, y = scene["sun_x"] * width, 0.35 * scene["horizon"] * height
        d.ellipse((x - r, y - r, x + r, y + r), fill=(250, 235, 150))
    for i, o in enumerate(scene["objects"]):
        if i == skip:
            continue
        color = COLORS[recolour[1] if recolour is not None and recolour[0] == i else o["color"]]
        dark = tuple(int(c * 0.6) for c in color)
        s, cx, by = o["size"] * width, o["cx"] * width, o["base"] * height
        d.ellipse((cx - 0.6 * s, by - 0.08 * s, cx + 0.6 * s, by + 0.08 * s), fill=(40, 40, 40))  # shadow
        if o["kind"] == "ball":
            d.ellipse((cx - s / 2, by - s, cx + s / 2, by), fill=color, outline=dark, width=2)
            d.ellipse((cx - s / 5, by - 0.8 * s, cx - s / 20, by - 0.65 * s), fill=(250, 250, 250))
        elif o["kind"] == "box":
            d.rectangle((cx - s / 2, by - s, cx + s / 2, by), fill=color, outline=dark, width=2)
            d.polygon([(cx - s / 2, by - s), (cx - s / 4, by - 1.2 * s), (cx + 0.75 * s, by - 1.2 * s),
                       (cx + s / 2, by - s)], fill=tuple(min(255, int(c * 1.2 + 20)) for c in color))
        elif o["kind"] == "car":
            d.rounded_rectangle((cx - 0.8 * s, by - 0.55 * s, cx + 0.8 * s, by - 0.15 * s), 4, fill=color,
                                outline=dark)
            d.polygon([(cx - 0.45 * s, by - 0.55 * s), (cx - 0.3 * s, by - 0.85 * s), (cx + 0.3 * s, by - 0.85 * s),
                       (cx + 0.5 * s, by - 0.55 * s)], fill=color, outline=dark)
            d.polygon([(cx - 0.35 * s, by - 0.58 * s), (cx - 0.25 * s, by - 0.8 * s), (cx + 0.25 * s, by - 0.8 * s),
                       (cx + 0.38 * s, by - 0.58 * s)], fill=(90, 110, 130))
            for wx in (-0.45, 0.45):
                d.ellipse((cx + wx * s - 0.17 * s, by - 0.32 * s, cx + wx * s + 0.17 * s, by + 0.02 * s),
                          fill=(20, 20, 20))
        elif o["kind"] == "house":
            d.rectangle((cx - 0.6 * s, by - 0.8 * s, cx + 0.6 * s, by), fill=color, outline=dark, width=2)
            d.polygon([(cx - 0.75 * s, by - 0.8 * s), (cx, by - 1.4 * s), (cx + 0.75 * s, by - 0.8 * s)],
                      fill=(120, 50, 40))
            d.rectangle((cx - 0.12 * s, by - 0.4 * s, cx + 0.12 * s, by), fill=(70, 45, 30))
            d.rectangle((cx + 0.25 * s, by - 0.6 * s, cx + 0.45 * s, by - 0.4 * s), fill=(200, 220, 240))
        else:  # tree
            d.rectangle((cx - 0.08 * s, by - 0.5 * s, cx + 0.08 * s, by), fill=(100, 65, 35))
            d.polygon([(cx - 0.5 * s, by - 0.4 * s), (cx, by - 1.6 * s), (cx + 0.5 * s, by - 0.4 * s)], fill=color,
                      outline=dark)
    return np.asarray(img)


# ---------------------------------------------------------------------------------------------------- edits
def choose_edit(rng: np.random.Generator, scene: dict) -> dict:
    kind = str(rng.choice(EDITS, p=EDIT_P))
    edit: dict = {"kind": kind}
    if kind in ("remove", "recolour", "crop"):
        edit["object"] = int(rng.integers(len(scene["objects"])))
    if kind == "recolour":
        o = scene["objects"][edit["object"]]
        taken = {(p["kind"], p["color"]) for p in scene["objects"]}
        edit["new"] = str(rng.choice([c for c in COLORS if c != o["color"] and (o["kind"], c) not in taken]))
    elif kind == "rotate":
        edit["way"] = str(rng.choice(list(ROTATIONS)))
    elif kind == "add_text":
        edit["text"], edit["pos"] = str(rng.choice(WORDS)), str(rng.choice(["top", "bottom"]))
        edit["color"] = str(rng.choice(["white", "black", "yellow", "red"]))
    elif kind in ("brighten", "darken", "more_contrast", "less_contrast", "saturate"):
        edit["factor"] = float(rng.uniform(1.4, 1.8) if kind in ("brighten", "more_contrast", "saturate")
                               else rng.uniform(0.45, 0.65))
    return edit


def apply_edit(scene: dict, edit: dict, before: np.ndarray) -> np.ndarray:
    """The edited photo (uint8 RGB; a crop is smaller, a 90-degree rotation swaps width and height)."""
    from PIL import Image, ImageDraw, ImageEnhance, ImageFilter, ImageFont

    h, w = before.shape[:2]
    img = Image.fromarray(before)
    k = edit["kind"]
    if k in ("brighten", "darken"):
        img = ImageEnhance.Brightness(img).enhance(edit["factor"])
    elif k in ("more_contrast", "less_contrast"):
        img = ImageEnhance.Contrast(img).enhance(edit["factor"])
    elif k == "saturate":
        img = ImageEnhance.Color(img).enhance(edit["factor"] + 0.6)
    elif k == "black_and_white":
        img = img.convert("L").convert("RGB")
    elif k in ("warm", "cool"):
        gain = np.array((1.18, 1.02, 0.78) if k == "warm" else (0.8, 0.98, 1.22), np.float32)
        img = Image.fromarray(np.clip(before * gain, 0, 255).astype(np.uint8))
    elif k == "crop":
        o = scene["objects"][edit["object"]]
        s = o["size"] * w
        cw = max(2.4 * s, 0.5 * w)
        cx, cy = o["cx"] * w, o["base"] * h - 0.6 * s
        x0, y0 = int(np.clip(cx - cw / 2, 0, w - cw)), int(np.clip(cy - 0.75 * cw / 2, 0, h - 0.75 * cw))
        img = img.crop((x0, y0, x0 + int(cw), y0 + int(0.75 * cw)))
    elif k == "zoom":
        img = img.crop((w // 4, h // 4, w - w // 4, h - h // 4)).resize((w, h), Image.BICUBIC)
    elif k == "rotate":
        img = img.transpose({"left": Image.Transpose.ROTATE_90, "right": Image.Transpose.ROTATE_270,
                             "half": Image.Transpose.ROTATE_180}[edit["way"]])
    elif k == "flip":
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    elif k == "blur":
        img = img.filter(ImageFilter.GaussianBlur(radius=max(2.0, w / 80)))
    elif k == "sharpen":
        img = img.filter(ImageFilter.UnsharpMask(radius=2, percent=250, threshold=0))
    elif k == "remove":
        img = Image.fromarray(draw(scene, w, h, skip=edit["object"]))
    elif k == "recolour":
        img = Image.fromarray(draw(scene, w, h, recolour=(edit["object"], edit["new"])))
    elif k == "add_text":
        font = ImageFont.load_default(size=max(10, h // 7))
        d = ImageDraw.Draw(img)
        box = d.textbbox((0, 0), edit["text"], font=font)
        x = (w - (box[2] - box[0])) / 2
        y = 0.06 * h if edit["pos"] == "top" else 0.94 * h - (box[3] - box[1]) - box[1]
        d.text((x, y - box[1] if edit["pos"] == "top" else y), edit["text"], font=font, fill=COLORS[edit["color"]],
               stroke_width=1, stroke_fill=(0, 0, 0) if edit["color"] != "black" else (255, 255, 255))
    else:  # pragma: no cover - EDITS lists every kind
        raise ValueError(k)
    return np.asarray(img.convert("RGB"))


def requests(rng: np.random.Generator, scene: dict, edit: dict, n: int = POOL) -> list[str]:
    """``n`` distinct requests for the edit, in the release's style (the first letter sometimes capital, a
    final period sometimes)."""
    k = edit["kind"]
    fields: dict = {}
    if "object" in edit:
        o = scene["objects"][edit["object"]]
        fields.update(obj=f"{o['color']} {NOUNS[o['kind']][int(rng.integers(len(NOUNS[o['kind']])))]}",
                      where=where(o))
    fields.update({key: edit[key] for key in ("new", "text", "pos") if key in edit})
    templates = list(TEMPLATES[k])
    out: list[str] = []
    for t in rng.permutation(len(templates)):
        way = ROTATIONS[edit["way"]][int(rng.integers(len(ROTATIONS[edit["way"]])))] if k == "rotate" else ""
        s = templates[int(t)].format(way=way, **fields)
        if rng.random() < 0.5:
            s = s[0].upper() + s[1:]
        if rng.random() < 0.25:
            s += "."
        if s not in out:
            out.append(s)
        if len(out) == n:
            break
    return out


def file_names(rng: np.random.Generator, index: int) -> tuple[str, str, str]:
    """(source, original's name, edit's name): ``<Src>.com_<post>_<post>.<ext>``, ``..._<comment>.<ext>``."""
    src = "Reddit" if rng.random() < 0.53 else "Zhopped"
    post = _b36(index, 3) + _b36(int(rng.integers(36 ** 3)), 3)
    comment = _b36(int(rng.integers(36 ** 6, 36 ** 7)), 7)
    exts = list(EXTENSIONS)
    p = np.asarray(list(EXTENSIONS.values()))
    e0, e1 = (exts[int(rng.choice(len(exts), p=p / p.sum()))] for _ in range(2))
    return src, f"{src}.com_{post}_{post}{e0}", f"{src}.com_{post}_{comment}{e1}"


def make_pair(seed: int, index: int, width: int, height: int, parent: int | None = None) -> dict:
    """Pair ``index``; with a ``parent`` (a sibling, ``splits_and_repeats``) it edits the parent's original, its
    same file ``img0``, by another kind of edit (its ``img1`` a comment of the parent's post)."""
    rng = np.random.default_rng([int(seed), int(index)])
    src, img0, img1 = file_names(rng, index)
    scene = make_scene(rng, width, height)
    other = None
    if parent is not None:
        p = make_pair(seed, parent, width, height)
        src, img0, scene, other = p["source"], p["img0"], p["scene"], p["edit"]["kind"]
        img1 = img0.rsplit("_", 1)[0] + "_" + img1.rsplit("_", 1)[1]
    edit = choose_edit(rng, scene)
    while edit["kind"] == other:
        edit = choose_edit(rng, scene)
    return {"index": int(index), "source": src, "img0": img0, "img1": img1, "scene": scene, "edit": edit,
            "requests": requests(rng, scene, edit)}


# ---------------------------------------------------------------------------------------------------- world
def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_pair_world_arguments(parser, (800, "rendered pairs; the release: 3,939 entries"), DEFAULT_SPLIT_FRACTIONS,
                             ("TRAIN", "VALID", "TEST"), "photo width in pixels, height 3/4 of it")


def run(args: argparse.Namespace) -> None:
    generate(args.out, n_pairs=args.n_pairs, seed=args.seed, split_fractions=tuple(args.split_fractions),
             size=args.size, workers=args.workers, progress=not args.no_progress)


def splits_and_repeats(seed: int, n_pairs: int, fractions) -> tuple[dict[str, list[int]], list[int], dict[int, int]]:
    """The rendered indices of each split (shuffled, in file order), the valid indices repeated in test, and the
    siblings: test index -> the valid index whose original it edits otherwise."""
    rng = np.random.default_rng([int(seed), SPLIT_STREAM])
    order = [int(i) for i in rng.permutation(n_pairs)]
    n_valid = max(1, int(round(n_pairs * fractions[1])))
    n_test = max(1, int(round(n_pairs * fractions[2])))
    n_train = n_pairs - n_valid - n_test
    splits = {"train": order[:n_train], "valid": order[n_train:n_train + n_valid], "test": order[n_train + n_valid:]}
    n_dup = int(round(DUP_FRACTION * n_valid))
    repeats = [int(i) for i in rng.choice(splits["valid"], size=n_dup, replace=False)] if n_dup else []
    n_sib = min(int(round(SIBLING_FRACTION * n_test)), n_valid)
    children = rng.choice(splits["test"], size=n_sib, replace=False)
    parents = rng.choice(splits["valid"], size=n_sib, replace=False)
    return splits, repeats, {int(c): int(p) for c, p in zip(children, parents)}


def _work(task) -> int:
    partial, index, params = task
    partial = Path(partial)
    w = params["image_size"]
    h = w * 3 // 4
    _, _, siblings = splits_and_repeats(params["seed"], params["n_pairs"], params["split_fractions"])
    pair = make_pair(params["seed"], index, w, h, parent=siblings.get(index))
    before = draw(pair["scene"], w, h)
    after = apply_edit(pair["scene"], pair["edit"], before)
    folder = partial / "data" / SUBDIRS[0]
    save_image(folder / pair["img0"], before)
    save_image(folder / pair["img1"], after)
    digest = hashlib.sha256(before.tobytes() + after.tobytes()).hexdigest()
    write_json(meta_path(partial, index), {**pair, "pixel_sha256": digest}, indent=None)
    return index


def _done(partial: Path, index: int) -> bool:
    if not meta_path(partial, index).exists():
        return False
    meta = read_json(meta_path(partial, index))
    folder = partial / "data" / SUBDIRS[0]
    return (folder / meta["img0"]).exists() and (folder / meta["img1"]).exists()


def _finalize(partial: Path, params: dict, splits: dict[str, list[int]], repeats: list[int],
              siblings: dict[int, int]) -> None:
    data = partial / "data"
    metas = {i: read_json(meta_path(partial, i)) for s in SPLITS for i in splits[s]}
    counts = {}
    for split in SPLITS:
        entries = [{"img0": metas[i]["img0"], "img1": metas[i]["img1"], "sents": metas[i]["requests"][:REQUESTS[split]],
                    "uid": f"{metas[i]['source']}_{i}"} for i in splits[split]]
        if split == "test":  # the release's valid/test repeats: the same files, another uid and other requests
            n = params["n_pairs"]
            dups = [{"img0": metas[i]["img0"], "img1": metas[i]["img1"], "sents": metas[i]["requests"][3:6],
                     "uid": f"{metas[i]['source']}_{n + k}"} for k, i in enumerate(repeats)]
            order = np.random.default_rng([params["seed"], SPLIT_STREAM, 1]).permutation(len(entries) + len(dups))
            both = entries + dups
            entries = [both[int(j)] for j in order]
        write_json(data / f"{split}.json", entries, indent=None)
        counts[split] = {"pairs": len(entries), "requests": sum(len(e["sents"]) for e in entries),
                         "edits": dict(sorted({k: sum(metas[i]["edit"]["kind"] == k for i in splits[split])
                                               for k in EDITS}.items()))}
    counts["test"]["repeats_of_valid"] = len(repeats)
    counts["test"]["siblings_of_valid"] = len(siblings)
    write_jsonl(partial / "scenes.jsonl", [{k: metas[i][k] for k in ("index", "img0", "img1", "scene", "edit")}
                                           for i in sorted(metas)])
    write_json(partial / "SYNTHETIC.json", {
        **params, "synthetic": True,
        "note": "synthetic — not the official Image Editing Request: procedural photos and their edits rendered "
                "by idc-pipeline in the release's file layout",
        "counts": counts,
        "pixel_sha256": hashlib.sha256("".join(metas[i]["pixel_sha256"] for i in sorted(metas)).encode()).hexdigest(),
        "scenes": "scenes.jsonl"}, indent=2)


def generate(out, n_pairs: int = 800, seed: int = 0, split_fractions=DEFAULT_SPLIT_FRACTIONS, size: int = 224,
             workers: int = 1, progress: bool = True, max_new_indices: int | None = None) -> bool:
    """Render the world into ``out`` (resumable, ``pipeline.synth.world``); True once complete."""
    fr = check_arguments("synth-image-editing-request", split_fractions, n_pairs, seed, workers, size)
    splits, repeats, siblings = splits_and_repeats(seed, n_pairs, fr)
    if not splits["train"]:
        raise PipelineError(f"--n-pairs {n_pairs} leaves no training pair with --split-fractions {fr}")
    params = {"generator": GENERATOR, "version": VERSION, "seed": int(seed), "n_pairs": int(n_pairs),
              "split_fractions": fr, "image_size": int(size)}
    return render_world(out, params, params, list(range(n_pairs)), _work, _done,
                        lambda p: _finalize(p, params, splits, repeats, siblings), SUBDIRS, workers=workers,
                        progress=progress, desc="synth-image-editing-request", max_new_indices=max_new_indices)
