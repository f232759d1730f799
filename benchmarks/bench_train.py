"""DUDA training-step and greedy-decoding throughput at the papers' shapes (features 1024×14×14).

Prints ours next to the official formulation measured in the same run: the official code concatenates
two coordinate channels, runs the 1×1 conv over [X; X_diff] for every image of every pair, and calls the
model separately for the changed and the distractor pair, feeding LSTMCells the concatenated inputs at
every step. ``pipeline.models.duda_reference`` re-expresses exactly that computation with the same parameters (it is not the official code, which needs Python 3.5/torch 1.1).
The anchor of performance-anchors.md (official DUDA, batch 32, this machine kind): 1.97 s/step,
16.3 pairs/s, greedy decoding of 32 pairs 0.60 s.

    python benchmarks/bench_train.py [--batch 32] [--steps 5] [--threads 2]
"""

import argparse
import statistics
import time

import torch

from pipeline.models import duda_reference
from pipeline.models.duda import DUDA
from batches import feature_batch




def time_steps(fn, model, batch, steps):
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    times = []
    for i in range(steps + 1):
        t = time.perf_counter()
        loss = fn(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i:  # first step is warm-up
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = DUDA(vocab_size=76)
    batch = feature_batch(a.batch)
    ours = time_steps(lambda m, b: m.training_loss(b)[0], model, batch, a.steps)
    ref = time_steps(duda_reference.training_loss, model, batch, a.steps)
    print(f"DUDA train step, batch {a.batch}, torch threads {torch.get_num_threads()}")
    print(f"  official formulation : {ref:.3f} s/step  {a.batch / ref:6.1f} pairs/s")
    print(f"  ours                 : {ours:.3f} s/step  {a.batch / ours:6.1f} pairs/s   speed-up x{ref / ours:.2f}")
    print("  anchor (official code, performance-anchors.md): 1.97 s/step, 16.3 pairs/s")
    model.eval()
    t = time.perf_counter()
    model.generate(batch["before"], batch["after"], 24)
    dt = time.perf_counter() - t
    print(f"greedy decoding of {a.batch} pairs: {dt:.3f} s (anchor 0.60 s for 32 pairs)")
    if a.batch:
        import resource

        print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")


if __name__ == "__main__":
    main()
