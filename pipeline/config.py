"""Configuration: load, validate against the JSON schema, report the first problem in one sentence."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import yaml

from pipeline.errors import PipelineError

SCHEMA = Path(__file__).resolve().parent / "schemas" / "config.schema.yaml"


def _where(path) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


def validate(config: dict, schema_path: str | Path = SCHEMA, source: str = "config") -> dict:
    schema = yaml.safe_load(Path(schema_path).read_text())
    validator = jsonschema.Draft202012Validator(schema)
    _raise_first(validator, config, source)
    check_references(config, source)
    # A dataset's run defaults and per-run overrides must leave valid blocks: validate each merged block in the
    # whole config's place (every run's when the dataset has defaults).
    for dataset, block in (config.get("datasets") or {}).items():
        overrides, defaults = block.get("overrides") or {}, block.get("run_defaults")
        for name in overrides:
            if run_section(config, name) is None:
                raise PipelineError(f"{source}: datasets.{dataset}.overrides: {name!r} is neither under methods "
                                    f"nor under pretraining")
        names = [*(config.get("methods") or {}), *(config.get("pretraining") or {})] if defaults else list(overrides)
        for name in names:
            section = run_section(config, name)
            merged = {**config, section: {**config[section], name: run_config(config, dataset, name)}}
            what = " and ".join(["run_defaults"] * bool(defaults) + [f"overrides.{name}"] * (name in overrides))
            _raise_first(validator, merged, f"{source}: datasets.{dataset}.{what} merged over {section}.{name}")
    check_devices(config, source)
    return config


def check_devices(config: dict, source: str = "config") -> None:
    """``train.devices`` must divide ``train.batch_size`` (each process takes an equal share of every batch), on
    every dataset (with its overrides): said before any job runs rather than when the run starts."""
    for dataset in (config.get("datasets") or {}) or [None]:
        for section in ("methods", "pretraining"):
            for name in (config.get(section) or {}):
                tr = (run_config(config, dataset, name) if dataset else config[section][name]).get("train", {})
                n, b = tr.get("devices", 1), tr.get("batch_size", 1)
                if b % n:
                    on = f" on {dataset}" if dataset else ""
                    raise PipelineError(f"{source}: {section}.{name}.train{on}: batch_size {b} is not divisible by "
                                        f"devices {n} (each process takes batch_size / devices of every batch)")


def _raise_first(validator, config: dict, source: str) -> None:
    errors = sorted(validator.iter_errors(config), key=lambda e: (len(e.path), list(map(str, e.path))))
    if not errors:
        return
    e = errors[0]
    if e.validator == "additionalProperties":
        allowed = sorted(e.schema.get("properties", {})) or sorted(e.schema.get("patternProperties", {}))
        extra = sorted(set(e.instance) - set(e.schema.get("properties", {})))
        raise PipelineError(f"{source}: unknown key {extra[0]!r} under {_where(e.path)} (allowed: {', '.join(allowed)})")
    raise PipelineError(f"{source}: {_where(e.path)}: {e.message}")


def check_references(config: dict, source: str = "config") -> None:
    """What the schema cannot say: names that must refer to other blocks. Checked when the Snakefile loads the
    config, so a typo stops the run before any job (a wrong ``init_from`` otherwise only shows as a missing
    input, or as nothing to do while stale results stay)."""
    pretraining, methods, datasets = (config.get(k) or {} for k in ("pretraining", "methods", "datasets"))
    for b, f in (config.get("features") or {}).items():
        if f.get("shortcut") == "avg_down" and f.get("weights") != "random":
            raise PipelineError(f"{source}: features.{b}: shortcut avg_down needs weights random (the "
                                f"{f.get('weights')} weights were trained with strided shortcuts)")
    from pipeline import paper_numbers as pn
    from pipeline.models import lookup

    for m, block in methods.items():
        if lookup(m) is None:  # else training fails with "unknown method" after hours of upstream jobs
            raise PipelineError(f"{source}: methods.{m}: no model is registered under this id (pipeline/models/__init__.py)")
        init = block.get("init_from")
        if init is not None and init not in pretraining:
            raise PipelineError(f"{source}: methods.{m}.init_from: {init!r} is not a run under pretraining "
                                f"(configured: {', '.join(sorted(pretraining)) or 'none'})")
    for t, block in (config.get("tables") or {}).items():
        for m in block.get("methods", []):
            if m not in methods:
                raise PipelineError(f"{source}: tables.{t}.methods: unknown method {m!r} (not under methods)")
        dataset = block.get("dataset", t)
        if dataset not in datasets:
            raise PipelineError(f"{source}: tables.{t}: dataset {dataset!r} is not under datasets"
                                + ("" if "dataset" in block else f" (set tables.{t}.dataset)"))
        for m in block.get("paper_only", []):
            if m in methods:
                raise PipelineError(f"{source}: tables.{t}.paper_only: {m!r} is a method under methods (list it under "
                                    f"tables.{t}.methods)")
            if pn.lookup(dataset, "total", m) is None:
                raise PipelineError(f"{source}: tables.{t}.paper_only: no paper row of {m!r} for dataset {dataset!r} "
                                    "in pipeline/paper_numbers.py")
        for pair in block.get("contrasts", []):
            for m in pair:
                if m not in block.get("methods", []):
                    raise PipelineError(f"{source}: tables.{t}.contrasts: {m!r} is not one of tables.{t}.methods")


def merge(base: dict, over: dict) -> dict:
    """``over`` deep-merged over ``base`` (a new dict): mappings merge key by key, anything else replaces."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def fill(base: dict, defaults: dict) -> dict:
    """``base`` with what it lacks taken from ``defaults`` (a new dict; deep): the block's own settings win. Not
    ``merge(defaults, base)``: that would put the defaults' keys first, and a run records its block as resolved."""
    out = dict(base)
    for k, v in defaults.items():
        if k not in out:
            out[k] = v
        elif isinstance(v, dict) and isinstance(out[k], dict):
            out[k] = fill(out[k], v)
    return out


def run_section(config: dict, name: str) -> str | None:
    """``"methods"`` or ``"pretraining"``: the section that configures the run ``name`` (None: neither)."""
    for section in ("methods", "pretraining"):
        if name in (config.get(section) or {}):
            return section
    return None


def run_config(config: dict, dataset: str, name: str) -> dict:
    """The block of method or first-stage run ``name`` as it trains on ``dataset``: ``methods.<name>`` (or
    ``pretraining.<name>``), completed by ``datasets.<dataset>.run_defaults`` (what every run on that dataset
    shares, where the block does not say otherwise), with ``datasets.<dataset>.overrides.<name>`` deep-merged
    over the result. Without either it is the configured block itself, so a run's parameters, and the DAG's
    view of them, do not change when another dataset gains defaults or an override."""
    section = run_section(config, name)
    if section is None:
        raise PipelineError(f"config: {name!r} is neither under methods nor under pretraining")
    block = config[section][name]
    ds = (config.get("datasets") or {}).get(dataset) or {}
    if ds.get("run_defaults"):
        block = fill(block, ds["run_defaults"])
    over = (ds.get("overrides") or {}).get(name)
    return merge(block, over) if over else block


def load(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"config file not found: {path}")
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise PipelineError(f"{path}: not valid YAML ({e})") from None
    return validate(config, source=str(path))
