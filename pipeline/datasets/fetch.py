"""Stage ``fetch``: obtain an official dataset release, or verify a copy placed by hand.

A release is a list of parts (``PARTS``): plain files (annotation files from the authors' GitHub repository,
sha256-checked where the reference gives a digest) and archives (Google Drive), each archive extracted
atomically to its folder. For each part in turn: already in place (the file, or the archive's extracted
folder) → used as it is (a file placed by hand is checked by the parser, an archive placed by hand is
extracted as it is); else downloaded (resumable: ``<name>.part``; a download that does not start as the file
must, e.g. Drive's HTML refusal page, is kept as ``<name>.html`` for a look). When any part cannot be had
(offline, dead link, ``--no-download``), ONE message names every missing part, where to get it and where to
place it, and nothing is extracted. Then the archives are extracted, the tree is parsed as ``official`` (the
release's checksums, every image and caption) and counted against the release. Writes ``<root>/verified.json``
last.

- CLEVR-Change (reference/datasets.md §1): ``clevr_change.tar.gz`` (Drive), holding ``data/``.
- Spot-the-Diff (§3): ``data/annotations/{train,val,test}.json`` from ``harsh19/spot-the-diff`` and
  ``resized_images.zip`` (Drive; its images at its root or under ``resized_images/``) → ``data/resized_images/``.
- CLEVR-DC (§2): ``data/split.json`` (sha256-checked) and ``data/captions.json`` (no digest published) from
  ``hsgkim/clevr-dc`` at its release commit; ``bef.tar.gz`` → ``data/bef/`` and ``aft.tar.gz`` → ``data/aft/``
  (Drive). What the two archives hold is not documented: their images at the root, or under one top-level
  folder the parser reads (``bef/`` or ``images/``; ``aft/`` or ``sc_images/``); anything else is an error
  naming the archive. A tree with ``images/`` and ``sc_images/`` (DIRL's renaming) placed by hand is used as it
  is.
- Image Editing Request (§4): ``data/{train,valid,test}.json`` (sha256-checked) from ``airsplay/VisualRelationships``
  at ``9bee562`` (``dataset/adobe/``) and the image files → ``data/images/``. The images are a Google Drive *folder*
  mirrored as the archive.org item ``image-editing-dataset``; neither names an archive (datasets.md: names and
  sizes unknown), so the fetcher asks archive.org for the item as one zip (``/compress/<item>``, archive.org's
  "download all" link; what it holds is not documented: the image files at its root or under ``images/``, anything
  else is an error naming the archive). Where that cannot be had, the message says to place the image files
  from either location under ``data/images/`` (or a zip / tar of them as ``images.zip``).
- Birds-to-Words (§5): ``data/birds-to-words-v1.0.tsv`` from ``google-research-datasets/birds-to-words`` (no
  digest published: its sha256 is recorded), then every photo its rows name (``COLLECTORS``), one by one, to
  ``data/images/<local name>`` (``birds_to_words.local_name``): resumable (``.part``), the URL as given then
  iNaturalist's open-data bucket (``photo_urls``); an answer that is not an image is kept aside (``.html``). The
  photos that cannot be had are listed in ``data/missing_photos.json`` (the parser leaves their pairs out) and
  counted per split in ``verified.json`` (``pairs_lost``): URL rot is expected, it does not stop the fetch.
- CUB (§6): ``CUB_200_2011.tgz`` (CaltechDATA, md5-checked) → ``data/CUB_200_2011/`` and Reed et al.'s
  ``cvpr2016_cub.tar.gz`` (Drive) → ``data/cvpr2016_cub/``; the parse asserts the L2C 8,855 / 2,933 split.
- NABirds (§7): gated (registration and terms at dl.allaboutbirds.org): never downloaded; the message says to
  place ``nabirds.tar.gz`` (md5-checked before extraction) at ``<root>/nabirds.tar.gz`` or its ``nabirds/``
  folder's content at ``<root>/data/``.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import shutil
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.utils.download import sha256_file, try_download
from pipeline.utils.io import atomic_path, read_json, write_json

GZIP, ZIP, JSON_OBJECT = b"\x1f\x8b", b"PK", b"{"
IMAGE = (b"\xff\xd8", b"\x89PNG", b"GIF8")  # a photo must start with one of these (JPEG, PNG, GIF)
CLEVR_DC_COMMIT = "47be3211fd21a09d1062f8a3a8833d213f026c79"  # hsgkim/clevr-dc: its single commit (datasets.md §2)
IER_COMMIT = "9bee562ddb09e0872fd949bc1e7b1b3eaeb8e504"  # airsplay/VisualRelationships (datasets.md §4)
IER_DRIVE = "https://drive.google.com/drive/folders/1p_hkPwRUiLl1RHV3DkzQk3ti-GzHzT7O"
IER_ARCHIVE_ORG = "https://archive.org/details/image-editing-dataset"


def _drive(file_id: str) -> dict:
    return {"page": f"https://drive.google.com/file/d/{file_id}/view",
            "url": f"https://drive.usercontent.google.com/download?id={file_id}&export=download&confirm=t"}


# Where each release's files come from (no archive has a published checksum). ``files`` is the URL of a
# repository file, ``{name}`` its name.
RELEASES = {
    "clevr_change": {"archives": {"clevr_change.tar.gz": _drive("1HJ3gWjaUJykEckyb2M0MB4HnrJSihjVe")}},
    "spot_the_diff": {
        "archives": {"resized_images.zip": _drive("1OVb4_3Uec_xbyUk90aWC6LFpKsIOtR7v")},
        "files": "https://github.com/harsh19/spot-the-diff/raw/master/data/annotations/{name}",
    },
    "clevr_dc": {
        "archives": {"bef.tar.gz": _drive("1FeK--ilqYItdx6Fw6pLSWWNujylOovIT"),
                     "aft.tar.gz": _drive("1csIsr8IcwrOYAe-JAWQrcb3iu5RtaTK7")},
        "files": f"https://github.com/hsgkim/clevr-dc/raw/{CLEVR_DC_COMMIT}/{{name}}",
    },
    "image_editing_request": {
        "archives": {"images.zip": {"page": f"{IER_ARCHIVE_ORG} or the Drive folder {IER_DRIVE} (every image file)",
                                    "url": "https://archive.org/compress/image-editing-dataset"}},
        "files": f"https://github.com/airsplay/VisualRelationships/raw/{IER_COMMIT}/dataset/adobe/{{name}}",
    },    "birds_to_words": {"files": "https://github.com/google-research-datasets/birds-to-words/raw/master/{name}"},
    "cub": {
        "archives": {"CUB_200_2011.tgz": {
            "page": "https://data.caltech.edu/records/65de6-vp158",
            "url": "https://data.caltech.edu/records/65de6-vp158/files/CUB_200_2011.tgz?download=1"},
            "cvpr2016_cub.tar.gz": _drive("0B0ywwgffWnLLZW9uVHNjb2JmNlE")},
    },
    # gated: no URL the fetcher may use (``url`` None); the message says where to get it and where it goes
    "nabirds": {"archives": {"nabirds.tar.gz": {
        "page": "https://dl.allaboutbirds.org/nabirds (fill in the registration / terms-of-use form)", "url": None}}},
}
CUB_MD5 = "97eceeb196236b17998738112f37df78"      # CUB_200_2011.tgz (datasets.md §6.1)
NABIRDS_MD5 = "df21a9e4db349a14e2b08adfd45873bd"  # nabirds.tar.gz (datasets.md §7)
INAT_OPEN_DATA = "https://inaturalist-open-data.s3.amazonaws.com/photos/{id}/medium.{ext}"


@dataclass(frozen=True)
class Part:
    """One file of a release: where a person gets it (``page``), where the fetcher does (``url``), where it goes
    (``dest``). An archive also names the folder it is extracted to and how (``_extract``)."""

    name: str
    page: str
    url: str
    dest: Path
    sha256: str | None = None      # a download's digest must start with it
    md5: str | None = None         # an archive's md5 (the release's published digest), checked before extraction
    magic: bytes | tuple[bytes, ...] | None = None  # a download must start with (one of) these bytes
    folder: Path | None = None     # an archive: extracted to this folder
    names: tuple[str, ...] = ()    # an archive: its top-level folders that are the content (default: folder's name)
    flat: bool = False             # an archive: may hold its files at its root instead
    ready: tuple[Path, ...] = ()   # an archive: any of these existing means it is extracted (or placed so by hand)
    hint: str = ""                 # an archive: what extracting it by hand must give

    @property
    def done(self) -> bool:
        """Nothing left to do: the file is in place, or the archive's content is."""
        return self.dest.is_file() if self.folder is None else any(p.exists() for p in self.ready)


def _archive_part(dataset: str, name: str, root: Path, folder: Path, **kw) -> Part:
    src = RELEASES[dataset]["archives"][name]
    return Part(name, src["page"], src["url"], root / name, folder=folder, **kw)


def _file_part(dataset: str, name: str, dest: Path, **kw) -> Part:
    url = RELEASES[dataset]["files"].format(name=name)
    return Part(name, url, url, dest, **kw)


def parts_clevr_change(root: Path) -> list[Part]:
    data = root / "data"
    return [_archive_part("clevr_change", "clevr_change.tar.gz", root, data, magic=GZIP,
                          ready=(data / "splits.json",), hint=f"{data / 'splits.json'} exists")]


def _split_files_and_image_zip(dataset: str, root: Path, module, json_path, archive: str, hint: str) -> list[Part]:
    """A release of one JSON file per split (``module.SPLITS``, sha256 ``module.OFFICIAL_SHA256``, placed at
    ``json_path(data, split)``) and one zip of its images, extracted to ``data/<module.IMAGES>``."""
    data = root / "data"
    images = data / module.IMAGES
    return [*(_file_part(dataset, f"{s}.json", json_path(data, s), sha256=module.OFFICIAL_SHA256[s])
              for s in module.SPLITS),
            _archive_part(dataset, archive, root, images, magic=ZIP, flat=True, ready=(images,),
                          hint=f"{images}/{hint} exist")]


def parts_spot_the_diff(root: Path) -> list[Part]:
    from pipeline.datasets import spot_the_diff as sd

    return _split_files_and_image_zip("spot_the_diff", root, sd, sd.annotation_path, "resized_images.zip",
                                      "<img_id>.png and <img_id>_2.png")


def parts_clevr_dc(root: Path) -> list[Part]:
    from pipeline.datasets import clevr_dc as dc

    data = root / "data"
    parts = [_file_part("clevr_dc", "split.json", data / "split.json", sha256=dc.OFFICIAL_SPLIT_SHA256,
                        magic=JSON_OBJECT),
             _file_part("clevr_dc", "captions.json", data / "captions.json", magic=JSON_OBJECT)]
    for name, dirs in (("bef.tar.gz", dc.BEFORE_DIRS), ("aft.tar.gz", dc.AFTER_DIRS)):
        folder = data / name.split(".")[0]  # the release's folder name (hsgkim/clevr-dc's bef/README.md, aft/)
        others = tuple(d for d in dirs if d != folder.name)
        parts.append(_archive_part(
            "clevr_dc", name, root, folder, magic=GZIP, names=(folder.name, *others), flat=True,
            ready=tuple(data / d for d in dirs),
            hint=f"{folder}/<n>.png exist, or {' or '.join(f'{data / d}/<n>.png' for d in others)}"))
    return parts


def parts_image_editing_request(root: Path) -> list[Part]:
    from pipeline.datasets import image_editing_request as ier

    return _split_files_and_image_zip("image_editing_request", root, ier, ier.json_path, "images.zip",
                                      "<img0 and img1 file names, e.g. Reddit.com_5fdtr1_5fdtr1.jpg>")


def parts_birds_to_words(root: Path) -> list[Part]:
    from pipeline.datasets import birds_to_words as b2w

    return [_file_part("birds_to_words", b2w.TSV, root / "data" / b2w.TSV, magic=b"img1")]


def parts_cub(root: Path) -> list[Part]:
    from pipeline.datasets import cub

    data = root / "data"
    return [_archive_part("cub", "CUB_200_2011.tgz", root, data / cub.CUB, md5=CUB_MD5, magic=GZIP,
                          ready=(data / cub.CUB,), hint=f"{data / cub.CUB}/images.txt exists"),
            _archive_part("cub", "cvpr2016_cub.tar.gz", root, data / cub.REED, magic=GZIP, names=(cub.REED, "cub"),
                          flat=True, ready=(data / cub.REED,),
                          hint=f"{data / cub.REED}/{cub.TEXT}/ and {data / cub.REED}/trainvalclasses.txt exist")]


def parts_nabirds(root: Path) -> list[Part]:
    data = root / "data"
    return [_archive_part("nabirds", "nabirds.tar.gz", root, data, md5=NABIRDS_MD5, magic=GZIP, names=("nabirds",),
                          ready=(data / "images.txt",), hint=f"the archive's nabirds/ folder is {data}/ "
                                                              f"({data}/images.txt exists)")]


PARTS = {"clevr_change": parts_clevr_change, "spot_the_diff": parts_spot_the_diff, "clevr_dc": parts_clevr_dc,
         "image_editing_request": parts_image_editing_request, "birds_to_words": parts_birds_to_words,
         "cub": parts_cub, "nabirds": parts_nabirds}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", required=True, choices=sorted(RELEASES))
    p.add_argument("--root", required=True, help="e.g. resources/raw/clevr_change/official")
    p.add_argument("--no-download", action="store_true", help="only use files already in place")


def _placement_message(dataset: str, parts: list[Part], missing: dict[str, str]) -> str:
    lines = [f"cannot obtain the official {dataset} release. Place by hand what is missing, then run again:"]
    for part in parts:
        if part.name in missing:
            hint = f" (or extract it so that {part.hint})" if part.hint else ""
            lines.append(f"- {part.name}: download it from {part.page} and place it at {part.dest}{hint} "
                         f"[{missing[part.name]}]")
    there = [part.name for part in parts if part.name not in missing]
    if there:
        lines.append(f"Already in place: {', '.join(there)}.")
    return "\n".join(lines)


def _download(part: Part) -> str | None:
    """Download ``part`` to its place (resumable); why it could not be, or None. A wrong checksum raises."""
    if part.url is None:
        return "gated: no public download link"
    got = try_download(part.url, part.dest, sha256_prefix=part.sha256, progress=part.folder is not None)
    if got is None:
        return "download failed"
    if part.magic is not None:
        with open(got, "rb") as f:  # an archive may be gigabytes: read its first bytes only
            head = f.read(8)
        if not head.startswith(part.magic):
            kept = got.rename(got.with_name(got.name + ".html"))
            return f"the server answered something else (a refusal page?), kept as {kept}"
    if part.md5 is not None:
        _check_md5(part, delete=True)
    return None


def _check_md5(part: Part, delete: bool = False) -> None:
    """The archive's md5 must be the release's: else one PipelineError naming the file (a download is deleted,
    to be fetched again; a file placed by hand is left for a look)."""
    h = hashlib.md5()
    with open(part.dest, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != part.md5:
        if delete:
            part.dest.unlink()
        raise PipelineError(f"{part.dest}: md5 {h.hexdigest()} is not the release's {part.md5}"
                            f"{' (download deleted; try again)' if delete else ''}; get {part.name} again from "
                            f"{part.page}")


def obtain(dataset: str, root: Path, no_download: bool) -> list[Part]:
    """Bring every part of the release into place, then extract its archives; the one placement message when
    any part cannot be had (nothing extracted then)."""
    parts = PARTS[dataset](root)
    missing = {}
    for part in parts:
        if part.done or part.dest.is_file():
            continue
        why = "download disabled" if no_download else _download(part)
        if why is not None:
            missing[part.name] = why
    if missing:
        raise PipelineError(_placement_message(dataset, parts, missing))
    for part in parts:
        if part.folder is not None and not part.done:
            if part.md5 is not None:
                _check_md5(part)
            _extract(part.dest, part.folder, part.names, part.flat)
    return parts


def _extract(archive: Path, target: Path, names: tuple[str, ...] = (), flat: bool = False) -> None:
    """Extract ``archive`` (tar or zip) to the folder ``target``, atomically: a failed extraction leaves no
    ``target``. The content is the archive's top-level folder named one of ``names`` (default ``target.name``:
    CLEVR-Change's ``data/``); when ``flat``, an archive without such a folder holds its files at its root
    (``resized_images.zip``), unless all it holds is one other folder (an error: not the expected archive)."""
    names = names or (target.name,)
    wanted = " or ".join(f"{n}/" for n in names)
    # The staging folder is named after atomic_path's temporary (".data.<8>.tmp.x"), so one that a killed
    # extraction left is removed by the next try's atomic_path; one that a failed extraction leaves, here.
    staging = None
    try:
        is_zip = zipfile.is_zipfile(archive)
        with (zipfile.ZipFile(archive) if is_zip else tarfile.open(archive)) as arc, atomic_path(target) as tmp:
            staging = tmp.with_name(tmp.name + ".x")
            staging.mkdir()
            if is_zip:
                arc.extractall(staging)  # zipfile drops absolute paths and ".." itself
            else:
                arc.extractall(staging, filter="data")
            content = next((staging / n for n in names if (staging / n).is_dir()), None)
            if content is None:
                top = sorted(p.name for p in staging.iterdir())
                if not flat:
                    raise PipelineError(f"{archive}: archive has no top-level {wanted} folder")
                if len(top) == 1 and (staging / top[0]).is_dir():
                    raise PipelineError(f"{archive}: holds only the folder {top[0]}/, expected {wanted} or the files "
                                        f"at its root; extract it by hand so that {target}/ holds its files")
                content = staging
            content.rename(tmp)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as e:
        raise PipelineError(f"{archive}: cannot extract ({e}); delete it and download again") from None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def _split_sizes(sizes: dict[str, int], official: dict[str, int]) -> dict:
    report: dict = {"split_sizes": sizes}
    if sizes != official:
        report["warning"] = f"split sizes {sizes} differ from the official {official}"
    return report


def verify_clevr_change(data: Path) -> dict:
    from pipeline.datasets import clevr_change as cc

    report = {}
    for name, digest in cc.OFFICIAL_SHA256.items():
        got = hashlib.sha256((data / name).read_bytes()).hexdigest()
        report[name] = {"sha256": got, "matches_official": got == digest}
    report.update(_split_sizes({k: len(v) for k, v in read_json(data / "splits.json").items()},
                               cc.OFFICIAL_SPLIT_SIZES))
    records = cc.parse(data, source="official")  # raises on a missing image or caption
    report["pairs"] = len(records)
    return report


def verify_spot_the_diff(data: Path) -> dict:
    from pipeline.datasets import spot_the_diff as sd

    records = sd.parse(data, source="official")  # raises on a checksum, a missing file or image
    counts = sd.source_counts(data, "official")
    report = {"annotations_sha256": dict(sd.OFFICIAL_SHA256), "counts": counts, "pairs": len(records)}
    if {s: {k: c[k] for k in sd.OFFICIAL_COUNTS[s]} for s, c in counts.items()} != sd.OFFICIAL_COUNTS:
        report["warning"] = f"counts differ from the release's {sd.OFFICIAL_COUNTS}"
    return report


def verify_clevr_dc(data: Path) -> dict:
    """Parse as ``official`` (split.json's sha256, every image, a caption list with words for every index) and
    count: pairs per split against the release's, pairs per block type, and the pairs whose captions state
    another change type than their 8,000-block (``inspect``'s warnings; the block wins)."""
    from pipeline.datasets import clevr_dc as dc
    from pipeline.datasets.inspect_tree import SHOWN_WARNINGS

    records = dc.parse(data, source="official")
    disagreements = [w for w in map(dc.type_disagreement, records) if w is not None]
    return {"split.json": {"sha256": dc.OFFICIAL_SPLIT_SHA256, "matches_official": True},
            "captions.json": {"sha256": sha256_file(data / "captions.json")},  # none published: recorded
            "pairs": len(records),
            **_split_sizes({s: sum(r["split"] == s for r in records) for s in dc.OFFICIAL_SPLIT_SIZES},
                           dc.OFFICIAL_SPLIT_SIZES),
            "types": dict(sorted(collections.Counter(r["change_type"] for r in records).items())),
            "type_disagreements": len(disagreements), "type_disagreement_examples": disagreements[:SHOWN_WARNINGS]}


def verify_image_editing_request(data: Path) -> dict:
    """Parse as ``official`` (the JSON files' sha256, every image) and count against the release: pairs, requests
    and distinct images per split, and the pairs repeated across splits (kept, reported)."""
    from pipeline.datasets import image_editing_request as ier

    warnings: list[str] = []
    records = ier.parse(data, source="official", warnings=warnings)
    counts = ier.source_counts(data, "official")
    report = {"json_sha256": dict(ier.OFFICIAL_SHA256), "counts": counts, "pairs": len(records),
              "parser_warnings": warnings}
    got = {s: {k: counts[ier.SPLITS[s]][k] for k in c} for s, c in ier.OFFICIAL_COUNTS.items()}
    shared = {(a, b): counts[ier.SPLITS[b]][f"pairs_also_in_{ier.SPLITS[a]}"] for a, b in ier.OFFICIAL_SHARED_PAIRS}
    report["shared_pairs"] = {f"{a}/{b}": n for (a, b), n in shared.items()}
    if got != ier.OFFICIAL_COUNTS or shared != ier.OFFICIAL_SHARED_PAIRS:
        report["warning"] = (f"counts differ from the release's {ier.OFFICIAL_COUNTS} and "
                             f"{ier.OFFICIAL_SHARED_PAIRS} distinct pairs shared")
    return report


def photo_urls(url: str) -> list[str]:
    """Where a Birds-to-Words photo may be had: its URL as the TSV gives it, then (an iNaturalist photo) the
    open-data bucket where iNaturalist moved its CC photos, under the URL's extension and the usual others."""
    from pipeline.datasets import birds_to_words as b2w

    out = [url]
    name = b2w.local_name(url)
    if not name.startswith("url-"):
        pid, ext = name.split(".", 1)
        out += [INAT_OPEN_DATA.format(id=pid, ext=e) for e in dict.fromkeys((ext, "jpg", "jpeg", "png", "JPG"))]
    return out


def fetch_photos(data: Path, no_download: bool, progress: bool = True) -> dict:
    """Every photo the Birds-to-Words TSV names, into ``data/images/`` (see the module docstring); writes
    ``data/missing_photos.json`` ({url: local name} of those that could not be had) and returns the counts."""
    from tqdm import tqdm

    from pipeline.datasets import birds_to_words as b2w

    rows = b2w.read_rows(data)
    urls = list(dict.fromkeys(r[k] for r in rows for k in ("img1ImgURL", "img2ImgURL")))
    missing: dict[str, str] = {}
    for url in tqdm(urls, desc="birds_to_words photos", unit="photo", disable=not progress):
        dest = data / b2w.IMAGES / b2w.local_name(url)
        if dest.is_file():
            continue
        why = "download disabled"
        if not no_download:
            for candidate in photo_urls(url):
                why = _download(Part(dest.name, url, candidate, dest, magic=IMAGE))
                if why is None:
                    break
        if why is not None:
            missing[url] = dest.name
    write_json(data / b2w.MISSING, dict(sorted(missing.items())))
    return {"photos": len(urls), "missing_photos": len(missing)}


def verify_birds_to_words(data: Path) -> dict:
    """Parse as ``official`` (the pairs whose photos ``missing_photos.json`` lists are left out) and count: the
    TSV's rows, pairs and photos per split against the pairs kept (``pairs_lost``); the TSV's sha256 recorded."""
    from pipeline.datasets import birds_to_words as b2w

    warnings: list[str] = []
    records = b2w.parse(data, source="official", warnings=warnings)
    if not records:
        raise PipelineError(f"{data}: no Birds-to-Words pair has both its photos ({len(b2w.read_missing(data))} "
                            f"photos could not be had, listed in {data / b2w.MISSING}); place them under "
                            f"{data / b2w.IMAGES}/ by their local names (pipeline.datasets.birds_to_words.local_name)")
    counts = b2w.source_counts(data, "official")
    kept = collections.Counter(r["split"] for r in records)
    for split, c in counts.items():
        c["pairs_kept"] = kept.get(split, 0)
        c["pairs_lost"] = c["distinct_pairs"] - c["pairs_kept"]
    report = {"tsv_sha256": sha256_file(data / b2w.TSV), "counts": counts, "pairs": len(records),
              "missing_photos": len(b2w.read_missing(data)), "parser_warnings": warnings}
    lost = sum(c["pairs_lost"] for c in counts.values())
    if lost:
        report["warning"] = f"{lost} pair(s) lost to photos that could not be had (listed in {data / b2w.MISSING})"
    return report


def verify_cub(data: Path) -> dict:
    """Parse as ``official``: every image and caption file, the L2C split's 8,855 / 2,933 images in 150 / 50
    classes, the official 5,994 / 5,794 (the parser raises otherwise); captions per image counted."""
    from pipeline.datasets import cub

    warnings: list[str] = []
    records = cub.parse(data, source="official", warnings=warnings)
    return {"CUB_200_2011.tgz": {"md5": CUB_MD5, "matches_official": True}, "images": len(records),
            "split_sizes": dict(collections.Counter(r["split"] for r in records)),
            "captions": sum(len(r["captions"]) for r in records), "parser_warnings": warnings}


def verify_nabirds(data: Path) -> dict:
    """Parse as ``official`` (48,562 images, 555 leaf labels, or the parser raises); the split sizes compared
    with the reported, unverified 23,929 / 24,633 (a difference is a warning)."""
    from pipeline.datasets import nabirds

    records = nabirds.parse(data, source="official")
    return {"nabirds.tar.gz": {"md5": NABIRDS_MD5, "matches_official": True}, "images": len(records),
            "labels": len({r["labels"]["label"] for r in records}),
            **_split_sizes(dict(collections.Counter(r["split"] for r in records)), {"train": 23929, "test": 24633})}


# dataset -> the check of its extracted tree (parse as official, count against the release)
VERIFIERS = {"clevr_change": verify_clevr_change, "spot_the_diff": verify_spot_the_diff, "clevr_dc": verify_clevr_dc,
             "image_editing_request": verify_image_editing_request, "birds_to_words": verify_birds_to_words,
             "cub": verify_cub, "nabirds": verify_nabirds}
# dataset -> what it fetches after its parts are in place, before verifying (files its parts name)
COLLECTORS = {"birds_to_words": fetch_photos}


def fetch(dataset: str, root: Path, no_download: bool) -> dict:
    """Obtain ``dataset``'s release at ``root`` (``obtain``), then what its parts name (``COLLECTORS``), then
    verify its ``data/`` tree."""
    obtain(dataset, root, no_download)
    collected = COLLECTORS[dataset](root / "data", no_download) if dataset in COLLECTORS else {}
    return {**collected, **VERIFIERS[dataset](root / "data")}


def run(args: argparse.Namespace) -> None:
    root = Path(args.root)
    report = fetch(args.dataset, root, args.no_download)
    write_json(root / "verified.json", {"dataset": args.dataset, **report})
    print(f"fetch: {args.dataset} verified at {root / 'data'}: {report}")
