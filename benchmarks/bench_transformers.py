"""SCORER+CBR and DIRL+CCR training steps (and greedy decoding) at the papers' shapes, ours vs the official
formulation, measured side by side in the same run.

Shapes: features 1024×14×14, captions of 24 tokens, vocabulary 76, 8 heads, 2+2 layers, width 512.
The official code cannot run here (CUDA-only, Python 3.6-era dependencies), so ``official_*_loss`` below
re-express its computation with the same parameters (not its code):

- SCORER (``models/SCORER.py``, ``models/CBR.py``, ``train.py``): the changed and the distractor pairs go
  through the encoder separately; every cross-view layer, in both directions, computes the token-wise
  matching through the full B×B×196×196 similarity tensor (einsum over heads and channels, then ``max``),
  although only the last layer's enters the loss; the attention is unfused (matmul, softmax, dropout,
  matmul); the decoder runs once per pair set with an additive padding+causal mask; CBR builds its
  B×B×196×196 tensor for each pair set.
- DIRL (``models/DIRL.py``, ``models/CCR_no_init.py``, ``train_clevr_change.py``): the changed and the
  distractor pairs go through the encoder separately (the before image is projected, MLP-projected and
  attended twice), Barlow-Twins z-scoring, ``nn.MultiheadAttention`` with attention weights returned
  (unfused), the decoder per pair set, CCR on unmasked means.

Dropout: the official formulations use torch's own dropout (``F.dropout``, a ``bernoulli_`` mask), as
released, also where they reuse our modules' dropout layers (``official_drop`` / ``official_seq``); ours uses
the cheaper 16-bit CPU masks of ``pipeline.models.dropout`` at the same places and rates.

``--naive-per-head`` adds the paper-faithful per-head matching through the full B×B×h×196×196 tensor
(our model's function, computed naively) — memory-hungry: ≈1.3 GB per tensor at batch 32.

Peak memory: each measurement runs in its own subprocess; ``ru_maxrss`` (peak resident set) is reported.
Anchors (performance-anchors.md, official code on this machine kind, batch 32): SCORER+CBR 17.9 s/step,
4.0 GB; DIRL+CCR 15.7 s/step, 4.4 GB; greedy decoding of 32 pairs 5.1 s / 8.6 s.

    python benchmarks/bench_transformers.py --batch 32 --steps 3          # all models, ours and official
    python benchmarks/bench_transformers.py --impls ours ours_bf16 official  # + CPU bf16 autocast (AMX)
    python benchmarks/bench_transformers.py --batch 128 --steps 1 --models scorer_cbr
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from pipeline.engine import autocast
from pipeline.models import build_model
from pipeline.models.common import sequence_ce
from pipeline.models.dropout import Dropout
from pipeline.models.token_matching import info_nce, naive_multihead_token_matching
from batches import feature_batch
from pipeline.text import START

ANCHORS = {"scorer_cbr": (17.9, 4.0, 5.1), "dirl_ccr": (15.7, 4.4, 8.6)}  # s/step, GB, s decode (batch 32)




# --------------------------------------------------------------------------- official formulations


def official_drop(layer, x):
    """One of our dropout layers applied as the official code does: torch's ``F.dropout`` at the layer's rate."""
    return F.dropout(x, layer.p, layer.training)


def official_seq(seq, x):
    """An ``nn.Sequential`` of ours with its dropout layers applied by ``official_drop``."""
    for mod in seq:
        x = official_drop(mod, x) if isinstance(mod, Dropout) else mod(x)
    return x


def unfused_attention(att, xq, xkv, mask=None, training=True):
    """Multi-head attention as the official codes compute it: explicit scores, softmax, dropout, matmul."""
    q, (k, v) = att.project_q(xq), att.project_kv(xkv)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores + mask
    probs = F.dropout(scores.softmax(-1), att.dropout, training)
    a = (probs @ v).transpose(1, 2).reshape(xq.size(0), xq.size(1), -1)
    return att.out_proj(a), q, k


def full_tensor_matching(q, k):
    """The official ``retrieve_logits``: einsum over heads and channels into [B, B, N, M], max both ways."""
    s = torch.einsum("ahld,bhmd->ablm", q, k)
    return (s.max(-1).values.sum(2) / s.size(2) + s.max(-2).values.sum(2) / s.size(3)) / 2


def official_decoder(dec, tokens, memory, training=True):
    n = tokens.size(1)
    valid = (tokens > 0).float()
    mask = valid[:, None, None, :] * torch.tril(torch.ones(n, n))
    mask = (1 - mask) * -10000.0
    x = official_seq(dec.embed_fc, dec.embed(tokens) + dec.pos_table[:n])
    texts, visuals = [], []
    for layer in dec.layers:
        a, _, _ = unfused_attention(layer.self_attn, x, x, mask, training)
        w = layer.norm1(x + official_drop(layer.drop1, a))
        c, _, _ = unfused_attention(layer.cross_attn, w, memory, None, training)
        y = layer.norm2(w + official_drop(layer.drop2, c))
        x = layer.norm3(y + official_drop(layer.drop3, official_seq(layer.ffn, y)))
        texts.append(w.mean(1))
        visuals.append(y.mean(1))
    return dec.head(x), x, texts[-1], visuals[-1]


def official_scorer_loss(m, batch):
    def detector(bef, aft):
        x1, x2 = m.embed(bef), m.embed(aft)
        pre1, pre2 = x1, x2
        for layer in m.layers:
            a1, q1, k2 = unfused_attention(layer.attn, x1, x2)
            a2, q2, k1 = unfused_attention(layer.attn, x2, x1)
            lg1 = full_tensor_matching(q1, k2)  # computed in every layer, as released
            lg2 = full_tensor_matching(q2, k1)
            x1, x2 = layer.norm(x1 + a1), layer.norm(x2 + a2)
        scale = m.logit_scale.exp()
        return official_seq(m.fuse, torch.cat([x1, x2], -1)), scale * lg1, scale * lg2, pre1, pre2

    def cbr(bef, hidden, aft, tokens):
        c = m.cbr
        mask = (tokens > 0).float().unsqueeze(-1)
        sent = (hidden * mask).mean(1)
        x = c.conv1(torch.cat([bef, sent[:, None].expand_as(bef)], -1))
        h = c.self_attn.out_proj(_unfused_self(c.self_attn, x))
        h = c.conv2(h)
        split = lambda t: t.view(t.size(0), t.size(1), c.heads, -1).transpose(1, 2)
        s = c.logit_scale.exp() * full_tensor_matching(split(c.query(h)), split(c.key(aft)))
        return (info_nce(s) + info_nce(s.t())) / 2

    loss = 0
    for aft, labels in ((batch["after"], batch["labels"]), (batch["distractor"], batch["distractor_labels"])):
        enc, s1, s2, pre1, pre2 = detector(batch["before"], aft)
        tokens = labels[:, :-1]
        logits, hidden, _, _ = official_decoder(m.decoder, tokens, enc)
        loss = loss + 0.5 * sequence_ce(logits, labels[:, 1:])
        loss = loss + 0.1 * 0.5 * (info_nce(s1) + info_nce(s2)) / 2 + 0.001 * 0.5 * cbr(pre1, hidden, pre2, tokens)
    return loss


def _unfused_self(att, x):
    q, k, v = att.project_qkv(x)
    probs = (q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))).softmax(-1)
    return (probs @ v).transpose(1, 2).reshape(x.size(0), x.size(1), -1)


def official_dirl_loss(m, batch):
    def detector(bef, aft):
        x1, x2 = m.embed(bef), m.embed(aft)
        y1, y2 = official_seq(m.mlp, x1.flatten(0, 1)), official_seq(m.mlp, x2.flatten(0, 1))
        z1 = (y1 - y1.mean(0)) / y1.std(0)
        z2 = (y2 - y2.mean(0)) / y2.std(0)
        c = z1.t() @ z2 / z1.size(0)
        on = (torch.diagonal(c) - 1).pow(2).sum()
        off = c.pow(2).sum() - torch.diagonal(c).pow(2).sum()
        pre1, pre2 = x1, x2
        for layer in m.layers:
            a1, _, _ = unfused_attention(layer.attn, x1, x2)
            a2, _, _ = unfused_attention(layer.attn, x2, x1)
            x1, x2 = layer.norm(x1 + official_drop(layer.drop, a1)), layer.norm(x2 + official_drop(layer.drop, a2))
        return pre1 - x1, pre2 - x2, on + 0.003 * off

    loss = 0
    for aft, labels in ((batch["after"], batch["labels"]), (batch["distractor"], batch["distractor_labels"])):
        d1, d2, dirl = detector(batch["before"], aft)
        tokens = labels[:, :-1]
        logits, _, text, visual = official_decoder(m.decoder, tokens, official_seq(m.fuse, torch.cat([d1, d2], -1)))
        sim = (text @ visual.t() / 0.5 + visual @ text.t() / 0.5) / 2
        loss = loss + 0.5 * sequence_ce(logits, labels[:, 1:]) + 0.5 * 0.5 * dirl + 0.3 * 0.5 * info_nce(sim)
    return loss


def naive_per_head_scorer_loss(m, batch):
    """Our model's loss with the matching through the full per-head similarity tensor (autograd)."""
    import pipeline.models.scorer as scorer_mod

    saved = scorer_mod.multihead_token_matching
    scorer_mod.multihead_token_matching = lambda q, k, chunk=None, per_head=True: naive_multihead_token_matching(q, k)
    try:
        return m.training_loss(batch)[0]
    finally:
        scorer_mod.multihead_token_matching = saved


def ours_bf16_loss(m, batch):
    """Our loss under bf16 autocast on the CPU (``train.precision: bf16``; AMX / AVX512-BF16 machines)."""
    with autocast(torch.device("cpu"), "bf16"):
        return m.training_loss(batch)[0]


def official_recompute_decode(m, before, after, max_len):
    """Greedy decoding as released: the whole decoder re-run on the prefix at every step."""
    b = before.size(0)
    x = m.embed(torch.cat([before, after]))
    mem = m.encode(x[:b], x[b:])
    mem = mem[0] if isinstance(mem, tuple) else mem
    seq = torch.full((b, 1), START)
    for _ in range(max_len):
        logits = official_decoder(m.decoder, seq, mem, training=False)[0][:, -1]
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
    return seq


# --------------------------------------------------------------------------- measurement


def measure(model_id: str, impl: str, batch_size: int, steps: int, threads: int) -> dict:
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_model(model_id, 76, 1024, {"mtm_per_head": False} if impl == "ours_summed" else {})
    batch = feature_batch(batch_size)
    fn = {"ours": lambda m, b: m.training_loss(b)[0], "ours_summed": lambda m, b: m.training_loss(b)[0],
          "ours_bf16": ours_bf16_loss,
          "official": official_scorer_loss if model_id.startswith("scorer") else official_dirl_loss,
          "naive_per_head": naive_per_head_scorer_loss}[impl]
    opt = torch.optim.Adam(model.parameters(), 2e-4)
    times, cpu = [], []
    for i in range(steps + 1):
        t, c = time.perf_counter(), time.process_time()
        loss = fn(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i or steps == 0:  # the first step is a warm-up unless a single step is asked for
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
    med = statistics.median(times)
    out = {"model": model_id, "impl": impl, "batch": batch_size, "threads": torch.get_num_threads(),
           "s_per_step": med, "steps_per_s": 1 / med, "cpu_s_per_step": statistics.median(cpu),
           "steps_timed": len(times), "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}
    if impl in ("ours", "ours_summed", "ours_bf16", "official"):
        model.eval()
        n = min(batch_size, 32)
        with torch.no_grad(), autocast(torch.device("cpu"), "bf16" if impl == "ours_bf16" else "fp32"):
            t = time.perf_counter()
            if impl.startswith("ours"):
                model.generate(batch["before"][:n], batch["after"][:n], 24)
            else:
                official_recompute_decode(model, batch["before"][:n], batch["after"][:n], 24)
            out["decode_s"] = time.perf_counter() - t
            out["decode_pairs"] = n
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step (0: time one step)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--models", nargs="*", default=["scorer_cbr", "dirl_ccr"])
    ap.add_argument("--impls", nargs="*", default=["ours", "official"],
                    help="ours, ours_summed (our implementation of the official's summed-head matching), "
                         "ours_bf16 (ours under CPU bf16 autocast), official")
    ap.add_argument("--naive-per-head", action="store_true")
    ap.add_argument("--repeats", type=int, default=1, help="alternate the implementations this many times (medians)")
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "IMPL"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(a.one[0], a.one[1], a.batch, a.steps, a.threads)))
        return
    impls = a.impls + (["naive_per_head"] if a.naive_per_head else [])
    results = {}
    for m in a.models:
        for rep in range(a.repeats):  # implementations alternate, so that a change of machine load hits both
            for impl in impls:
                if impl in ("naive_per_head", "ours_summed") and not m.startswith("scorer"):
                    continue
                cmd = [sys.executable, __file__, "--one", m, impl, "--batch", str(a.batch), "--steps", str(a.steps),
                       "--threads", str(a.threads)]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode:
                    print(f"{m} {impl}: failed\n{r.stderr[-2000:]}")
                    continue
                res = json.loads(r.stdout.strip().splitlines()[-1])
                results.setdefault((m, impl), []).append(res)
                print(f"  [{m} {impl} run {rep + 1}: {res['s_per_step']:.2f} s/step, cpu {res['cpu_s_per_step']:.2f} s]", flush=True)
        for impl in impls:
            if (m, impl) not in results:
                continue
            runs = results[(m, impl)]
            res = dict(runs[0])
            for key in ("s_per_step", "cpu_s_per_step", "decode_s"):
                if key in res:
                    res[key] = statistics.median(r[key] for r in runs)
            res["peak_rss_gb"] = max(r["peak_rss_gb"] for r in runs)
            results[(m, impl)] = res
            line = (f"{m:11s} {impl:15s} batch {a.batch:4d}: {res['s_per_step']:8.2f} s/step "
                    f"({res['steps_per_s']:.4f} steps/s, {a.batch / res['s_per_step']:6.2f} pairs/s, "
                    f"process CPU {res['cpu_s_per_step']:.2f} s/step)  peak RSS {res['peak_rss_gb']:.2f} GB")
            if "decode_s" in res:
                line += f"  greedy decode {res['decode_pairs']} pairs {res['decode_s']:.2f} s"
            print(line, flush=True)
        for ours, ref, what in (("ours", "official", "ours vs the official formulation"),
                                ("ours_summed", "official", "ours (official's summed-head matching) vs the official"),
                                ("ours", "naive_per_head", "ours vs the same per-head model computed naively")):
            if (m, ours) not in results or (m, ref) not in results:
                continue
            o, r = results[(m, ours)], results[(m, ref)]
            line = (f"{m:11s} {what}: x{r['s_per_step'] / o['s_per_step']:.2f} (train step, wall), "
                    f"x{r['cpu_s_per_step'] / o['cpu_s_per_step']:.2f} (process CPU)")
            if "decode_s" in r and "decode_s" in o:
                line += f", x{r['decode_s'] / o['decode_s']:.2f} (greedy decoding)"
            print(line + f"; peak RSS {o['peak_rss_gb']:.2f} vs {r['peak_rss_gb']:.2f} GB")
        if m in ANCHORS:
            s, gb, dec = ANCHORS[m]
            print(f"{m:11s} anchor, official code at batch 32 (performance-anchors.md): {s} s/step, {gb} GB, "
                  f"decode 32 pairs {dec} s")
            for impl in ("ours", "ours_bf16"):
                if (m, impl) in results and a.batch == 32:
                    o = results[(m, impl)]
                    print(f"{m:11s} {impl} vs the anchor: x{s / o['s_per_step']:.2f} (train step; target x3), "
                          f"x{dec / o['decode_s']:.2f} (greedy decoding), peak RSS {o['peak_rss_gb']:.2f} vs {gb} GB")


if __name__ == "__main__":
    main()
