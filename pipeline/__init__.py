"""Reproducible image difference captioning pipeline.

All logic lives here; Snakemake rules and DVC stages call it through ``python -m pipeline <stage>``.
"""

__version__ = "0.1.0"
