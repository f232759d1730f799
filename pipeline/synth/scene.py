"""Scene sampling and the five CLEVR-Change changes for the synthetic world.

A scene is 3-10 objects with CLEVR attributes standing on the ground inside ``[-ARENA, ARENA]^2``,
not overlapping (a minimum gap between footprints) and each clearly visible from the default camera
(enough pixels in a low-resolution id buffer; otherwise the scene is resampled). For one index the
generator makes:

* ``before``: the scene, seen from the default camera under the default lights;
* ``after`` (semantic): exactly one change, by index block color / material / add / drop / move, seen
  from a slightly jittered camera under slightly jittered lights;
* the distractor: the very same objects, from another jittered camera and lights.

Everything draws from ``numpy.random.default_rng([seed, index])`` in a fixed order, and the visibility
checks run at a resolution that depends only on the aspect ratio, so an index's scenes do not depend
on the output resolution, the worker count or the machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from pipeline.synth import captions as cap
from pipeline.synth.render import (
    DEFAULT_CAMERA_ORBIT,
    DEFAULT_FOV_DEG,
    DEFAULT_LIGHT_RIG,
    Camera,
    Light,
    Primitive,
    render_ids,
    visible_pixels,
)

SHAPES = ("cube", "sphere", "cylinder")
SIZES = {"large": 0.7, "small": 0.35}
MATERIALS = ("rubber", "metal")
COLORS: dict[str, tuple[int, int, int]] = {
    "gray": (87, 87, 87),
    "red": (173, 35, 35),
    "blue": (42, 75, 215),
    "green": (29, 105, 20),
    "brown": (129, 74, 25),
    "purple": (129, 38, 192),
    "cyan": (41, 208, 208),
    "yellow": (255, 238, 51),
}
CHANGE_TYPES = ("color", "material", "add", "drop", "move")

ARENA = 3.0  # objects' centres lie in [-ARENA, ARENA]^2
MIN_GAP = 0.25  # minimum free space between two footprints
MIN_OBJECTS, MAX_OBJECTS = 3, 10
MOVE_MIN_DISTANCE = 1.5  # a moved object travels at least this far
CHECK_WIDTH = 240  # visibility checks render ids at CHECK_WIDTH x (CHECK_WIDTH * H / W)
MIN_VISIBLE_FRACTION = 0.002  # of the check image's pixels, per object

# jitter of the "after" views (uniform half-ranges)
CAMERA_JITTER = {"azimuth_deg": 4.0, "elevation_deg": 2.5, "distance_rel": 0.04}
LIGHT_JITTER = {"azimuth_deg": 6.0, "elevation_deg": 4.0, "intensity_rel": 0.10}


@dataclass(frozen=True)
class SceneObject:
    shape: str
    size: str
    material: str
    color: str
    x: float
    y: float
    angle: float = 0.0

    @property
    def radius(self) -> float:
        return SIZES[self.size]

    def primitive(self) -> Primitive:
        return Primitive(
            shape=self.shape,
            x=self.x,
            y=self.y,
            radius=self.radius,
            angle=self.angle,
            color=COLORS[self.color],
            metal=self.material == "metal",
        )

    def attributes(self) -> dict[str, str]:
        return {"size": self.size, "color": self.color, "material": self.material, "shape": self.shape}

    def to_dict(self) -> dict:
        return {**self.attributes(), "x": round(self.x, 6), "y": round(self.y, 6), "angle": round(self.angle, 6)}


@dataclass(frozen=True)
class View:
    """Camera + lights of one image; ``orbit`` is (azimuth, elevation, distance) around the origin."""

    orbit: tuple[float, float, float]
    light_rig: tuple[tuple[float, float, float, bool], ...]

    @property
    def camera(self) -> Camera:
        az, el, dist = self.orbit
        return Camera.orbit(az, el, dist, fov_deg=DEFAULT_FOV_DEG)

    @property
    def lights(self) -> tuple[Light, ...]:
        return tuple(Light.from_angles(az, el, i, shadows=s) for az, el, i, s in self.light_rig)

    def to_dict(self) -> dict:
        return {
            "camera": {"azimuth_deg": self.orbit[0], "elevation_deg": self.orbit[1], "distance": self.orbit[2],
                       "fov_deg": DEFAULT_FOV_DEG},
            "lights": [{"azimuth_deg": a, "elevation_deg": e, "intensity": i, "shadows": s}
                       for a, e, i, s in self.light_rig],
        }


def default_view() -> View:
    return View(tuple(DEFAULT_CAMERA_ORBIT), tuple(DEFAULT_LIGHT_RIG))


def jitter_view(rng: np.random.Generator, base: View | None = None) -> View:
    """The base view with a small random camera and lighting perturbation."""
    base = base or default_view()
    az, el, dist = base.orbit
    cj = CAMERA_JITTER
    orbit = (
        az + float(rng.uniform(-cj["azimuth_deg"], cj["azimuth_deg"])),
        el + float(rng.uniform(-cj["elevation_deg"], cj["elevation_deg"])),
        dist * (1.0 + float(rng.uniform(-cj["distance_rel"], cj["distance_rel"]))),
    )
    lj = LIGHT_JITTER
    rig = []
    for laz, lel, li, ls in base.light_rig:
        rig.append((
            laz + float(rng.uniform(-lj["azimuth_deg"], lj["azimuth_deg"])),
            lel + float(rng.uniform(-lj["elevation_deg"], lj["elevation_deg"])),
            li * (1.0 + float(rng.uniform(-lj["intensity_rel"], lj["intensity_rel"]))),
            ls,
        ))
    return View(orbit, tuple(rig))


@dataclass(frozen=True)
class Change:
    """The semantic change. ``before_index``/``after_index`` locate the object in each scene's list."""

    type: str
    before_index: int | None
    after_index: int | None
    old: object = None
    new: object = None

    def to_dict(self) -> dict:
        return {"type": self.type, "before_index": self.before_index, "after_index": self.after_index,
                "old": self.old, "new": self.new}


@dataclass
class Example:
    index: int
    change_type: str
    before: list[SceneObject]
    after: list[SceneObject]
    view_before: View
    view_after: View
    view_distractor: View
    change: Change
    change_captions: list[str] = field(default_factory=list)
    no_change_captions: list[str] = field(default_factory=list)

    @property
    def distractor(self) -> list[SceneObject]:
        return self.before

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "change_type": self.change_type,
            "change": self.change.to_dict(),
            "before": [o.to_dict() for o in self.before],
            "after": [o.to_dict() for o in self.after],
            "views": {"default": self.view_before.to_dict(), "semantic": self.view_after.to_dict(),
                      "nonsemantic": self.view_distractor.to_dict()},
        }


# ----------------------------------------------------------------------------------------------------
# sampling
# ----------------------------------------------------------------------------------------------------


def change_type_for_index(index: int, n_indices: int) -> str:
    """Change types come in five equal index blocks, like the official data."""
    if not 0 <= index < n_indices:
        raise ValueError(f"index {index} outside 0..{n_indices - 1}")
    return CHANGE_TYPES[index * len(CHANGE_TYPES) // n_indices]


def check_size(width: int, height: int) -> tuple[int, int]:
    return CHECK_WIDTH, max(1, int(round(CHECK_WIDTH * height / width)))


def _pick(rng: np.random.Generator, options):
    return options[int(rng.integers(len(options)))]


def random_attributes(rng: np.random.Generator) -> dict:
    return {
        "shape": _pick(rng, SHAPES),
        "size": _pick(rng, tuple(SIZES)),
        "material": _pick(rng, MATERIALS),
        "color": _pick(rng, tuple(COLORS)),
        "angle": float(rng.uniform(0.0, 2.0 * math.pi)),
    }


def fits(x: float, y: float, radius: float, others, ignore: int | None = None) -> bool:
    """Whether a footprint at (x, y) keeps MIN_GAP from every other object's footprint."""
    for k, o in enumerate(others):
        if k == ignore:
            continue
        if math.hypot(x - o.x, y - o.y) < radius + o.radius + MIN_GAP:
            return False
    return True


def random_position(rng: np.random.Generator, radius: float, others, ignore: int | None = None,
                    away_from: tuple[float, float] | None = None, tries: int = 100):
    for _ in range(tries):
        x, y = (float(v) for v in rng.uniform(-ARENA, ARENA, size=2))
        if away_from is not None and math.hypot(x - away_from[0], y - away_from[1]) < MOVE_MIN_DISTANCE:
            continue
        if fits(x, y, radius, others, ignore):
            return x, y
    return None


def visible_counts(objects, view: View, size: tuple[int, int]) -> np.ndarray:
    ids = render_ids([o.primitive() for o in objects], view.camera, *size)
    return visible_pixels(ids, len(objects))


def all_visible(objects, view: View, size: tuple[int, int]) -> bool:
    if not objects:
        return True
    need = MIN_VISIBLE_FRACTION * size[0] * size[1]
    return bool(np.all(visible_counts(objects, view, size) >= need))


def sample_scene(rng: np.random.Generator, n_objects: int, view: View, size: tuple[int, int],
                 max_restarts: int = 200) -> list[SceneObject]:
    """``n_objects`` non-overlapping objects, each visible from ``view``."""
    for _ in range(max_restarts):
        objs: list[SceneObject] = []
        for _ in range(n_objects):
            a = random_attributes(rng)
            pos = random_position(rng, SIZES[a["size"]], objs)
            if pos is None:
                break
            objs.append(SceneObject(x=pos[0], y=pos[1], **a))
        if len(objs) == n_objects and all_visible(objs, view, size):
            return objs
    raise RuntimeError(f"could not sample a visible scene of {n_objects} objects")


def _nameable(objects, target: int, camera: Camera) -> bool:
    return bool(cap.referring_expressions(objects, target, camera))


def apply_change(rng: np.random.Generator, before: list[SceneObject], change_type: str, view_after: View,
                 size: tuple[int, int], naming_camera: Camera, tries: int = 30):
    """(after objects, Change), or None when no valid change was found in ``tries`` attempts."""
    n = len(before)
    for _ in range(tries):
        after = list(before)
        if change_type == "color":
            j = int(rng.integers(n))
            new = _pick(rng, tuple(c for c in COLORS if c != before[j].color))
            after[j] = replace(before[j], color=new)
            change = Change("color", j, j, before[j].color, new)
            target_scene, target = before, j
        elif change_type == "material":
            j = int(rng.integers(n))
            new = "metal" if before[j].material == "rubber" else "rubber"
            after[j] = replace(before[j], material=new)
            change = Change("material", j, j, before[j].material, new)
            target_scene, target = before, j
        elif change_type == "add":
            a = random_attributes(rng)
            pos = random_position(rng, SIZES[a["size"]], before)
            if pos is None:
                continue
            after.append(SceneObject(x=pos[0], y=pos[1], **a))
            change = Change("add", None, n, None, [round(pos[0], 6), round(pos[1], 6)])
            target_scene, target = after, n
        elif change_type == "drop":
            j = int(rng.integers(n))
            del after[j]
            change = Change("drop", j, None, [round(before[j].x, 6), round(before[j].y, 6)], None)
            target_scene, target = before, j
        elif change_type == "move":
            j = int(rng.integers(n))
            o = before[j]
            pos = random_position(rng, o.radius, before, ignore=j, away_from=(o.x, o.y))
            if pos is None:
                continue
            after[j] = replace(o, x=pos[0], y=pos[1])
            change = Change("move", j, j, [round(o.x, 6), round(o.y, 6)], [round(pos[0], 6), round(pos[1], 6)])
            target_scene, target = before, j
        else:
            raise ValueError(f"unknown change type {change_type!r}")
        if not all_visible(after, view_after, size):
            continue
        if not _nameable(target_scene, target, naming_camera):
            continue
        return after, change
    return None


def object_count_range(change_type: str) -> tuple[int, int]:
    """Inclusive range of the before scene's object count (both scenes stay within 3..10)."""
    if change_type == "add":
        return MIN_OBJECTS, MAX_OBJECTS - 1
    if change_type == "drop":
        return MIN_OBJECTS + 1, MAX_OBJECTS
    return MIN_OBJECTS, MAX_OBJECTS


def make_example(seed: int, index: int, n_indices: int, width: int = 480, height: int = 320,
                 n_captions: int = 6) -> Example:
    """The complete, deterministic content of one index (scenes, views, change, captions)."""
    rng = np.random.default_rng([int(seed), int(index)])
    ctype = change_type_for_index(index, n_indices)
    size = check_size(width, height)
    view_before = default_view()
    naming_camera = view_before.camera
    lo, hi = object_count_range(ctype)
    for _ in range(100):
        n = int(rng.integers(lo, hi + 1))
        before = sample_scene(rng, n, view_before, size)
        view_after = jitter_view(rng)
        view_distractor = jitter_view(rng)
        res = apply_change(rng, before, ctype, view_after, size, naming_camera)
        if res is not None:
            break
    else:
        raise RuntimeError(f"index {index}: no valid {ctype} change found")
    after, change = res
    if ctype == "add":
        scene, target = after, change.after_index
    else:
        scene, target = before, change.before_index
    new_value = change.new if ctype in ("color", "material") else None
    ex = Example(index, ctype, before, after, view_before, view_after, view_distractor, change)
    ex.change_captions = cap.change_captions(rng, ctype, scene, target, naming_camera, new_value, n=n_captions)
    ex.no_change_captions = cap.no_change_captions(rng, n=n_captions)
    return ex
