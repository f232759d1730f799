"""Step-time overhead of the TIRG auxiliary task over plain DUDA (same batch, same shapes: 1024×14×14).

One model; in each round, interleaved so that machine drift hits all three alike, a plain DUDA step
(the primary's own objective), a stage-1 step (primary → auxiliary: + greedy caption, soft embeddings,
TIRG, Eq. 6) and a stage-2 step (auxiliary → primary: + TIRG on the ground truth, soft selection of the
after map, DUDA on (A, B̂) with the gradient into B̂: b_hat_min_omega 0, the costlier branch; below the
threshold stage 2 reads the true B). Training alternates the stages, so the cost per step of duda_aux is their mean. A step is forward, loss, backward and Adam step; medians after one warm-up, as
wall time and as process CPU time (the steadier figure on a shared machine; with --threads 1 it is the
single-core cost). Untrained, the greedy captions never end, so stage 1 decodes all 23 steps: a worst case.
Batch 128 is the official DUDA batch (the aux paper does not state its own).

    python benchmarks/bench_aux.py [--batches 32 128] [--steps 3] [--threads 2]
"""

import argparse
import statistics
import time

import torch

from pipeline.models.aux_training import AuxiliaryTraining
from batches import feature_batch




def bench(batch_size, steps, hard):
    torch.manual_seed(0)
    model = AuxiliaryTraining(vocab_size=76, feat_dim=1024)  # paper-sized DUDA, TIRG's 512-d space
    opt = torch.optim.Adam(model.parameters(), 1e-4)
    batch = feature_batch(batch_size)
    batch["epoch"] = torch.tensor(100 if hard else 0)
    kinds = {
        "duda": lambda: model.primary.training_loss(batch)[0],
        "stage1": lambda: model.training_loss({**batch, "step": torch.tensor(0)})[0],
        "stage2": lambda: model.training_loss({**batch, "step": torch.tensor(1)})[0],
    }
    wall, cpu = {k: [] for k in kinds}, {k: [] for k in kinds}
    for r in range(steps + 1):
        for k, fn in kinds.items():
            t, c = time.perf_counter(), time.process_time()
            loss = fn()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if r:  # round 0 is warm-up
                wall[k].append(time.perf_counter() - t)
                cpu[k].append(time.process_time() - c)
    return ({k: statistics.median(v) for k, v in wall.items()}, {k: statistics.median(v) for k, v in cpu.items()})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--hard", action="store_true", help="hard candidate sets (same cost: n is the same)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"DUDA vs DUDA + TIRG auxiliary task, features 1024x14x14, torch threads {torch.get_num_threads()}")
    for b in a.batches:
        for what, t in zip(("wall", "CPU "), bench(b, a.steps, a.hard)):
            mean_aux = (t["stage1"] + t["stage2"]) / 2
            print(f"batch {b:4d} {what}: DUDA {t['duda']:.3f} s/step | stage 1 {t['stage1']:.3f} (x{t['stage1'] / t['duda']:.2f}) "
                  f"| stage 2 {t['stage2']:.3f} (x{t['stage2'] / t['duda']:.2f}) | alternated {mean_aux:.3f} s/step: "
                  f"overhead +{100 * (mean_aux / t['duda'] - 1):.0f}%")
    import resource

    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")


if __name__ == "__main__":
    main()
