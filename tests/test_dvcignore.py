"""DVC versions the artifacts, never a killed save's temporary or an unfinished run's resume state."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = "results/clevr_change/duda/seed0"


def ignored(paths):
    p = subprocess.run([sys.executable, "-m", "dvc", "check-ignore", "-d", *paths], cwd=ROOT, capture_output=True,
                       text=True)
    return {line.split("\t")[1] for line in p.stdout.splitlines() if "\t" in line}


def test_temporaries_and_resume_state_are_ignored_but_not_the_outputs():
    junk = [f"{RUN}/.checkpoint.pt.k1ll3d_9.tmp", f"{RUN}/resume.pt",
            "results/clevr_change/features/.resnet101_layer3.h5.abcd1234.tmp.x"]
    kept = [f"{RUN}/checkpoint.pt", f"{RUN}/metrics.json", "results/tables/clevr_change.csv"]
    assert ignored(junk + kept) == set(junk)
