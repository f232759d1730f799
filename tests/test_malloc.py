"""pipeline.utils.malloc: freed training-step buffers are reused, not faulted in again (glibc)."""

import os
import subprocess
import sys
import textwrap

import pytest

from pipeline.utils.malloc import ENV

# A training step in small: four 16 MiB activations alive together, then freed, 50 times; count the process's
# minor page faults. glibc's defaults trim the freed heap top (64 MiB, above its adaptive trim threshold) back to
# the system at every step, so the next step faults the same pages in again.
PROBE = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from pipeline.utils.malloc import keep_freed_memory
    applied = keep_freed_memory() if sys.argv[1] == "tuned" else False
    def step():
        acts = [np.ones(1 << 21) for _ in range(4)]  # 16 MiB of float64 each
        del acts
    step()  # warm-up: glibc adapts its thresholds on the first frees
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(50):
        step()
    print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def faults(mode: str, env: dict | None = None) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, env=env)
    applied, n = out.stdout.split()
    return applied, int(n)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_buffers_are_reused_instead_of_faulted_in_again():
    clean = {k: v for k, v in os.environ.items() if k not in ENV}
    applied, tuned = faults("tuned", clean)
    _, default = faults("default", clean)
    assert applied == "True"
    assert default > 10_000  # measured ~100,000 (2,000 pages a step) with glibc 2.36's defaults
    assert tuned < default / 20, (tuned, default)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_user_s_own_malloc_settings_are_kept():
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    assert faults("tuned", env)[0] == "False"
