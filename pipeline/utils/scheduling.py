"""How long a training run is expected to take, for the order of the local jobs (torch-free: the Snakefile reads it).

Snakemake starts ready jobs by ``priority`` (``rules/common.smk``, ``run_priority``): longest chain first, so that
the last jobs to end on a few cores are short ones. A run's length is its samples (iterations x batch) times the
milliseconds one sample of its method takes. Samples alone mis-rank the methods: a sample costs ~2.5x more in a
CLIP row (pixels through the captioning encoder over both images' tokens) or IDC-PCL (one stream over the image
and text tokens) than in SCORER or DIRL (a 7x7 grid), so the CLEVR-Change main job of a988f56 started CLIP-FT
(24,000 samples, 18.8 ms each) after SCORER and DIRL (28,800 samples, ~10 ms each) and ended with one core idle
for its last ~7 minutes. Only the order of the jobs depends on these numbers, never a result.
"""

from __future__ import annotations

# Wall milliseconds per sample of a training job (its Snakemake benchmark file / (iterations x batch)), one
# thread, two jobs side by side on the 2 cores of the development machine (an Intel Xeon with AVX512-BF16, bf16
# autocast), the CLEVR-Change main job of a988f56 (2026-11-30); validation and the first epoch's caches included.
MS_PER_SAMPLE = {
    "clip4idc": 25.9,
    "clip4idc_adapt": 16.1,
    "clip_ft": 18.8,
    "dirl": 10.1,
    "duda": 11.5,
    "duda_aux": 19.0,
    "idc_pcl": 25.5,
    "idc_pcl_pretrain": 20.7,
    "scorer": 10.2,
}
DEFAULT_MS_PER_SAMPLE = 10.0


def ms_per_sample(name: str) -> float:
    """The entry of the longest key that ``name`` starts with (``idc_pcl_mlm`` -> ``idc_pcl``,
    ``clip4idc_adapt_intra3_inter3`` -> ``clip4idc_adapt``, ``dirl_ccr`` -> ``dirl``); ``DEFAULT_MS_PER_SAMPLE``
    for a method not listed (``subtraction``, ``rr``, a new one)."""
    keys = [k for k in MS_PER_SAMPLE if name == k or name.startswith(k + "_")]
    return MS_PER_SAMPLE[max(keys, key=len)] if keys else DEFAULT_MS_PER_SAMPLE


def expected_ms(iterations: int, batch_size: int, name: str) -> int:
    """A run's expected wall milliseconds on the development machine: the scheduler's proxy for its length."""
    return round(iterations * batch_size * ms_per_sample(name))
