"""Stage ``synth-spot-the-diff``: render a synthetic Spot-the-Diff world in the release's layout.

    python -m pipeline synth-spot-the-diff --out resources/raw/spot_the_diff/synthetic --n-pairs 1000 --seed 0

writes ``OUT/data/`` as the repository's ``data/`` folder with the images extracted (reference/datasets.md §3;
parsed by ``pipeline.datasets.spot_the_diff``): ``resized_images/<img_id>.png`` (before) and
``<img_id>_2.png`` (after), 224 x 224 by default like the release, and ``annotations/{train,val,test}.json``
(``[{"img_id": "<int>", "sentences": [...]}, ...]``, in a shuffled order), plus ``OUT/SYNTHETIC.json``
(provenance and counts) and ``OUT/scenes.jsonl`` (every pair's objects and changes). The release's
``<img_id>_diff.jpg`` images are not written (no parser reads them).

The world is a fixed surveillance view of a parking lot (the release's frames are VIRAT parking-lot video):
a ground plane seen from a camera 10 m up pitched 35 degrees down, painted parking rows either side of a
driving lane with a yellow arrow, a sidewalk and a building at the back. Objects are flat-shaded boxes on the
plane, painted far to near (a small polygon rasteriser: the CLEVR ray caster's primitives, ``pipeline.synth.
render``, have CLEVR's fixed proportions, no car-shaped box), each with a ground shadow: cars and trucks
(parked in the rows or driving in the lane), people and bags. The two frames
of a pair differ by 1-3 changes (``CHANGES``: an object appears, disappears or moves; a changed object is
at least half visible in each frame it is in) and by a small illumination change (``ILLUMINATION``: a gain
and a colour tint on the after frame, sensor noise on both). There are no distractor pairs.

Each change gets one sentence per annotator, lowercase and without punctuation as in the release ("the white
car is no longer there", "a person in red has appeared on the left"); a pair's first entry describes every
change, and the release's quirks are reproduced: a pair has a second (``P_SECOND_ENTRY``) and third
(``P_THIRD_ENTRY``) entry with the same ``img_id`` written by other "annotators", an entry holds an empty
sentence with probability ``P_EMPTY``, and ``img_id``s are a random subset of ``range(ID_SPACE * n)``
(gaps, as in the release), split at random (``--split-fractions``, the release's 76 / 13 / 11 % by
default). Everything about an ``img_id`` draws from ``default_rng([seed, img_id])``; the ids and the split
from ``default_rng([seed, ID_STREAM])``: the world is the same for any worker count (``pipeline.synth.world``).
"""

from __future__ import annotations

import argparse
import hashlib
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pipeline.errors import PipelineError
from pipeline.synth.world import add_pair_world_arguments, check_arguments, meta_path, render_world, save_png
from pipeline.utils.io import read_json, write_json, write_jsonl

GENERATOR = "pipeline.synth.spot_the_diff"
VERSION = "1.0.0"
SUBDIRS = ("resized_images",)
SPLITS = ("train", "val", "test")
DEFAULT_SPLIT_FRACTIONS = (0.76, 0.13, 0.11)  # the release's, by distinct pair (8,566 / 1,493 / 1,270)
ID_SPACE = 1.3  # img_ids are drawn from range(ID_SPACE * n_pairs): the release's 11,329 ids lie in 0..14,999
ID_STREAM = 1 << 40  # the rng stream of the ids and the split (img_ids are far below it)

CHANGES = ("appear", "disappear", "move")
N_CHANGES_P = (0.5, 0.3, 0.2)  # 1, 2 or 3 changes per pair
P_SECOND_ENTRY, P_THIRD_ENTRY = 0.12, 0.2  # (the release: 9,524 train entries over 8,566 ids)
P_EMPTY = 0.02  # per entry (the release: 53 of 17,676 train sentences are empty)
ILLUMINATION = {"gain": (0.9, 1.1), "tint": 0.03, "noise_sigma": 2.0}

# ---------------------------------------------------------------------------------------------------- camera
# A pin-hole surveillance camera CAM_HEIGHT metres above the ground at x = 0, z = 0, looking along +z pitched
# PITCH_DEG down, focal length FOCAL image heights: world x (right), y (up), z (away) in metres.
CAM_HEIGHT = 10.0
PITCH_DEG = 35.0
FOCAL = 150.0 / 224.0
LOT = {"z": (5.0, 26.0), "lane_x": 2.8, "row_x": (3.0, 7.6), "slot_depth": 3.0, "sidewalk_z": (26.0, 30.0),
       "building_z": 30.0, "building_h": 9.0}
SUN = (0.35, 0.25)  # a shadow's offset (x, z) per metre of height


@dataclass(frozen=True)
class Cam:
    width: int
    height: int

    @property
    def f(self) -> float:
        return FOCAL * self.height

    def depth(self, y: float, z: float) -> float:
        a = math.radians(PITCH_DEG)
        return z * math.cos(a) + (CAM_HEIGHT - y) * math.sin(a)

    def project(self, x: float, y: float, z: float) -> tuple[float, float]:
        a = math.radians(PITCH_DEG)
        yc = CAM_HEIGHT - y
        d = z * math.cos(a) + yc * math.sin(a)
        return self.width / 2.0 + self.f * x / d, self.height / 2.0 + self.f * (yc * math.cos(a) - z * math.sin(a)) / d

    def scale(self, y: float, z: float) -> float:
        """Pixels per metre at that point."""
        return self.f / self.depth(y, z)


# ---------------------------------------------------------------------------------------------------- objects
KINDS = ("car", "truck", "person", "bag")
KIND_P = (0.45, 0.1, 0.35, 0.1)
COLORS = {
    "car": {"white": (226, 226, 222), "black": (34, 34, 38), "silver": (168, 172, 178), "red": (170, 30, 28),
            "blue": (36, 64, 150), "grey": (110, 112, 116), "green": (40, 100, 56)},
    "truck": {"white": (226, 226, 222), "blue": (36, 64, 150), "red": (170, 30, 28), "brown": (110, 74, 44)},
    "person": {"red": (190, 34, 34), "blue": (40, 70, 170), "black": (30, 30, 32), "white": (230, 230, 230),
               "green": (44, 140, 60), "yellow": (220, 190, 40)},
    "bag": {"black": (28, 28, 30), "brown": (120, 78, 40), "red": (170, 30, 30), "blue": (40, 60, 150)},
}
GLASS = (52, 62, 74)
PANTS = (46, 48, 62)
SKIN = (196, 150, 120)
# footprint (length along the heading, width) in metres per kind; the boxes an object is drawn with: ``_parts``
SIZES = {"car": (4.4, 1.8), "truck": (5.6, 2.1), "person": (0.45, 0.45), "bag": (0.6, 0.4)}
MIN_VISIBLE_FRACTION = 0.5
MIN_VISIBLE_PIXELS = 8  # at 224 x 224 (scaled with the image area)
MOVE_MIN = {"car": 3.0, "truck": 3.0, "person": 2.0, "bag": 1.5}


@dataclass(frozen=True)
class Thing:
    kind: str
    color: str
    x: float
    z: float
    along_z: bool = False  # heading along the lane (driving) rather than across it (parked)

    def footprint(self, margin: float = 0.0) -> tuple[float, float, float, float]:
        length, width = SIZES[self.kind]
        dx, dz = (width, length) if self.along_z else (length, width)
        return (self.x - dx / 2 - margin, self.x + dx / 2 + margin, self.z - dz / 2 - margin, self.z + dz / 2 + margin)

    def to_dict(self) -> dict:
        return asdict(self)


def _overlap(a: Thing, b: Thing, margin: float = 0.3) -> bool:
    ax0, ax1, az0, az1 = a.footprint(margin)
    bx0, bx1, bz0, bz1 = b.footprint()
    return ax0 < bx1 and bx0 < ax1 and az0 < bz1 and bz0 < az1


def slots() -> list[tuple[float, float]]:
    """Parking slot centres (x, z): two rows across the lane, cars parked across it."""
    z0, z1 = LOT["z"]
    n = int((z1 - z0) // LOT["slot_depth"])
    xs = (-(LOT["row_x"][0] + LOT["row_x"][1]) / 2, (LOT["row_x"][0] + LOT["row_x"][1]) / 2)
    return [(x, z0 + LOT["slot_depth"] * (k + 0.5)) for x in xs for k in range(n)]


def _place(rng: np.random.Generator, kind: str, color: str, cam: Cam) -> Thing:
    """A random position for a new object of ``kind`` (not yet checked against the others)."""
    if kind in ("car", "truck"):
        if rng.random() < 0.8:
            sl = slots()
            x, z = sl[int(rng.integers(len(sl)))]
            return Thing(kind, color, x, z, along_z=False)
        return Thing(kind, color, float(rng.uniform(-1.2, 1.2)), float(rng.uniform(6.0, 24.0)), along_z=True)
    z_hi = 28.5 if kind == "person" else 18.0
    z = float(rng.uniform(4.0, z_hi))
    half = cam.width / 2.0 * cam.depth(0.0, z) / cam.f - 0.6  # inside the view at that depth
    return Thing(kind, color, float(rng.uniform(-min(half, 11.0), min(half, 11.0))), z)


def _new_thing(rng: np.random.Generator, cam: Cam, others, kind: str | None = None) -> Thing | None:
    kind = kind or str(rng.choice(KINDS, p=KIND_P))
    color = str(rng.choice(sorted(COLORS[kind])))
    for _ in range(30):
        t = _place(rng, kind, color, cam)
        if _in_view(t, cam) and not any(_overlap(t, o) for o in others):
            return t
    return None


# ---------------------------------------------------------------------------------------------------- raster
def _fill_convex(img, ids, pts, color, obj: int) -> None:
    """Paint the convex polygon ``pts`` (pixel x, y; either winding) with ``color``; pixel centres inside."""
    pts = np.asarray(pts, dtype=np.float64)
    h, w = ids.shape
    x0, x1 = max(0, int(math.floor(pts[:, 0].min()))), min(w, int(math.ceil(pts[:, 0].max())) + 1)
    y0, y1 = max(0, int(math.floor(pts[:, 1].min()))), min(h, int(math.ceil(pts[:, 1].max())) + 1)
    if x0 >= x1 or y0 >= y1:
        return
    yy, xx = np.mgrid[y0:y1, x0:x1]
    px, py = xx + 0.5, yy + 0.5
    cross = []
    for i in range(len(pts)):
        ax, ay = pts[i]
        bx, by = pts[(i + 1) % len(pts)]
        cross.append((bx - ax) * (py - ay) - (by - ay) * (px - ax))
    cross = np.stack(cross)
    inside = (cross >= 0).all(0) | (cross <= 0).all(0)
    if color is None:  # a shadow: darken what is there
        img[y0:y1, x0:x1][inside] *= 0.62
        return
    img[y0:y1, x0:x1][inside] = color
    ids[y0:y1, x0:x1][inside] = obj


def _fill_ellipse(img, ids, cx, cy, rx, ry, color, obj: int) -> None:
    h, w = ids.shape
    x0, x1 = max(0, int(cx - rx)), min(w, int(cx + rx) + 2)
    y0, y1 = max(0, int(cy - ry)), min(h, int(cy + ry) + 2)
    if x0 >= x1 or y0 >= y1 or rx <= 0 or ry <= 0:
        return
    yy, xx = np.mgrid[y0:y1, x0:x1]
    inside = ((xx + 0.5 - cx) / rx) ** 2 + ((yy + 0.5 - cy) / ry) ** 2 <= 1.0
    img[y0:y1, x0:x1][inside] = color
    ids[y0:y1, x0:x1][inside] = obj


def _shade(color, k: float):
    return tuple(min(255.0, c * k) for c in color)


def _box(img, ids, cam: Cam, x0, x1, z0, z1, y0, y1, color, obj, top=None) -> None:
    """A box on or above the ground: the faces the camera sees (top, front, the side facing the centre)."""
    P = cam.project
    side_x = x0 if x0 > 0 else (x1 if x1 < 0 else None)
    if side_x is not None:
        _fill_convex(img, ids, [P(side_x, y0, z0), P(side_x, y0, z1), P(side_x, y1, z1), P(side_x, y1, z0)],
                     _shade(color, 0.72), obj)
    _fill_convex(img, ids, [P(x0, y1, z0), P(x1, y1, z0), P(x1, y1, z1), P(x0, y1, z1)],
                 top if top is not None else _shade(color, 1.08), obj)
    _fill_convex(img, ids, [P(x0, y0, z0), P(x1, y0, z0), P(x1, y1, z0), P(x0, y1, z0)], _shade(color, 0.86), obj)


def _parts(t: Thing) -> list[tuple]:
    """Boxes (x0, x1, z0, z1, y0, y1, colour, top colour) of an object, far to near."""
    x0, x1, z0, z1 = t.footprint()
    col = COLORS[t.kind][t.color]
    if t.kind == "person":
        r = 0.2
        return [(t.x - r, t.x + r, t.z - 0.12, t.z + 0.12, 0.0, 0.85, PANTS, None),
                (t.x - r - 0.04, t.x + r + 0.04, t.z - 0.13, t.z + 0.13, 0.85, 1.5, col, None)]
    if t.kind == "bag":
        return [(x0, x1, z0, z1, 0.0, 0.45, col, None)]

    def cut(a, b, y0, y1, c, top=None):  # a slab of the length between fractions a and b
        if t.along_z:
            return (x0, x1, z0 + (z1 - z0) * a, z0 + (z1 - z0) * b, y0, y1, c, top)
        return (x0 + (x1 - x0) * a, x0 + (x1 - x0) * b, z0, z1, y0, y1, c, top)

    if t.kind == "car":
        body = cut(0.0, 1.0, 0.25, 0.95, col)
        cabin = cut(0.25, 0.75, 0.95, 1.45, GLASS, _shade(col, 1.05))
        return [body, cabin]
    cab = cut(0.0, 0.3, 0.3, 2.0, GLASS, _shade(col, 1.05))
    cargo = cut(0.32, 1.0, 0.3, 2.5, col)
    return [cab, cargo]


def _draw_thing(img, ids, cam: Cam, t: Thing, obj: int) -> None:
    parts = _parts(t)
    # far parts first, then (side by side) the part further from the centre line: the camera sees the sides
    # that face it; parts stacked at the same place keep their order (a car's cabin over its body)
    for x0, x1, z0, z1, y0, y1, c, top in sorted(parts, key=lambda p: (-(p[2] + p[3]), -abs(p[0] + p[1]))):
        _box(img, ids, cam, x0, x1, z0, z1, y0, y1, c, obj, top)
    if t.kind == "person":
        u, v = cam.project(t.x, 1.68, t.z)
        s = cam.scale(1.68, t.z)
        _fill_ellipse(img, ids, u, v, 0.13 * s, 0.16 * s, SKIN, obj)


def _shadow(img, ids, cam: Cam, t: Thing) -> None:
    x0, x1, z0, z1 = t.footprint()
    hgt = HEIGHTS[t.kind]
    dx, dz = SUN[0] * hgt, SUN[1] * hgt
    P = cam.project
    pts = [P(x0, 0, z0), P(x1, 0, z0), P(x1 + dx, 0, z0 + dz), P(x1 + dx, 0, z1 + dz), P(x0 + dx, 0, z1 + dz),
           P(x0, 0, z1)]
    # the hexagon swept by the footprint along the sun offset (convex: dx, dz >= 0)
    _fill_convex(img, ids, pts, None, -1)


def background(cam: Cam) -> np.ndarray:
    """The fixed view: sky, building, sidewalk, asphalt with parking lines and a lane arrow (float RGB)."""
    w, h = cam.width, cam.height
    img = np.zeros((h, w, 3), np.float64)
    ids = np.full((h, w), -1, np.int32)
    rows = (np.arange(h)[:, None] + 0.5) / h
    img[:] = (118 - 24 * rows)[..., None] * np.array([1.0, 1.0, 1.03])  # asphalt, lighter far away
    P = cam.project
    far = 60.0
    zb = LOT["building_z"]
    _fill_convex(img, ids, [P(-far, 0, LOT["sidewalk_z"][0]), P(far, 0, LOT["sidewalk_z"][0]),
                            P(far, 0, zb), P(-far, 0, zb)], (150, 148, 140), -1)
    bh = LOT["building_h"]
    _fill_convex(img, ids, [(0, 0), (w, 0), (w, P(0, 0, zb)[1]), (0, P(0, 0, zb)[1])], (176, 196, 214), -1)
    _fill_convex(img, ids, [P(-far, 0, zb), P(far, 0, zb), P(far, bh, zb), P(-far, bh, zb)], (186, 168, 140), -1)
    for k in range(-12, 13):  # windows
        for y in (2.5, 6.0):
            x = 3.2 * k
            _fill_convex(img, ids, [P(x, y, zb), P(x + 1.6, y, zb), P(x + 1.6, y + 1.6, zb), P(x, y + 1.6, zb)],
                         (92, 104, 118), -1)
    line = (206, 206, 196)
    z0, z1 = LOT["z"]
    for side in (-1, 1):
        xa, xb = side * LOT["row_x"][0], side * LOT["row_x"][1]
        for k in range(int((z1 - z0) // LOT["slot_depth"]) + 1):
            z = z0 + LOT["slot_depth"] * k
            _fill_convex(img, ids, [P(xa, 0, z - 0.06), P(xb, 0, z - 0.06), P(xb, 0, z + 0.06), P(xa, 0, z + 0.06)],
                         line, -1)
        xl = side * LOT["lane_x"]
        _fill_convex(img, ids, [P(xl - 0.06, 0, z0), P(xl + 0.06, 0, z0), P(xl + 0.06, 0, z1), P(xl - 0.06, 0, z1)],
                     line, -1)
    yellow = (214, 184, 52)
    _fill_convex(img, ids, [P(-0.15, 0, 9.0), P(0.15, 0, 9.0), P(0.15, 0, 12.0), P(-0.15, 0, 12.0)], yellow, -1)
    _fill_convex(img, ids, [P(-0.6, 0, 9.2), P(0.6, 0, 9.2), P(0.0, 0, 8.0)], yellow, -1)
    return img


_BACKGROUNDS: dict[tuple[int, int], np.ndarray] = {}


def draw(things: list[Thing], cam: Cam) -> tuple[np.ndarray, np.ndarray]:
    """(float RGB [H, W, 3], object ids [H, W], -1 = background) of a frame with ``things``."""
    key = (cam.width, cam.height)
    if key not in _BACKGROUNDS:
        _BACKGROUNDS[key] = background(cam)
    img = _BACKGROUNDS[key].copy()
    ids = np.full((cam.height, cam.width), -1, np.int32)
    for t in things:
        _shadow(img, ids, cam, t)
    for k in sorted(range(len(things)), key=lambda k: -things[k].z):  # painter's order: far to near
        _draw_thing(img, ids, cam, things[k], k)
    return img, ids


HEIGHTS = {"car": 1.45, "truck": 2.5, "person": 1.7, "bag": 0.45}


def _in_view(t: Thing, cam: Cam) -> bool:
    """The whole object (its footprint's box up to its height) is inside the image."""
    x0, x1, z0, z1 = t.footprint()
    for x in (x0, x1):
        for z in (z0, z1):
            for y in (0.0, HEIGHTS[t.kind]):
                u, v = cam.project(x, y, z)
                if not (1 <= u <= cam.width - 1 and 1 <= v <= cam.height - 1):
                    return False
    return True


def _area(t: Thing, cam: Cam) -> int:
    return int((draw([t], cam)[1] == 0).sum())


def visible_enough(things: list[Thing], k: int, cam: Cam) -> bool:
    _, ids = draw(things, cam)
    seen = int((ids == k).sum())
    return seen >= MIN_VISIBLE_FRACTION * _area(things[k], cam) and \
        seen >= MIN_VISIBLE_PIXELS * cam.width * cam.height / (224 * 224)


# ---------------------------------------------------------------------------------------------------- sentences
def _side(t: Thing) -> str:
    return "left" if t.x < -LOT["lane_x"] + 0.5 else ("right" if t.x > LOT["lane_x"] - 0.5 else "middle")


def location(rng: np.random.Generator, t: Thing) -> str:
    side = _side(t)
    if side == "middle":
        side_p = str(rng.choice(["in the middle of the lot", "in the driving lane", "in the center"]))
    else:
        side_p = str(rng.choice([f"on the {side}", f"on the {side} side", f"on the {side} side of the lot"]))
    if t.z > 20.0:
        depth = str(rng.choice(["near the building", "in the back", "at the top"]))
    elif t.z < 10.0:
        depth = str(rng.choice(["at the bottom", "in the front", "near the camera"]))
    else:
        depth = ""
    if depth and rng.random() < 0.4:
        return depth
    return f"{side_p} {depth}".strip() if depth and rng.random() < 0.5 else side_p


def noun(rng: np.random.Generator, t: Thing) -> str:
    if t.kind == "person":
        return str(rng.choice([f"person in {t.color}", f"person wearing {t.color}", f"{t.color} shirted person"]))
    name = t.kind
    if t.kind == "car" and rng.random() < 0.2:
        name = "vehicle"
    if t.kind == "bag" and rng.random() < 0.3:
        name = "backpack"
    return f"{t.color} {name}"


def direction(before: Thing, after: Thing) -> str:
    dx, dz = after.x - before.x, after.z - before.z
    if abs(dz) >= abs(dx):
        return "closer to the camera" if dz < 0 else "further away"
    return "to the left" if dx < 0 else "to the right"


def sentence(rng: np.random.Generator, change: dict) -> str:
    kind = change["kind"]
    t = Thing(**(change["after"] if kind == "appear" else change["before"]))
    n, loc = noun(rng, t), location(rng, t)
    if kind == "disappear":
        opts = [f"the {n} is gone", f"the {n} {loc} is gone", f"the {n} is no longer there",
                f"the {n} {loc} is missing", f"there is no {n} {loc} in the after image"]
        opts += {"car": [f"the {n} {loc} has driven away", f"the {n} {loc} left its parking spot"],
                 "truck": [f"the {n} {loc} has driven away"],
                 "person": [f"the {n} {loc} walked away", f"the {n} has left"],
                 "bag": [f"the {n} {loc} was picked up", f"the {n} on the ground is gone"]}[t.kind]
    elif kind == "appear":
        opts = [f"there is a new {n} {loc}", f"a {n} has appeared {loc}", f"there is now a {n} {loc}",
                f"in the after image there is a {n} {loc}", f"a {n} is now {loc}"]
        opts += {"car": [f"a {n} has parked {loc}", f"a {n} pulled in {loc}"],
                 "truck": [f"a {n} has parked {loc}"],
                 "person": [f"a {n} is walking {loc}", f"a {n} is now standing {loc}"],
                 "bag": [f"someone left a {n} {loc}", f"a {n} is lying on the ground {loc}"]}[t.kind]
    else:
        a = Thing(**change["after"])
        d = direction(t, a)
        opts = [f"the {n} has moved {d}", f"the {n} {loc} moved {d}", f"the {n} is in a different spot",
                f"the {n} is now {location(rng, a)}", f"the {n} has moved"]
        if t.kind in ("car", "truck") and not t.along_z and a.along_z:
            opts.append(f"the {n} pulled out of its parking spot")
        if t.kind in ("car", "truck") and not a.along_z:
            opts.append(f"the {n} parked in a different spot")
    return " ".join(str(rng.choice(opts)).split())


def entry_sentences(rng: np.random.Generator, changes: list[dict]) -> list[str]:
    """One annotator's sentences: one per change, in a random order; sometimes an empty one too."""
    order = rng.permutation(len(changes))
    out = [sentence(rng, changes[int(i)]) for i in order]
    if rng.random() < P_EMPTY:
        out.insert(int(rng.integers(len(out) + 1)), "")
    return out


# ---------------------------------------------------------------------------------------------------- pairs
def make_pair(seed: int, img_id: int, width: int = 224, height: int = 224) -> dict:
    """The complete, deterministic content of one pair: objects of both frames, changes, illumination and
    the annotators' entries."""
    rng = np.random.default_rng([int(seed), int(img_id)])
    cam = Cam(width, height)
    for _ in range(200):
        before: list[Thing] = []
        for _ in range(int(rng.integers(3, 8))):
            t = _new_thing(rng, cam, before)
            if t is not None:
                before.append(t)
        n_changes = int(rng.choice([1, 2, 3], p=N_CHANGES_P))
        after = list(before)
        changes, touched, ok = [], set(), True
        for _ in range(n_changes):
            kind = str(rng.choice(CHANGES))
            if kind != "appear":
                free = [k for k in range(len(before)) if k not in touched]
                if not free:
                    kind = "appear"
            if kind == "appear":
                t = _new_thing(rng, cam, [o for o in before + after if o is not None])
                if t is None:
                    ok = False
                    break
                after.append(t)
                changes.append({"kind": "appear", "before": None, "after": t.to_dict(), "_a": len(after) - 1})
            elif kind == "disappear":
                k = int(rng.choice(free))
                touched.add(k)
                changes.append({"kind": "disappear", "before": before[k].to_dict(), "after": None, "_b": k})
                after[k] = None
            else:
                k = int(rng.choice(free))
                old = before[k]
                others = [o for o in before + after if o is not None and o is not old]
                moved = None
                for _ in range(30):
                    cand = _place(rng, old.kind, old.color, cam)
                    if (math.hypot(cand.x - old.x, cand.z - old.z) >= MOVE_MIN[old.kind] and _in_view(cand, cam)
                            and not any(_overlap(cand, o) for o in others)):
                        moved = cand
                        break
                if moved is None:
                    ok = False
                    break
                touched.add(k)
                after[k] = moved
                changes.append({"kind": "move", "before": old.to_dict(), "after": moved.to_dict(), "_b": k, "_a": k})
        if not ok:
            continue
        after_list = [t for t in after if t is not None]
        index_after = {k: after_list.index(t) for k, t in enumerate(after) if t is not None}
        good = True
        for c in changes:
            if "_b" in c and not visible_enough(before, c["_b"], cam):
                good = False
            if "_a" in c and not visible_enough(after_list, index_after[c["_a"]], cam):
                good = False
        if not good:
            continue
        changes = [{k: v for k, v in c.items() if not k.startswith("_")} for c in changes]
        entries = [entry_sentences(rng, changes)]
        if rng.random() < P_SECOND_ENTRY:
            entries.append(entry_sentences(rng, changes))
            if rng.random() < P_THIRD_ENTRY:
                entries.append(entry_sentences(rng, changes))
        light = {"gain": float(rng.uniform(*ILLUMINATION["gain"])),
                 "tint": [float(v) for v in rng.uniform(-ILLUMINATION["tint"], ILLUMINATION["tint"], 3)]}
        return {"img_id": int(img_id), "before": before, "after": after_list, "changes": changes,
                "entries": entries, "light": light, "noise_seed": int(rng.integers(2 ** 31))}
    raise RuntimeError(f"img_id {img_id}: no valid pair found")


def frames(pair: dict, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """The before and after images (uint8 RGB): the drawn frames, the after one under the changed light,
    both with sensor noise."""
    cam = Cam(width, height)
    noise = np.random.default_rng(pair["noise_seed"])
    out = []
    for things, light in ((pair["before"], None), (pair["after"], pair["light"])):
        img, _ = draw(things, cam)
        if light is not None:
            img = img * light["gain"] * (1.0 + np.asarray(light["tint"]))
        img = img + noise.normal(0.0, ILLUMINATION["noise_sigma"], img.shape)
        out.append(np.clip(np.rint(img), 0, 255).astype(np.uint8))
    return out[0], out[1]


# ---------------------------------------------------------------------------------------------------- world
def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_pair_world_arguments(parser, (1000, "distinct img_ids; release 11,329"), DEFAULT_SPLIT_FRACTIONS,
                             ("TRAIN", "VAL", "TEST"), "image width and height in pixels")


def run(args: argparse.Namespace) -> None:
    generate(args.out, n_pairs=args.n_pairs, seed=args.seed, split_fractions=tuple(args.split_fractions),
             workers=args.workers, size=args.size, progress=not args.no_progress)


def ids_and_splits(seed: int, n_pairs: int, fractions) -> dict[str, list[int]]:
    """The img_ids of each split (a random subset of ``range(ID_SPACE * n_pairs)``, split at random)."""
    rng = np.random.default_rng([int(seed), ID_STREAM])
    ids = rng.choice(int(math.ceil(ID_SPACE * n_pairs)), size=n_pairs, replace=False)
    n_val = max(1, int(round(n_pairs * fractions[1])))
    n_test = max(1, int(round(n_pairs * fractions[2])))
    n_train = n_pairs - n_val - n_test
    return {"train": sorted(int(i) for i in ids[:n_train]),
            "val": sorted(int(i) for i in ids[n_train:n_train + n_val]),
            "test": sorted(int(i) for i in ids[n_train + n_val:])}


def _work(task) -> int:
    partial, img_id, params = task
    partial = Path(partial)
    size = params["image_size"]
    pair = make_pair(params["seed"], img_id, size, size)
    before, after = frames(pair, size, size)
    folder = partial / "data" / SUBDIRS[0]
    save_png(folder / f"{img_id}.png", before)
    save_png(folder / f"{img_id}_2.png", after)
    digest = hashlib.sha256(before.tobytes() + after.tobytes()).hexdigest()
    scene = {"img_id": img_id, "before": [t.to_dict() for t in pair["before"]],
             "after": [t.to_dict() for t in pair["after"]], "changes": pair["changes"], "light": pair["light"]}
    write_json(meta_path(partial, img_id), {"entries": pair["entries"], "pixel_sha256": digest, "scene": scene},
               indent=None)
    return img_id


def _done(partial: Path, img_id: int) -> bool:
    folder = partial / "data" / SUBDIRS[0]
    return meta_path(partial, img_id).exists() and (folder / f"{img_id}.png").exists() and \
        (folder / f"{img_id}_2.png").exists()


def _finalize(partial: Path, params: dict, splits: dict[str, list[int]]) -> None:
    ann = partial / "data" / "annotations"
    ann.mkdir(parents=True, exist_ok=True)
    counts, all_ids = {}, []
    for s_i, split in enumerate(SPLITS):
        metas = {i: read_json(meta_path(partial, i)) for i in splits[split]}
        entries = [{"img_id": str(i), "sentences": sents} for i in splits[split] for sents in metas[i]["entries"]]
        order = np.random.default_rng([params["seed"], ID_STREAM, s_i + 1]).permutation(len(entries))
        write_json(ann / f"{split}.json", [entries[int(k)] for k in order], indent=None)
        sents = [s for e in entries for s in e["sentences"]]
        counts[split] = {"entries": len(entries), "distinct_pairs": len(metas), "sentences": len(sents),
                         "empty_sentences": sum(1 for s in sents if not s.strip()),
                         "changes": sum(len(m["scene"]["changes"]) for m in metas.values())}
        all_ids += splits[split]
    metas = {i: read_json(meta_path(partial, i)) for i in sorted(all_ids)}
    write_jsonl(partial / "scenes.jsonl", [m["scene"] for m in metas.values()])
    write_json(partial / "SYNTHETIC.json", {
        **params, "synthetic": True,
        "note": "synthetic — not the official Spot-the-Diff: a procedural parking-lot miniature rendered by "
                "idc-pipeline in the release's on-disk layout",
        "illumination": {k: list(v) if isinstance(v, tuple) else v for k, v in ILLUMINATION.items()},
        "counts": counts,
        "pixel_sha256": hashlib.sha256("".join(m["pixel_sha256"] for m in metas.values()).encode()).hexdigest(),
        "scenes": "scenes.jsonl"}, indent=2)


def generate(out, n_pairs: int = 1000, seed: int = 0, split_fractions=DEFAULT_SPLIT_FRACTIONS, workers: int = 1,
             size: int = 224, progress: bool = True, max_new_indices: int | None = None) -> bool:
    """Render the world into ``out`` (resumable, ``pipeline.synth.world``); True once complete."""
    fr = check_arguments("synth-spot-the-diff", split_fractions, n_pairs, seed, workers, size)
    splits = ids_and_splits(seed, n_pairs, fr)
    if not splits["train"]:
        raise PipelineError(f"--n-pairs {n_pairs} leaves no training pair with --split-fractions {fr}")
    params = {"generator": GENERATOR, "version": VERSION, "seed": int(seed), "n_pairs": int(n_pairs),
              "split_fractions": fr, "image_size": int(size)}
    indices = sorted(i for s in SPLITS for i in splits[s])
    return render_world(out, params, params, indices, _work, _done, lambda p: _finalize(p, params, splits),
                        SUBDIRS, workers=workers, progress=progress, desc="synth-spot-the-diff",
                        max_new_indices=max_new_indices)
