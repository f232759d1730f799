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
    errors = sorted(validator.iter_errors(config), key=lambda e: (len(e.path), list(map(str, e.path))))
    if not errors:
        return config
    e = errors[0]
    if e.validator == "additionalProperties":
        allowed = sorted(e.schema.get("properties", {})) or sorted(e.schema.get("patternProperties", {}))
        extra = sorted(set(e.instance) - set(e.schema.get("properties", {})))
        raise PipelineError(f"{source}: unknown key {extra[0]!r} under {_where(e.path)} (allowed: {', '.join(allowed)})")
    raise PipelineError(f"{source}: {_where(e.path)}: {e.message}")


def load(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"config file not found: {path}")
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise PipelineError(f"{path}: not valid YAML ({e})") from None
    return validate(config, source=str(path))
