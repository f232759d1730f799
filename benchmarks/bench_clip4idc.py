"""CLIP4IDC throughput: captioning training step, adaptation training step, greedy decoding.

By default it times the embedded default's models, built from ``config/config.yaml`` (``methods.clip4idc`` and
``pretraining.clip4idc_adapt``: the small from-scratch ViT the CPU job trains); ``--paper-shape`` times the
full CLIP ViT-B/32 (random weights, same FLOPs as OpenAI's) with the paper's captioner, the shape the
official-code anchors below were measured with.

A training "pair" is one item of a batch as the official ``main_task_caption.py`` counts it: a before image with
its semantic and distractor after images and their two captions. The anchor (shared/reference/performance-
anchors.md, official CLIP4IDC captioning on this machine kind, fp32, batch 32): 45.9 s/step = 0.70 pairs/s;
greedy decoding of 32 pairs 42.8 s (the official decoder re-runs CLIP and the decoder for each of the 32 steps).
Here decoding runs the full 32 steps too (``<END>`` is suppressed), so early stopping gives no advantage.

On CUDA the model runs under bf16 autocast, as the training engine does.

    python benchmarks/bench_clip4idc.py [--batch 16] [--steps 2] [--threads 2] [--device auto] [--paper-shape]
"""

import argparse
import os
import statistics
import time

import torch
import yaml

from pipeline.models.clip4idc import CLIP4IDC, CLIP4IDCAdapt
from pipeline.text import END, START

ANCHOR_PAIRS_PER_S = 0.70
ANCHOR_DECODE_32_S = 42.8


def default_hparams(config="config/config.yaml"):
    """The captioner's and the adaptation's model blocks of the embedded default (``weights`` dropped: random)."""
    cfg = yaml.safe_load(open(config))
    drop = ("weights", "weights_dir", "text_tokens", "text_length", "bpe_vocab")
    cap = {k: v for k, v in cfg["methods"]["clip4idc"]["model"].items() if k not in drop}
    adapt = {k: v for k, v in cfg["pretraining"]["clip4idc_adapt"]["model"].items() if k not in drop}
    return cap, adapt


def make_batch(b, device, vocab=80, length=24):
    g = torch.Generator().manual_seed(0)
    lab = torch.randint(4, vocab, (2, b, length), generator=g)
    lab[:, :, 0] = START
    lab[:, :, 16] = END
    lab[:, :, 17:] = 0
    px = lambda: torch.randint(0, 256, (b, 3, 224, 224), generator=g).float()  # noqa: E731
    batch = {"before": px(), "after": px(), "distractor": px(), "labels": lab[0], "distractor_labels": lab[1], "text": lab[0]}
    return {k: v.to(device) for k, v in batch.items()}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)


def time_steps(model, batch, steps, device):
    """Median wall seconds and process CPU seconds per step (CPU time stays meaningful on a shared machine)."""
    model.train()
    opt = torch.optim.Adam(model.param_groups(1e-4), **model.optimizer_options)  # as pipeline.engine builds it
    times, cpu = [], []
    for i in range(steps + 1):
        sync(device)
        t, c = time.perf_counter(), time.process_time()
        with autocast(device):
            loss = model.training_loss(batch)[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync(device)
        if i:  # the first step is warm-up
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
    return statistics.median(times), statistics.median(cpu)


def time_cache(a, device):
    """The frozen-encoder cache (``encoder_cache_mb``) side by side with recomputing the ViT every step, on
    CLEVR-Change's resolved clip_ft block and uint8 pixels as the pipeline feeds them (warm cache: the steps
    after the first epoch)."""
    from pipeline.config import load, run_config

    hp = {k: v for k, v in run_config(load(a.config), "clevr_change", "clip_ft")["model"].items()
          if k not in ("weights", "weights_dir")}
    if not hp.get("encoder_cache_mb"):
        return
    batch = {k: (v.to(torch.uint8) if k in ("before", "after", "distractor") else v)
             for k, v in make_batch(a.batch, device).items()}
    out = {}
    for cached in (False, True):
        torch.manual_seed(0)
        model = CLIP4IDC(vocab_size=80, **{**hp, "encoder_cache_mb": hp["encoder_cache_mb"] if cached else 0}).to(device)
        out[cached] = time_steps(model, batch, a.steps, device)
    print(f"clip_ft on CLEVR-Change (frozen ViT): {out[True][0]:.3f} s/step with the intra output cached, "
          f"{out[False][0]:.3f} s/step recomputed: {out[False][0] / out[True][0]:.2f}x{load_note(device)}")


def load_note(device):
    if device.type == "cuda":
        return ""
    return f" [load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores]"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--decode-pairs", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--paper-shape", action="store_true", help="full ViT-B/32 and the paper's captioner")
    ap.add_argument("--config", default="config/config.yaml")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if a.device == "auto" else a.device))
    torch.manual_seed(0)
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else f'{torch.get_num_threads()} threads'}), "
          f"{'bf16 autocast' if device.type == 'cuda' else 'fp32'}, batch {a.batch}, median of {a.steps} steps after 1 warm-up")

    cap_hp, adapt_hp = ({}, {}) if a.paper_shape else default_hparams(a.config)
    print("shape:", "ViT-B/32 (paper)" if a.paper_shape else f"{a.config}: clip4idc {cap_hp}")
    model = CLIP4IDC(vocab_size=80, **cap_hp).to(device)
    batch = make_batch(a.batch, device)
    s, c = time_steps(model, batch, a.steps, device)
    anchor = (f" (official anchor, ViT-B/32, CPU fp32 batch 32: {ANCHOR_PAIRS_PER_S} pairs/s; ratio "
              f"{a.batch / s / ANCHOR_PAIRS_PER_S:.2f}x)") if a.paper_shape else ""
    print(f"captioning train step: {s:.2f} s/step, {a.batch / s:.2f} pairs/s, {c:.1f} CPU-s/step{load_note(device)}{anchor}")

    if not a.paper_shape:
        time_cache(a, device)

    model.eval()
    with torch.no_grad():
        model.captioner.decoder.head.bias[END] = -1e4  # decode all 32 steps, like the official decoder
    dec = make_batch(a.decode_pairs, device)
    with torch.no_grad(), autocast(device):
        model.generate(dec["before"][:2], dec["after"][:2], 32)  # warm-up
        sync(device)
        t = time.perf_counter()
        out = model.generate(dec["before"], dec["after"], 32)
        sync(device)
        d = time.perf_counter() - t
    assert (out > 0).all()
    anchor = (f" (official anchor for 32 pairs, ViT-B/32, CPU: {ANCHOR_DECODE_32_S} s; ratio "
              f"{ANCHOR_DECODE_32_S / d * 32 / a.decode_pairs:.1f}x)") if a.paper_shape else ""
    print(f"greedy decoding, {a.decode_pairs} pairs x 32 steps: {d:.2f} s{load_note(device)}{anchor}")
    # Side by side on this machine now: the official decoder runs CLIP on the pair at each of its 32 steps;
    # 32 image-pair encodings alone are a lower bound of its cost.
    with torch.no_grad(), autocast(device):
        sync(device)
        t = time.perf_counter()
        model.encoder(dec["before"], dec["after"])
        sync(device)
        e = time.perf_counter() - t
    print(f"  one CLIP pass over the {a.decode_pairs} pairs: {e:.2f} s; re-running it at each of 32 steps (official "
          f"decoding) would take >= {32 * e:.1f} s here, {32 * e / d:.1f}x our decoding")
    del model

    adapt = CLIP4IDCAdapt(text_vocab_size=80, eos_id=END, **adapt_hp).to(device)
    s, c = time_steps(adapt, batch, a.steps, device)
    print(f"adaptation train step: {s:.2f} s/step, {a.batch / s:.2f} pairs/s, {c:.1f} CPU-s/step{load_note(device)}")


if __name__ == "__main__":
    main()
