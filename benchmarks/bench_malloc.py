"""DUDA's training step with glibc's default allocator settings against `pipeline.utils.malloc` (what every
`python -m pipeline` stage applies): wall, user and system seconds and minor page faults per step.

The embedded default's shape (random layer4 grid, 2048×7×7, batch 32, d=512, bf16 autocast where the CPU has
it), with fresh feature tensors each step as the training loader gives them. The allocator is process-wide, so
each setting runs in its own child process, alternated (default, tuned, default, tuned, ...) so that machine
drift hits both alike; medians over the rounds.

    python benchmarks/bench_malloc.py [--steps 40] [--rounds 2]
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def child(mode: str, steps: int) -> dict:
    import torch

    from pipeline.engine import autocast
    from pipeline.utils.malloc import keep_freed_memory

    applied = keep_freed_memory() if mode == "tuned" else False
    torch.set_num_threads(1)
    from batches import feature_batch
    from pipeline.models.duda import DUDA

    torch.manual_seed(0)
    model = DUDA(vocab_size=76, feat_dim=2048, att_hidden=128, pool=None, reduce="mean", diff_prior=6.0)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    base = feature_batch(32)
    grid = lambda k: torch.randn(32, 2048, 7, 7, generator=torch.Generator().manual_seed(k))
    device = torch.device("cpu")

    def step(k):
        batch = {**base, "before": grid(3 * k), "after": grid(3 * k + 1), "distractor": grid(3 * k + 2)}
        with autocast(device, "fast"):
            loss = model.training_loss(batch)[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step(0)  # warm-up
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for k in range(1, steps + 1):
        step(k)
    r1, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
    return {"applied": applied, "wall": wall / steps, "user": (r1.ru_utime - r0.ru_utime) / steps,
            "sys": (r1.ru_stime - r0.ru_stime) / steps, "faults": (r1.ru_minflt - r0.ru_minflt) / steps}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", choices=["default", "tuned"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.steps)))
        return
    runs = {"default": [], "tuned": []}
    for _ in range(a.rounds):
        for mode in runs:
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(a.steps)],
                                 capture_output=True, text=True, check=True)
            runs[mode].append(json.loads(out.stdout.splitlines()[-1]))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("wall", "user", "sys", "faults")}
           for m, rs in runs.items()}
    print(f"DUDA step, layer4 2048x7x7, batch 32, one thread, {a.steps} steps x {a.rounds} rounds (medians)")
    print(f"{'allocator':<28} {'wall s/step':>11} {'user s':>7} {'sys s':>6} {'minor faults/step':>18}")
    for mode, label in (("default", "glibc defaults"), ("tuned", "pipeline.utils.malloc")):
        m = med[mode]
        print(f"{label:<28} {m['wall']:>11.3f} {m['user']:>7.3f} {m['sys']:>6.3f} {m['faults']:>18,.0f}")
    print(f"wall ratio tuned / defaults: {med['tuned']['wall'] / med['default']['wall']:.2f}"
          f" (applied: {runs['tuned'][0]['applied']})")


if __name__ == "__main__":
    main()
