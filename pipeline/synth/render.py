"""A small vectorised-numpy ray caster for CLEVR-like scenes.

World: right-handed, ``z`` up, an infinite light-gray ground plane ``z = 0``. Objects stand on the plane:
spheres, cubes (rotated about the vertical axis) and vertical cylinders, each either matte rubber
(Lambert diffuse) or metal (dim Lambert + Blinn-Phong highlight + a reflected environment tint).
Lights are directional (key, fill, back, as in CLEVR) and cast hard shadows onto the plane and onto
other objects. The camera is a pin-hole looking at a target with a horizontal field of view.

``render`` returns an ``uint8`` RGB image and an object-id buffer (``-1`` ground, ``-2`` sky, ``k`` =
the k-th primitive) taken at the pixel centres; ``bbox_from_ids`` turns the buffer into pixel boxes.

Speed comes from screen-space culling: every object (and every object's shadow volume) is projected
to a pixel rectangle and only the rays inside it are intersected. All per-pixel work is numpy float32.
Pixels on silhouettes, cube edges and shadow boundaries are re-shaded with 4 rotated-grid sub-samples.

Determinism: per-pixel maths uses only +, -, *, / and sqrt (IEEE exact, so identical on every
machine); the specular power is repeated squaring and the display gamma is a lookup table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

F32 = np.float32
INF = np.float32(np.inf)
HIT_EPS = 1e-3  # minimum ray parameter counted as a hit
SHADOW_OFFSET = 2e-3  # shadow-ray origins are pushed this far along the normal

GROUND_ID = -1
SKY_ID = -2

SHAPES = ("cube", "sphere", "cylinder")


# ----------------------------------------------------------------------------------------------------
# scene description
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Camera:
    """Pin-hole camera at ``position`` looking at ``target``; ``fov_deg`` is the horizontal field of view."""

    position: tuple[float, float, float]
    target: tuple[float, float, float] = (0.0, 0.0, 0.0)
    fov_deg: float = 50.0

    @classmethod
    def orbit(
        cls,
        azimuth_deg: float,
        elevation_deg: float,
        distance: float,
        target: tuple[float, float, float] = (0.0, 0.0, 0.0),
        fov_deg: float = 50.0,
    ) -> "Camera":
        az, el = math.radians(azimuth_deg), math.radians(elevation_deg)
        pos = (
            target[0] + distance * math.cos(el) * math.cos(az),
            target[1] + distance * math.cos(el) * math.sin(az),
            target[2] + distance * math.sin(el),
        )
        return cls(position=pos, target=tuple(float(v) for v in target), fov_deg=float(fov_deg))

    def basis(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(position, forward, right, up) as float64 unit vectors."""
        # plain float64 arithmetic (no BLAS), so the basis is bit-identical on every machine
        px, py, pz = (float(v) for v in self.position)
        fx, fy, fz = (float(t) - p for t, p in zip(self.target, (px, py, pz)))
        n = math.sqrt(fx * fx + fy * fy + fz * fz)
        fx, fy, fz = fx / n, fy / n, fz / n
        rx, ry = fy, -fx  # forward x (0, 0, 1)
        n = math.sqrt(rx * rx + ry * ry)
        if n < 1e-9:
            raise ValueError("camera looks straight up or down; the view is undefined")
        rx, ry = rx / n, ry / n
        ux, uy, uz = ry * fz, -rx * fz, rx * fy - ry * fx  # right x forward (right has no z)
        return (np.array([px, py, pz]), np.array([fx, fy, fz]), np.array([rx, ry, 0.0]), np.array([ux, uy, uz]))

    def focal_px(self, width: int) -> float:
        return 0.5 * width / math.tan(math.radians(self.fov_deg) / 2.0)

    def to_dict(self) -> dict:
        return {"position": list(self.position), "target": list(self.target), "fov_deg": self.fov_deg}


@dataclass(frozen=True)
class Light:
    """A directional light. ``direction`` points from the scene towards the light."""

    direction: tuple[float, float, float]
    intensity: float
    shadows: bool = True

    @classmethod
    def from_angles(cls, azimuth_deg: float, elevation_deg: float, intensity: float, shadows: bool = True) -> "Light":
        az, el = math.radians(azimuth_deg), math.radians(elevation_deg)
        d = (math.cos(el) * math.cos(az), math.cos(el) * math.sin(az), math.sin(el))
        return cls(direction=d, intensity=float(intensity), shadows=shadows)

    def to_dict(self) -> dict:
        return {"direction": list(self.direction), "intensity": self.intensity, "shadows": self.shadows}


@dataclass(frozen=True)
class Primitive:
    """One object standing on the ground.

    ``radius`` is the CLEVR size (footprint radius): a sphere of that radius, a cylinder of that radius and
    height ``2 * radius``, or a cube of half-side ``radius / sqrt(2)`` (so its footprint diagonal is the
    same circle). ``angle`` rotates about the vertical axis (radians). ``color`` is sRGB 0-255.
    """

    shape: str
    x: float
    y: float
    radius: float
    angle: float = 0.0
    color: tuple[int, int, int] = (128, 128, 128)
    metal: bool = False

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}")

    @property
    def half_side(self) -> float:
        return self.radius / math.sqrt(2.0)

    @property
    def height(self) -> float:
        return 2.0 * self.half_side if self.shape == "cube" else 2.0 * self.radius

    @property
    def center(self) -> tuple[float, float, float]:
        return (self.x, self.y, 0.5 * self.height)

    @property
    def bounding_radius(self) -> float:
        if self.shape == "sphere":
            return self.radius
        if self.shape == "cube":
            return self.half_side * math.sqrt(3.0)
        return self.radius * math.sqrt(2.0)

    def aabb(self) -> tuple[np.ndarray, np.ndarray]:
        """World-space axis-aligned bounding box (lo, hi)."""
        if self.shape == "cube":
            h = self.half_side
            e = h * (abs(math.cos(self.angle)) + abs(math.sin(self.angle)))
        else:
            e = self.radius
        lo = np.array([self.x - e, self.y - e, 0.0])
        hi = np.array([self.x + e, self.y + e, self.height])
        return lo, hi


# default camera orbit: (azimuth deg, elevation deg, distance), horizontal field of view
DEFAULT_CAMERA_ORBIT = (-45.0, 30.0, 11.0)
DEFAULT_FOV_DEG = 50.0
# light rig: (azimuth deg, elevation deg, intensity, casts shadows)
#   key light (front right, high), fill light (front left, lower), back light (behind the objects, rim only)
DEFAULT_LIGHT_RIG = (
    (-15.0, 50.0, 0.95, True),
    (-115.0, 38.0, 0.30, True),
    (140.0, 55.0, 0.30, False),
)


def default_camera() -> Camera:
    """The default view: above and in front of the arena, as in CLEVR."""
    az, el, dist = DEFAULT_CAMERA_ORBIT
    return Camera.orbit(azimuth_deg=az, elevation_deg=el, distance=dist, fov_deg=DEFAULT_FOV_DEG)


def default_lights() -> tuple[Light, ...]:
    return tuple(Light.from_angles(az, el, i, shadows=s) for az, el, i, s in DEFAULT_LIGHT_RIG)


# ----------------------------------------------------------------------------------------------------
# material constants (linear light)
# ----------------------------------------------------------------------------------------------------

AMBIENT = 0.20
GROUND_SRGB = (178, 178, 178)
SKY_SRGB = (200, 200, 200)
METAL_DIFFUSE = 0.25
METAL_ENV = 0.85
METAL_SPEC = 1.6
SPEC_SQUARINGS = 6  # (n.h) ** 64


def srgb_to_linear(c: np.ndarray) -> np.ndarray:
    c = np.asarray(c, dtype=np.float64) / 255.0
    return np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)


_LUT_SIZE = 4096


def _make_gamma_lut() -> np.ndarray:
    x = np.arange(_LUT_SIZE, dtype=np.float64) / (_LUT_SIZE - 1)
    s = np.where(x <= 0.0031308, 12.92 * x, 1.055 * x ** (1.0 / 2.4) - 0.055)
    return np.clip(np.floor(s * 255.0 + 0.5), 0, 255).astype(np.uint8)


_GAMMA_LUT = _make_gamma_lut()


def linear_to_srgb8(c: np.ndarray) -> np.ndarray:
    idx = np.clip(c, 0.0, 1.0) * F32(_LUT_SIZE - 1) + F32(0.5)
    return _GAMMA_LUT[idx.astype(np.int32)]


# ----------------------------------------------------------------------------------------------------
# ray batches
# ----------------------------------------------------------------------------------------------------


class _Rays:
    """Camera rays, either a full (H, W) grid or a flat list with their pixel coordinates."""

    def __init__(self, dx, dy, dz, width: int, height: int, px=None, py=None):
        self.dx, self.dy, self.dz = dx, dy, dz
        self.width, self.height = width, height
        self.px, self.py = px, py
        self.grid = px is None
        self.shape = dx.shape

    def select(self, rect):
        """Index (usable for reading and assignment) of the rays inside a pixel rectangle, or None."""
        x0, x1, y0, y1 = rect
        if x0 >= x1 or y0 >= y1:
            return None
        if self.grid:
            return (slice(y0, y1), slice(x0, x1))
        k = np.flatnonzero((self.px >= x0) & (self.px < x1) & (self.py >= y0) & (self.py < y1))
        return (k,) if k.size else None


class _View:
    """Camera constants in float32 scalars plus the projection used for culling."""

    def __init__(self, camera: Camera, width: int, height: int):
        pos, fwd, right, up = camera.basis()
        self.pos64, self.fwd64, self.right64, self.up64 = pos, fwd, right, up
        self.o = tuple(F32(v) for v in pos)
        self.f = tuple(F32(v) for v in fwd)
        self.r = tuple(F32(v) for v in right)
        self.u = tuple(F32(v) for v in up)
        self.width, self.height = width, height
        self.focal = camera.focal_px(width)

    def directions(self, sx: np.ndarray, sy: np.ndarray):
        """Unit ray directions through continuous pixel positions (sx, sy) (float32 arrays, broadcastable)."""
        a = (sx - F32(0.5 * self.width)) / F32(self.focal)
        b = (F32(0.5 * self.height) - sy) / F32(self.focal)
        dx = self.f[0] + a * self.r[0] + b * self.u[0]
        dy = self.f[1] + a * self.r[1] + b * self.u[1]
        dz = self.f[2] + a * self.r[2] + b * self.u[2]
        inv = F32(1.0) / np.sqrt(dx * dx + dy * dy + dz * dz)
        return dx * inv, dy * inv, dz * inv

    def grid_rays(self) -> _Rays:
        sx = np.arange(self.width, dtype=F32) + F32(0.5)
        sy = np.arange(self.height, dtype=F32) + F32(0.5)
        dx, dy, dz = self.directions(sx[None, :], sy[:, None])
        return _Rays(dx, dy, dz, self.width, self.height)

    def project(self, pts: np.ndarray):
        """Continuous pixel coordinates and depth of world points (N, 3), float64."""
        v = pts - self.pos64
        depth = v @ self.fwd64
        with np.errstate(divide="ignore", invalid="ignore"):
            sx = 0.5 * self.width + self.focal * (v @ self.right64) / depth
            sy = 0.5 * self.height - self.focal * (v @ self.up64) / depth
        return sx, sy, depth

    def rect(self, pts: np.ndarray):
        """Pixel rectangle (x0, x1, y0, y1), end-exclusive, containing the projection of the points' hull."""
        sx, sy, depth = self.project(pts)
        if np.any(depth <= 1e-3):
            return (0, self.width, 0, self.height)
        x0 = max(0, int(math.floor(sx.min())) - 1)
        x1 = min(self.width, int(math.floor(sx.max())) + 2)
        y0 = max(0, int(math.floor(sy.min())) - 1)
        y1 = min(self.height, int(math.floor(sy.max())) + 2)
        return (x0, x1, y0, y1)


def _box_corners(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return np.array([[x, y, z] for x in (lo[0], hi[0]) for y in (lo[1], hi[1]) for z in (lo[2], hi[2])])


# ----------------------------------------------------------------------------------------------------
# intersections: o = (ox, oy, oz) and d = (dx, dy, dz), float32 arrays or scalars; return t (inf = miss)
# ----------------------------------------------------------------------------------------------------


def _hit_sphere(p: Primitive, o, d):
    cx, cy, cz = (F32(v) for v in p.center)
    px, py, pz = o[0] - cx, o[1] - cy, o[2] - cz
    b = px * d[0] + py * d[1] + pz * d[2]
    c = px * px + py * py + pz * pz - F32(p.radius * p.radius)
    disc = b * b - c
    t = -b - np.sqrt(np.maximum(disc, F32(0.0)))
    return np.where((disc >= 0) & (t > HIT_EPS), t, INF)


def _cube_local(p: Primitive, x, y):
    c, s = F32(math.cos(p.angle)), F32(math.sin(p.angle))
    return c * x + s * y, c * y - s * x


def _hit_cube(p: Primitive, o, d):
    h = F32(p.half_side)
    lx, ly = _cube_local(p, o[0] - F32(p.x), o[1] - F32(p.y))
    lz = o[2] - h
    ldx, ldy = _cube_local(p, d[0], d[1])
    ldz = d[2]
    with np.errstate(divide="ignore", invalid="ignore"):
        tn = tf = None
        for l, ld in ((lx, ldx), (ly, ldy), (lz, ldz)):
            inv = F32(1.0) / np.asarray(ld, dtype=F32)
            t1 = (-h - l) * inv
            t2 = (h - l) * inv
            lo, hi = np.minimum(t1, t2), np.maximum(t1, t2)
            tn = lo if tn is None else np.maximum(tn, lo)
            tf = hi if tf is None else np.minimum(tf, hi)
        ok = (tf >= tn) & (tn > HIT_EPS)
    return np.where(ok, tn, INF)


def _hit_cylinder(p: Primitive, o, d):
    r = F32(p.radius)
    top = F32(p.height)
    px, py = o[0] - F32(p.x), o[1] - F32(p.y)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = d[0] * d[0] + d[1] * d[1]
        b = px * d[0] + py * d[1]
        c = px * px + py * py - r * r
        disc = b * b - a * c
        ts = (-b - np.sqrt(np.maximum(disc, F32(0.0)))) / a
        zs = o[2] + ts * d[2]
        side = (disc >= 0) & (a > 1e-12) & (ts > HIT_EPS) & (zs >= 0) & (zs <= top)
        tc = (top - o[2]) / np.asarray(d[2], dtype=F32)
        qx, qy = px + tc * d[0], py + tc * d[1]
        cap = (tc > HIT_EPS) & (qx * qx + qy * qy <= r * r)
    return np.minimum(np.where(side, ts, INF), np.where(cap, tc, INF))


_HIT = {"sphere": _hit_sphere, "cube": _hit_cube, "cylinder": _hit_cylinder}


def _normals(p: Primitive, x, y, z):
    """Outward normals (and a face code) at surface points of a primitive."""
    if p.shape == "sphere":
        inv = F32(1.0 / p.radius)
        return (x - F32(p.x)) * inv, (y - F32(p.y)) * inv, (z - F32(p.radius)) * inv, np.zeros(x.shape, np.int16)
    if p.shape == "cylinder":
        is_top = z >= F32(p.height * (1.0 - 1e-3))
        inv = F32(1.0 / p.radius)
        nx = np.where(is_top, F32(0.0), (x - F32(p.x)) * inv)
        ny = np.where(is_top, F32(0.0), (y - F32(p.y)) * inv)
        nz = np.where(is_top, F32(1.0), F32(0.0))
        return nx, ny, nz, is_top.astype(np.int16)
    h = F32(p.half_side)
    lx, ly = _cube_local(p, x - F32(p.x), y - F32(p.y))
    lz = z - h
    ax, ay, az = np.abs(lx), np.abs(ly), np.abs(lz)
    mx = (ax >= ay) & (ax >= az)
    my = ~mx & (ay >= az)
    mz = ~mx & ~my
    lnx = np.where(mx, np.sign(lx), F32(0.0)).astype(F32)
    lny = np.where(my, np.sign(ly), F32(0.0)).astype(F32)
    nz = np.where(mz, np.sign(lz), F32(0.0)).astype(F32)
    c, s = F32(math.cos(p.angle)), F32(math.sin(p.angle))
    neg = np.where(mx, lx < 0, np.where(my, ly < 0, lz < 0))
    face = (1 + my.astype(np.int16) + 2 * mz.astype(np.int16) + 3 * neg.astype(np.int16)).astype(np.int16)
    return c * lnx - s * lny, s * lnx + c * lny, nz, face


# ----------------------------------------------------------------------------------------------------
# tracing and shading
# ----------------------------------------------------------------------------------------------------


def _trace(prims, view: _View, rays: _Rays, rects):
    """Nearest hit distance and id per ray."""
    with np.errstate(divide="ignore", invalid="ignore"):
        tp = -view.o[2] / rays.dz
    down = rays.dz < 0
    t = np.where(down, tp, INF).astype(F32)
    ids = np.where(down, np.int16(GROUND_ID), np.int16(SKY_ID)).astype(np.int16)
    for j, (p, rect) in enumerate(zip(prims, rects)):
        sel = rays.select(rect)
        if sel is None:
            continue
        tj = _HIT[p.shape](p, view.o, (rays.dx[sel], rays.dy[sel], rays.dz[sel]))
        cur = t[sel]
        closer = tj < cur
        if not closer.any():
            continue
        t[sel] = np.where(closer, tj, cur)
        ids[sel] = np.where(closer, np.int16(j), ids[sel])
    return t, ids


def _shadow_rects(prims, view: _View, light: Light):
    """Per primitive: the pixel rectangle that can contain points shadowed by it (None: cannot)."""
    lx, ly, lz = light.direction
    out = []
    for p in prims:
        lo, hi = p.aabb()
        if lz <= 0.05:
            out.append((0, view.width, 0, view.height))
            continue
        corners = _box_corners(lo, hi)
        s_max = hi[2] / lz + 0.05
        far = corners - s_max * np.array([lx, ly, lz])
        out.append(view.rect(np.concatenate([corners, far])))
    return out


def _shade(prims, view: _View, rays: _Rays, t, ids, lights, shadow_rects):
    """Linear RGB (3 arrays shaped like the rays), plus a region code for edge detection."""
    shape = rays.shape
    sky = ids == SKY_ID
    tt = np.where(sky, F32(0.0), t)
    X = view.o[0] + tt * rays.dx
    Y = view.o[1] + tt * rays.dy
    Z = view.o[2] + tt * rays.dz
    nx = np.zeros(shape, F32)
    ny = np.zeros(shape, F32)
    nz = np.ones(shape, F32)
    face = np.zeros(shape, np.int16)
    metal = np.zeros(shape, bool)
    n_obj = len(prims)
    ids_flat = ids.reshape(-1)
    if n_obj:
        for j, p in enumerate(prims):
            k = np.flatnonzero(ids_flat == j)
            if not k.size:
                continue
            a, b, c, fc = _normals(p, X.reshape(-1)[k], Y.reshape(-1)[k], Z.reshape(-1)[k])
            nx.reshape(-1)[k] = a
            ny.reshape(-1)[k] = b
            nz.reshape(-1)[k] = c
            face.reshape(-1)[k] = fc
            if p.metal:
                metal.reshape(-1)[k] = True

    # shadow-ray origins
    ox = X + F32(SHADOW_OFFSET) * nx
    oy = Y + F32(SHADOW_OFFSET) * ny
    oz = Z + F32(SHADOW_OFFSET) * nz
    # metal pixels get a highlight and an environment reflection: computed on that subset only
    km = np.flatnonzero(metal.reshape(-1))
    if km.size:
        mdx, mdy, mdz = rays.dx.reshape(-1)[km], rays.dy.reshape(-1)[km], rays.dz.reshape(-1)[km]
        mnx, mny, mnz = nx.reshape(-1)[km], ny.reshape(-1)[km], nz.reshape(-1)[km]
        mspec = np.zeros(km.size, F32)

    diffuse = np.full(shape, F32(AMBIENT)) * (F32(0.8) + F32(0.2) * nz)
    key_vis = None
    for li, light in enumerate(lights):
        L = tuple(F32(v) for v in light.direction)
        ndl = np.maximum(nx * L[0] + ny * L[1] + nz * L[2], F32(0.0))
        vis = np.ones(shape, bool)
        if light.shadows:
            for j, (p, rect) in enumerate(zip(prims, shadow_rects[li])):
                sel = rays.select(rect)
                if sel is None:
                    continue
                tj = _HIT[p.shape](p, (ox[sel], oy[sel], oz[sel]), L)
                blocked = (tj < INF) & (ids[sel] != j)
                if blocked.any():
                    vis[sel] &= ~blocked
        if li == 0:
            key_vis = vis
        lit = ndl * vis
        diffuse += lit * F32(light.intensity)
        if km.size:
            # Blinn-Phong: half vector between the light and the eye direction (-d)
            hx, hy, hz = L[0] - mdx, L[1] - mdy, L[2] - mdz
            inv = F32(1.0) / np.sqrt(hx * hx + hy * hy + hz * hz)
            nh = np.maximum((mnx * hx + mny * hy + mnz * hz) * inv, F32(0.0))
            for _ in range(SPEC_SQUARINGS):
                nh = nh * nh
            mspec += nh * (lit.reshape(-1)[km] > 0) * F32(light.intensity)

    factor = diffuse
    ground = ids == GROUND_ID
    r2 = X * X + Y * Y
    factor = np.where(ground, factor / (F32(1.0) + F32(0.006) * r2), factor)
    if km.size:
        # environment seen in the mirror direction: a bright diffuse "studio" above, the floor below
        dn = mdx * mnx + mdy * mny + mdz * mnz
        rz = mdz - F32(2.0) * dn * mnz
        env = np.where(rz > 0, F32(0.30) + F32(0.45) * rz, F32(0.18) + F32(0.10) * rz)
        fres = F32(1.0) - np.abs(dn)
        fres = fres * fres
        env = env * (F32(1.0) + F32(0.6) * fres * fres)
        ff = factor.reshape(-1)
        ff[km] = F32(METAL_DIFFUSE) * ff[km] + F32(METAL_ENV) * env
        mspec *= F32(METAL_SPEC)

    palette = np.empty((n_obj + 2, 3), F32)
    palette[0] = srgb_to_linear(SKY_SRGB)
    palette[1] = srgb_to_linear(GROUND_SRGB)
    for j, p in enumerate(prims):
        palette[j + 2] = srgb_to_linear(p.color)
    pal_idx = ids.astype(np.intp) + 2
    rgb = []
    for ch in range(3):
        a = palette[:, ch][pal_idx]
        c = a * factor
        if km.size:
            cf = c.reshape(-1)
            cf[km] += mspec * (F32(0.35) + F32(0.65) * a.reshape(-1)[km])
        c = np.where(sky, a, c)
        rgb.append(c)
    if key_vis is None:  # no lights at all
        key_vis = np.ones(shape, bool)
    region = (ids.astype(np.int32) + 2) * 32 + face.astype(np.int32) * 2 + key_vis.astype(np.int32)
    return rgb, region


# rotated-grid sub-sample offsets inside a pixel
_SUBSAMPLES = ((0.375, 0.125), (0.875, 0.375), (0.625, 0.875), (0.125, 0.625))


def _object_rects(prims, view: _View):
    return [view.rect(_box_corners(*p.aabb())) for p in prims]


def render(
    prims: list[Primitive] | tuple[Primitive, ...],
    camera: Camera,
    lights: tuple[Light, ...] | list[Light],
    width: int = 480,
    height: int = 320,
    antialias: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Render the scene. Returns (rgb uint8 [H, W, 3], ids int16 [H, W])."""
    prims = list(prims)
    view = _View(camera, width, height)
    rects = _object_rects(prims, view)
    srects = [_shadow_rects(prims, view, l) if l.shadows else None for l in lights]
    rays = view.grid_rays()
    t, ids = _trace(prims, view, rays, rects)
    rgb, region = _shade(prims, view, rays, t, ids, lights, srects)
    if antialias and width > 1 and height > 1:
        edge = np.zeros((height, width), bool)
        dh = region[:, 1:] != region[:, :-1]
        edge[:, 1:] |= dh
        edge[:, :-1] |= dh
        dv = region[1:, :] != region[:-1, :]
        edge[1:, :] |= dv
        edge[:-1, :] |= dv
        ei, ej = np.nonzero(edge)
        if ei.size:
            n = ei.size
            sx = np.concatenate([ej.astype(F32) + F32(ox) for ox, _ in _SUBSAMPLES])
            sy = np.concatenate([ei.astype(F32) + F32(oy) for _, oy in _SUBSAMPLES])
            px = np.tile(ej, len(_SUBSAMPLES))
            py = np.tile(ei, len(_SUBSAMPLES))
            dx, dy, dz = view.directions(sx, sy)
            sub = _Rays(dx, dy, dz, width, height, px=px, py=py)
            st, sids = _trace(prims, view, sub, rects)
            srgb, _ = _shade(prims, view, sub, st, sids, lights, srects)
            for ch in range(3):
                s4 = srgb[ch].reshape(len(_SUBSAMPLES), n)
                rgb[ch][ei, ej] = ((s4[0] + s4[1]) + (s4[2] + s4[3])) * F32(0.25)
    out = np.stack([linear_to_srgb8(c) for c in rgb], axis=-1)
    return out, ids


def render_ids(prims, camera: Camera, width: int, height: int) -> np.ndarray:
    """Only the object-id buffer (no shading): fast visibility checks."""
    prims = list(prims)
    view = _View(camera, width, height)
    _, ids = _trace(prims, view, view.grid_rays(), _object_rects(prims, view))
    return ids


def visible_pixels(ids: np.ndarray, n_objects: int) -> np.ndarray:
    """Number of pixels showing each object."""
    v = ids[ids >= 0].astype(np.intp)
    return np.bincount(v, minlength=n_objects)[:n_objects]


def bbox_from_ids(ids: np.ndarray, obj: int) -> list[int] | None:
    """Pixel box ``[x, y, w, h]`` of the pixels showing object ``obj``; None when it is not visible."""
    m = ids == obj
    if not m.any():
        return None
    rows = np.flatnonzero(m.any(axis=1))
    cols = np.flatnonzero(m.any(axis=0))
    x0, x1, y0, y1 = int(cols[0]), int(cols[-1]), int(rows[0]), int(rows[-1])
    return [x0, y0, x1 - x0 + 1, y1 - y0 + 1]


def project_points(camera: Camera, pts, width: int, height: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Continuous pixel coordinates (x right, y down) and camera depth of world points (N, 3)."""
    return _View(camera, width, height).project(np.atleast_2d(np.asarray(pts, dtype=np.float64)))
