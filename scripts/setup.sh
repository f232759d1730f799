#!/usr/bin/env bash
# One-step set-up on a fresh machine with Python 3.11 and Java: the CPU build of torch first (a bare
# `torch` requirement would pull several GB of CUDA packages), then the package and its tools.
# On a GPU machine, install the CUDA build of torch first and this script keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
# Headless Chromium (Debian's `chromium`) for tests/test_report.py's screenshot of the HTML report; skipped
# where it is installed already, and only said where this is no root Debian/Ubuntu machine.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    # Not fatal: without it only the screenshot test is skipped (with that reason).
    apt-get install -y -qq chromium >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; } \
      || echo "setup: could not install chromium with apt-get; the report screenshot test will be skipped" >&2
  else
    echo "setup: no chromium; install Debian's 'chromium' package for the report screenshot test" >&2
  fi
fi
PY=${PYTHON:-python3}
if ! $PY -c "import torch" 2>/dev/null; then
  # Where PyPI serves CUDA wheels and no GPU is wanted, install torch from PyTorch's CPU index first.
  $PY -m pip install --quiet torch==2.13.0
fi
$PY -m pip install --quiet -e ".[test,dvc,slurm]"
$PY -c "import pipeline, torch, snakemake, h5py, pycocoevalcap, transformers, snakemake_executor_plugin_slurm; print('set-up ok: torch', torch.__version__)"
