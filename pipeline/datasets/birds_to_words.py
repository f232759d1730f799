"""Birds-to-Words (Forbes et al., "Neural Naturalist", EMNLP 2019): the release's TSV and its photos, parsed into
manifest records.

The release (``google-research-datasets/birds-to-words``, reference/datasets.md §5) is one tab-separated file,
``birds-to-words-v1.0.tsv``, with a header row and one row per (pair, description); columns ``COLUMNS``:
``img1ObservationURL, img1ImgURL, img1Species, img1Selection, img2ObservationURL, img2ImgURL, img2Species,
img2Selection, split, annN, description``. There is no image archive: every photo is an iNaturalist URL, fetched
one by one (``pipeline.datasets.fetch``, which lists the photos it could not get in ``missing_photos.json``).

The layout this parser reads (``data_dir``, the ``data/`` folder of ``resources/raw/birds_to_words/<source>``):
``birds-to-words-v1.0.tsv`` and ``images/<local name>``, the local name of a photo being a function of its URL
only (``local_name``): ``<photo id>.<ext>`` for an iNaturalist photo URL (``.../photos/<photo id>/<size>.<ext>``,
the extension lower-cased, the query string dropped), else ``url-<first 16 hex of the URL's sha1>.<ext>``
(``.jpg`` when the URL's path has no extension). The same photo in several pairs is one file.

Rows are grouped into pairs by ``(img1ImgURL, img2ImgURL)`` (first appearance order); one record per pair:
``pair_id`` ``"<stem 1>_<stem 2>"`` of the two local names, ``index`` its position in the manifest, ``split`` the
rows' ``split`` (train / val / test; rows of one pair in two splits are an error), ``before`` / ``after`` the two
photos (img1 / img2), ``captions`` all its descriptions in ``annN`` order, ``change_type`` ``"change"`` (the
release labels no type, as Spot-the-Diff and IER), ``labels`` the two photos' species and selections, no
distractor partner.

Text quirks: the descriptions are pre-tokenised, lower-cased paragraphs that name the birds ``animal1`` and
``animal2`` (img1, img2). They are kept as they are, except that white space runs become one space and a spelling
``animal 1`` / ``Animal1`` becomes ``animal1`` (``normalise``), so that the tokenizer keeps the two names as
single words. A description without a word is dropped (counted in ``warnings``, or an error without a list); a
pair left without any is an error naming the TSV.

Missing photos (the release's URLs rot): a photo listed in ``missing_photos.json`` (the fetcher could not get it)
leaves its pairs out, reported; any other missing photo is an error naming the file when no ``warnings`` list is
given, else its pairs are left out with a warning (``inspect``). ``check_images=False`` checks nothing.
No checksum is published for the TSV: ``official`` records its sha256 (``fetch``'s ``verified.json``).
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
import urllib.parse
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.datasets.release import report
from pipeline.text import has_word

TSV = "birds-to-words-v1.0.tsv"
IMAGES = "images"
MISSING = "missing_photos.json"  # written by the fetcher: {url: local name} of the photos it could not get
CHANGE = "change"
SPLITS = ("train", "val", "test")
COLUMNS = ("img1ObservationURL", "img1ImgURL", "img1Species", "img1Selection", "img2ObservationURL", "img2ImgURL",
           "img2Species", "img2Selection", "split", "annN", "description")
SELECTIONS = ("base", "visual", "sameSpecies", "sameGenus", "sameFamily", "sameOrder", "sameClass")
_PHOTO = re.compile(r"/photos/(\d+)/[^/]*$")
_ANIMAL = re.compile(r"\banimal\s*([12])\b", re.IGNORECASE)


def local_name(url: str) -> str:
    """The file name of the photo at ``url`` under ``images/`` (see the module docstring)."""
    path = urllib.parse.urlparse(url).path
    ext = Path(path).suffix.lower() or ".jpg"
    m = _PHOTO.search(path)
    if m:
        return f"{m.group(1)}{ext}"
    return f"url-{hashlib.sha1(url.encode()).hexdigest()[:16]}{ext}"


def normalise(description: str) -> str:
    return _ANIMAL.sub(lambda m: f"animal{m.group(1)}", " ".join(description.split()))


def read_rows(data_dir: str | Path) -> list[dict]:
    """The TSV's rows as dicts (header checked), each with its line number ``_line``; a missing file, a header
    without the release's columns, a short row, an unknown split or a bad ``annN`` raise PipelineError naming
    the file and line."""
    path = Path(data_dir) / TSV
    if not Path(data_dir).is_dir():
        raise PipelineError(f"Birds-to-Words data directory not found: {data_dir}")
    if not path.is_file():
        raise PipelineError(f"Birds-to-Words TSV missing: {path}")
    try:
        with open(path, newline="", encoding="utf-8") as f:
            lines = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    except (UnicodeDecodeError, csv.Error) as e:
        raise PipelineError(f"{path}: cannot read as a UTF-8 TSV ({e})") from None
    if not lines:
        raise PipelineError(f"{path}: empty file (expected a header row {', '.join(COLUMNS)})")
    header = [h.strip() for h in lines[0]]
    absent = [c for c in COLUMNS if c not in header]
    if absent:
        raise PipelineError(f"{path}: header row lacks column(s) {', '.join(absent)} (got {header[:12]})")
    col = {c: header.index(c) for c in COLUMNS}
    rows = []
    for n, line in enumerate(lines[1:], start=2):
        if not any(x.strip() for x in line):
            continue
        if len(line) < len(header):
            raise PipelineError(f"{path}: line {n} has {len(line)} fields, the header {len(header)}")
        row = {c: line[i].strip() for c, i in col.items()}
        if row["split"] not in SPLITS:
            raise PipelineError(f"{path}: line {n}: split {row['split']!r} is not one of {', '.join(SPLITS)}")
        if not row["annN"].isdigit():
            raise PipelineError(f"{path}: line {n}: annN {row['annN']!r} is not a number")
        for k in ("img1ImgURL", "img2ImgURL"):
            if not row[k]:
                raise PipelineError(f"{path}: line {n}: empty {k}")
        row["_line"] = n
        rows.append(row)
    return rows


def group_pairs(rows: list[dict], path: Path) -> list[dict]:
    """Rows grouped by ``(img1ImgURL, img2ImgURL)`` in first appearance order: ``{"url1", "url2", "split",
    "rows"}``, the rows sorted by ``annN`` (stable). A pair whose rows name two splits is an error."""
    pairs: dict[tuple[str, str], dict] = {}
    for r in rows:
        key = (r["img1ImgURL"], r["img2ImgURL"])
        p = pairs.setdefault(key, {"url1": key[0], "url2": key[1], "split": r["split"], "rows": []})
        if p["split"] != r["split"]:
            raise PipelineError(f"{path}: line {r['_line']}: pair ({key[0]}, {key[1]}) is in split {r['split']!r} "
                                f"here and {p['split']!r} on line {p['rows'][0]['_line']}")
        p["rows"].append(r)
    for p in pairs.values():
        p["rows"].sort(key=lambda r: int(r["annN"]))
    return list(pairs.values())


def read_missing(data_dir: Path) -> dict[str, str]:
    path = data_dir / MISSING
    if not path.is_file():
        return {}
    try:
        got = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PipelineError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(got, dict):
        raise PipelineError(f"{path}: expected an object {{url: local name}}")
    return got


def source_counts(data_dir: str | Path, source: str) -> dict[str, dict[str, int]]:
    """Per split what the TSV holds: ``rows`` (descriptions), ``distinct_pairs``, ``distinct_photos``,
    ``descriptions_without_word`` and ``pairs_missing_a_photo`` (a photo not under ``images/``)."""
    data_dir = Path(data_dir)
    pairs = group_pairs(read_rows(data_dir), data_dir / TSV)
    out = {}
    for split in SPLITS:
        ps = [p for p in pairs if p["split"] == split]
        photos = {u for p in ps for u in (p["url1"], p["url2"])}
        out[split] = {"rows": sum(len(p["rows"]) for p in ps), "distinct_pairs": len(ps),
                      "distinct_photos": len(photos),
                      "descriptions_without_word": sum(not has_word(r["description"]) for p in ps for r in p["rows"]),
                      "pairs_missing_a_photo": sum(any(not (data_dir / IMAGES / local_name(u)).is_file()
                                                       for u in (p["url1"], p["url2"])) for p in ps)}
    return out


def parse(data_dir: str | Path, source: str, generator_seed: int | None = None, check_images: bool = True,
          warnings: list[str] | None = None) -> list[dict]:
    """Read ``data_dir`` (see the module docstring): one manifest record per pair, in the TSV's order."""
    data_dir = Path(data_dir)
    path = data_dir / TSV
    pairs = group_pairs(read_rows(data_dir), path)
    missing_listed = read_missing(data_dir)
    folder = data_dir / IMAGES
    local: list[str] = []
    records: list[dict] = []
    lost_listed: list[str] = []
    dropped = 0
    for p in pairs:
        names = (local_name(p["url1"]), local_name(p["url2"]))
        if check_images:
            absent = [(u, n) for u, n in zip((p["url1"], p["url2"]), names) if not (folder / n).is_file()]
            if absent and all(u in missing_listed for u, _ in absent):
                lost_listed.append(names[0])
                continue
            if absent:
                u, n = absent[0]
                msg = (f"Birds-to-Words photo missing: {folder / n} ({u}, line {p['rows'][0]['_line']} of {path}); "
                       f"run `python -m pipeline fetch --dataset birds_to_words`, which lists the photos it "
                       f"cannot get in {data_dir / MISSING}")
                if warnings is None:
                    raise PipelineError(msg)
                local.append(msg + "; pair left out")
                continue
        caps = [normalise(r["description"]) for r in p["rows"]]
        kept = [c for c in caps if has_word(c)]
        if len(kept) < len(caps):
            if warnings is None:
                bad = next(r for r, c in zip(p["rows"], caps) if not has_word(c))
                raise PipelineError(f"{path}: line {bad['_line']}: a description without a word")
            dropped += len(caps) - len(kept)
        if not kept:
            raise PipelineError(f"{path}: pair on line {p['rows'][0]['_line']} has no description with a word")
        r0 = p["rows"][0]
        records.append({
            "pair_id": f"{Path(names[0]).stem}_{Path(names[1]).stem}", "index": len(records), "split": p["split"],
            "before": f"{IMAGES}/{names[0]}", "after": f"{IMAGES}/{names[1]}", "change_type": CHANGE,
            "captions": kept, "labels": {"species": [r0["img1Species"], r0["img2Species"]],
                                         "selection": [r0["img1Selection"], r0["img2Selection"]]},
            "source": source, "generator_seed": generator_seed})
    if lost_listed:
        local.append(f"{len(lost_listed)} pair(s) left out: a photo the fetcher could not get ({data_dir / MISSING})")
    if dropped:
        local.append(f"{path}: {dropped} description(s) without a word dropped")
    seen: dict[str, int] = {}
    for r in records:  # two URLs of one photo id (another size): keep the pair ids apart
        n = seen.get(r["pair_id"], 0)
        seen[r["pair_id"]] = n + 1
        if n:
            r["pair_id"] = f"{r['pair_id']}#{n}"
    report(local, warnings, "Birds-to-Words")
    return records
