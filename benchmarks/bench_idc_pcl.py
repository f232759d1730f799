"""IDC-PCL pre-training and fine-tuning step times at batch 32, next to the official computation measured in the
same run, and greedy decoding of 32 pairs.

Anchors (shared/reference/performance-anchors.md, the official code on this machine kind, batch 32):
pre-training 5.3 s per step (MLM:MVCL:FDA = 8:1:2 mix), fine-tuning 6.1 s per step, greedy decoding of
32 pairs 7.0 s. Target: steps at least 1.5x faster than the official code at the same batch and shapes.

``OfficialStyle`` re-expresses what the official ``modules_pretrain.py`` / ``modules_finetune.py`` compute,
from reading them (it is not their code, which needs CUDA and torch 1.9): separate q/k/v projections, a
hand-written LayerNorm (std), attention with a 0/1 mask materialised per batch and ``masked_fill(-1e9)``,
``nn.Dropout`` on embeddings, attention probabilities, the FFN's hidden layer and both residual branches,
captions padded to ``max_len`` 40, MVCL features predicted at every cell (negatives: the unmasked cells'
predictions), FDA images encoded once per pair and repeated 7x into the cross-modal encoder, greedy decoding
that re-runs all caption tokens at each of its 39 steps. Same sizes as ours: 49x2048 grid features per image,
hidden 512, 8 heads, FFN 2048, 1 + 1 + 3 layers, dropout 0.2.

Batch 32 means 32 captioned pairs for both: ours as 16 index triplets (each a changed and a distractor pair
sharing the before image: the pipeline's batches), the official as 32 independent rows; pre-training
MLM/MVCL 32 rows, FDA 32 // 7 = 4 pairs x 7 captions. Caption lengths are drawn like CLEVR-Change's (mean
about 10.8 words). A step is forward, loss, backward and an Adam step (ours fused, as the pipeline's engine
runs it; the official's plain); steps of the two alternate so that
load on a shared machine hits both alike; medians are printed, of wall-clock time and of the CPU time the
process used (``time.process_time``, all threads): on a machine shared with other jobs the CPU-time ratio is
the steadier comparison, the wall-clock figures are what the anchors are.

    python benchmarks/bench_idc_pcl.py [--steps 3] [--threads 2]
"""

import argparse
import math
import statistics
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.models.idc_pcl import TASKS, IDCPCL
from pipeline.text import END, START

V = 80  # CLEVR-Change vocabulary (76) + the special tokens
ANCHORS = {"pretrain": 5.3, "finetune": 6.1, "decode": 7.0}


# --------------------------------------------------------------------------------- official-style model
class LN(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.a, self.b, self.eps = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d)), eps

    def forward(self, x):
        mean, std = x.mean(-1, keepdim=True), x.std(-1, keepdim=True)
        return self.a * (x - mean) / (std + self.eps) + self.b


class Layer(nn.Module):
    def __init__(self, d=512, h=8, ff=2048, p=0.2):
        super().__init__()
        self.h = h
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.n1, self.n2 = LN(d), LN(d)
        self.w1, self.w2 = nn.Linear(d, ff), nn.Linear(ff, d)
        self.d_att, self.d_res1, self.d_ff, self.d_res2 = (nn.Dropout(p) for _ in range(4))

    def split(self, x):
        return x.view(x.size(0), -1, self.h, x.size(-1) // self.h).transpose(1, 2)

    def attn(self, x, mask, cache):
        k, v = self.split(self.k(x)), self.split(self.v(x))
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            else:
                cache["k"], cache["v"] = k, v
        q = self.split(self.q(x))
        s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        if mask is not None:
            s = s.masked_fill(mask.unsqueeze(1) == 0, -1e9)
        a = self.d_att(F.softmax(s, -1)) @ v
        return self.o(a.transpose(1, 2).contiguous().view(x.size(0), -1, x.size(-1)))

    def forward(self, x, mask=None, cache=None):
        x = x + self.d_res1(self.attn(self.n1(x), mask, cache))
        return x + self.d_res2(self.w2(self.d_ff(F.relu(self.w1(self.n2(x))))))


class Encoder(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.norm, self.layers = LN(512), nn.ModuleList(Layer() for _ in range(n))

    def forward(self, x, mask=None, caches=None):
        x = self.norm(x)
        for i, layer in enumerate(self.layers):
            x = layer(x, mask, None if caches is None else caches[i])
        return x


class OfficialStyle(nn.Module):
    def __init__(self, vocab=V, feat=2048, d=512, max_len=40):
        super().__init__()
        self.d, self.max_len, self.cls, self.mask = d, max_len, 5, 4
        self.word = nn.Embedding(vocab, d)
        self.proj = nn.Sequential(nn.Linear(feat, d), nn.Sigmoid())
        self.type_pe = nn.Embedding(7, d)
        self.pe_norm, self.pe_drop = LN(d, 1e-12), nn.Dropout(0.2)
        pe = torch.zeros(200, d)
        pos = torch.arange(200.0).unsqueeze(1)
        i = torch.arange(0, d, 2.0)
        pe[:, 0::2] = torch.sin(pos / 10000 ** (2 * i / d))
        pe[:, 1::2] = torch.cos(pos / 10000 ** (2 * (i + 1) / d))
        self.register_buffer("pe", pe.unsqueeze(0))
        self.single_enc, self.pair_enc, self.encoder = Encoder(1), Encoder(1), Encoder(3)
        self.output = nn.Linear(d, vocab)
        self.pooler = nn.Linear(2 * d, 2)
        self.regress = nn.Sequential(nn.Linear(d, d), nn.GELU(), LN(d, 1e-12))
        self.regress_bias = nn.Parameter(torch.zeros(feat))

    def position(self, x, kind, pos=True):
        t = self.type_pe(torch.full(x.shape[:2], kind, dtype=torch.long))
        if kind == 6:
            x = x * math.sqrt(self.d)
        x = x + t + (self.pe[:, : x.size(1)] if pos else 0)
        return self.pe_drop(self.pe_norm(x))

    def images(self, img1, img2):
        b = img1.size(0)
        cls = self.word(torch.full((b, 1), self.cls, dtype=torch.long))
        e1 = torch.cat([self.position(cls, 1, False), self.position(self.proj(img1), 2)], 1)
        e2 = torch.cat([self.position(cls, 3, False), self.position(self.proj(img2), 4)], 1)
        return self.pair_enc(torch.cat([self.single_enc(e1), self.single_enc(e2)], 1)), cls

    def finetune_loss(self, b):
        v, _ = self.images(b["img1"], b["img2"])
        cap, lab = b["cap"], b["cap_label"]
        x = torch.cat([v, self.position(self.word(cap), 6)], 1)
        n_img, n_cap = v.size(1), cap.size(1)
        m = np.zeros((cap.size(0), n_img + n_cap, n_img + n_cap))
        m[:, :, :n_img] = 1
        m[:, n_img:, n_img:] = np.tril(np.ones((n_cap, n_cap)))
        out = self.encoder(x, torch.from_numpy(m.astype("uint8")))
        text = out[:, n_img:]
        mlm = F.cross_entropy(self.output(text[lab != -1]), lab[lab != -1])
        dj = F.cross_entropy(self.pooler(torch.cat([out[:, 0], out[:, n_img // 2]], 1)), b["diff_label"])
        return mlm + dj

    def pretrain_loss(self, b, task):
        v, cls = self.images(b["img1"], b["img2"])
        cls3 = self.position(cls, 5, False)
        if task == "fda":
            caps = b["caps"]
            p, k, length = caps.shape
            t = self.position(self.word(caps.view(-1, length)), 6)
            t = torch.cat([cls3.repeat(k, 1, 1), t], 1)
            v = v.repeat(1, k, 1).view(-1, v.size(1), v.size(2))
            out = self.encoder(torch.cat([v, t], 1))
            img = F.normalize((out[:, 0] + out[:, 50]) / 2, dim=1)
            txt = F.normalize(out[:, v.size(1)], dim=1)
            sim = torch.diag(img @ txt.t()).view(p, k)
            return F.cross_entropy(sim, torch.zeros(p, dtype=torch.long))
        t = self.position(self.word(b["cap"]), 6)
        out = self.encoder(torch.cat([v, cls3, t], 1))
        if task == "mlm":
            text, lab = out[:, 101:], b["cap_label"]
            return F.cross_entropy(self.output(text[lab != -1]), lab[lab != -1])
        img = torch.cat([out[:, 1:50], out[:, 51:100]], 1)
        mask = b["img_mask"]
        pred = self.regress(img[mask]) @ self.proj[0].weight + self.regress_bias
        neg = self.regress(img[~mask]) @ self.proj[0].weight + self.regress_bias
        target = b["img_label"][mask]
        pred, target, neg = F.normalize(pred, dim=1), F.normalize(target, dim=1), F.normalize(neg, dim=1)
        logits = torch.cat([pred @ target.t(), pred @ neg.t()], 1)
        return F.cross_entropy(logits, torch.arange(pred.size(0)))

    @torch.no_grad()
    def greedy(self, img1, img2):
        v, _ = self.images(img1, img2)
        caches = [{} for _ in self.encoder.layers]
        self.encoder(v, caches=caches)
        b = img1.size(0)
        gen = torch.full((b, 1), 1, dtype=torch.long)
        for i in range(1, self.max_len):
            des = torch.cat([gen, torch.full((b, 1), self.mask, dtype=torch.long)], 1)
            t = self.position(self.word(des), 6)
            m = np.zeros((b, i + 1, 100 + i + 1))
            m[:, :, :100] = 1
            m[:, :, 100:] = np.tril(np.ones((i + 1, i + 1)))
            out = self.encoder(t, torch.from_numpy(m.astype("uint8")), caches)
            gen = torch.cat([gen, self.output(out[:, -1]).argmax(-1, keepdim=True)], 1)
        return gen


# ------------------------------------------------------------------------------------------- batches
def caption_lengths(g, n):
    return torch.clamp(torch.round(torch.randn(n, generator=g) * 2.5 + 10.8), 5, 21).long()


def ours_labels(g, n, width=24):
    x = torch.zeros(n, width, dtype=torch.long)
    for i, k in enumerate(caption_lengths(g, n).tolist()):
        x[i, 0] = START
        x[i, 1:k + 1] = torch.randint(4, V - 4, (k,), generator=g)
        x[i, k + 1] = END
    return x


def official_caps(g, n, max_len=40):
    cap = torch.zeros(n, max_len, dtype=torch.long)
    lab = torch.full((n, max_len), -1, dtype=torch.long)
    for i, k in enumerate(caption_lengths(g, n).tolist()):
        cap[i, 0] = 1
        cap[i, 1:k + 1] = torch.randint(6, V, (k,), generator=g)
        cap[i, k + 1] = 2
        m = torch.rand(k + 1, generator=g) < 0.15
        m[0] = True
        lab[i, 1:k + 2][m] = cap[i, 1:k + 2][m]
        cap[i, 1:k + 2][m] = 4
    return cap, lab


def batches(g):
    grid = lambda n: torch.randn(n, 49, 2048, generator=g).abs()  # noqa: E731 (post-ReLU features)
    as_map = lambda x: x.transpose(1, 2).reshape(x.size(0), 2048, 7, 7)  # noqa: E731
    ours = {
        "finetune": {"before": as_map(grid(16)), "after": as_map(grid(16)), "distractor": as_map(grid(16)),
                     "labels": ours_labels(g, 16), "distractor_labels": ours_labels(g, 16)},
        "mlm": {"task": torch.tensor(0), "img1": as_map(grid(32)), "img2": as_map(grid(32)), "text": ours_labels(g, 32)},
        "mvcl": {"task": torch.tensor(1), "img1": as_map(grid(32)), "img2": as_map(grid(32)), "text": ours_labels(g, 32)},
        "fda": {"task": torch.tensor(2), "img1": as_map(grid(4)), "img2": as_map(grid(4)),
                "text": ours_labels(g, 28).view(4, 7, -1)},
    }
    cap, lab = official_caps(g, 32)
    off = {"finetune": {"img1": grid(32), "img2": grid(32), "cap": cap, "cap_label": lab,
                        "diff_label": torch.randint(0, 2, (32,), generator=g)}}
    cap, lab = official_caps(g, 32)
    off["mlm"] = {"img1": grid(32), "img2": grid(32), "cap": cap, "cap_label": lab}
    img1, img2 = grid(32), grid(32)
    mask = torch.rand(32, 98, generator=g) < 0.15
    mask[:, 0] = True
    label = torch.cat([img1, img2], 1)
    img1, img2 = img1.masked_fill(mask[:, :49, None], 0), img2.masked_fill(mask[:, 49:, None], 0)
    off["mvcl"] = {"img1": img1, "img2": img2, "cap": official_caps(g, 32)[0], "img_mask": mask, "img_label": label}
    off["fda"] = {"img1": grid(4), "img2": grid(4), "caps": official_caps(g, 28)[0].view(4, 7, -1)}
    return ours, off


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="timed steps per task and implementation (after 1 warm-up)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    ours_b, off_b = batches(g)
    ours, off = IDCPCL(vocab_size=V), OfficialStyle()
    # ours with the optimiser options the pipeline's engine gives it (fused Adam); the official: plain Adam
    opt_o = torch.optim.Adam(ours.parameters(), 1e-4, **IDCPCL.optimizer_options)
    opt_f = torch.optim.Adam(off.parameters(), 1e-4)
    times = {(impl, task): [] for impl in ("ours", "official") for task in ("finetune", *TASKS)}
    cpu = {k: [] for k in times}

    def step(model, opt, fn):
        t, c = time.perf_counter(), time.process_time()
        loss = fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - t, time.process_time() - c

    for task in ("finetune", *TASKS):
        fo = (lambda: ours.training_loss(ours_b[task])[0])
        ff = (lambda: off.finetune_loss(off_b[task])) if task == "finetune" else (lambda: off.pretrain_loss(off_b[task], task))
        for i in range(args.steps + 1):  # alternate, first of each is a warm-up
            (a, ca), (b, cb) = step(ours, opt_o, fo), step(off, opt_f, ff)
            if i:
                times["ours", task].append(a)
                times["official", task].append(b)
                cpu["ours", task].append(ca)
                cpu["official", task].append(cb)
        med = {k: statistics.median(v) for k, v in times.items() if k[1] == task}
        cmed = {k: statistics.median(v) for k, v in cpu.items() if k[1] == task}
        print(f"{task:9s} step: ours {med['ours', task]:.2f} s, official-style {med['official', task]:.2f} s, "
              f"ratio {med['official', task] / med['ours', task]:.2f}x (CPU time {cmed['ours', task]:.2f} vs "
              f"{cmed['official', task]:.2f} s, {cmed['official', task] / cmed['ours', task]:.2f}x)", flush=True)
    mix = {"mlm": 8, "mvcl": 1, "fda": 2}
    for label, tab in (("wall", times), ("CPU", cpu)):
        med = {k: statistics.median(v) for k, v in tab.items()}
        pre = {impl: sum(mix[t] * med[impl, t] for t in TASKS) / 11 for impl in ("ours", "official")}
        ft = {impl: med[impl, "finetune"] for impl in ("ours", "official")}
        anchor = (lambda a, x: f"; anchor {a} s -> {a / x:.2f}x") if label == "wall" else (lambda a, x: "")
        print(f"[{label}] pre-training step (8:1:2 mix): ours {pre['ours']:.2f} s, official-style {pre['official']:.2f} s"
              f" -> {pre['official'] / pre['ours']:.2f}x{anchor(ANCHORS['pretrain'], pre['ours'])} (target >= 1.5x)")
        print(f"[{label}] fine-tuning step (32 captioned pairs): ours {ft['ours']:.2f} s, official-style "
              f"{ft['official']:.2f} s -> {ft['official'] / ft['ours']:.2f}x{anchor(ANCHORS['finetune'], ft['ours'])} "
              f"(target >= 1.5x)")
    ours.eval(), off.eval()
    b = ours_b["finetune"]
    before, after = torch.cat([b["before"], b["before"]]), torch.cat([b["after"], b["distractor"]])
    t = time.perf_counter()
    ours.generate(before, after, 24)
    t_o = time.perf_counter() - t
    t = time.perf_counter()
    off.greedy(off_b["finetune"]["img1"], off_b["finetune"]["img2"])
    t_f = time.perf_counter() - t
    print(f"greedy decoding, 32 pairs: ours {t_o:.2f} s, official-style {t_f:.2f} s ({t_f / t_o:.1f}x); "
          f"anchor {ANCHORS['decode']} s ({ANCHORS['decode'] / t_o:.1f}x)")


if __name__ == "__main__":
    main()
