"""GPU check of the pipeline's CUDA paths, in one run: feature extraction, training under bf16 autocast, DDP.

    python benchmarks/bench_gpu.py --size gpu --out DIR     # on a GPU machine (a few minutes on one H200)
    python benchmarks/bench_gpu.py --size tiny --out DIR    # the same steps at toy sizes (CPU: a few minutes)

Every stage runs through the pipeline's own CLI (``python -m pipeline <stage> ...``, the commands the rules in
``rules/*.smk`` issue), with hyper-parameters taken from ``config/config.yaml`` (``run_config``, CLEVR-Change
overrides merged) and only the budgets shortened:

1. render a small synthetic CLEVR-Change world, ``manifest``, ``text``;
2. ``extract-features`` for ``resnet101_layer3`` and ``resnet101_layer4`` as configured (random weights, bf16
   autocast on CUDA), images/s on the default device, and on the CPU (all cores) for a subset as the reference;
   ``cache-pixels`` (the CLIP pixel cache); ``benchmarks/bench_features.py`` compute-only on the device;
3. ``train`` of DUDA, SCORER+CBR, DIRL+CCR, CLIP-FT, and ``adapt-clip4idc`` then CLIP4IDC from it, each a short
   budget with one validation at the end (``precision`` as configured: ``fast``, i.e. bf16 on CUDA); the
   per-step losses and step times are recorded in-process, the peak GPU memory too, and ``run.json`` is read back
   (device, precision);
4. ``train.devices: 2`` (the NCCL path): (a) as the rule runs it, (b) two processes sharing one GPU under NCCL,
   (c) the same over gloo with CUDA tensors (the gathered batch on the GPU) compared step by step with one
   process at the whole batch, (d) NCCL collectives with one process (init, the project's differentiable
   gather, all-reduce, object collectives);
5. optionally ``pytest tests/test_learns.py`` in the background during 4.

Stages run as ``python benchmarks/bench_gpu.py stage <pipeline argv>`` (the pipeline's ``main`` in-process, with
the recording hooks). Where no ``java`` is on the PATH, validation's PTB tokenisation is replaced by a plain
Python one (lower-case, punctuation dropped): the validation CIDEr-D of such a run is then not the Java
tokeniser's, and the summary says so. Results: ``DIR/bench_gpu.json`` and the printed summary.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = ["duda", "scorer_cbr", "dirl_ccr", "clip_ft"]
SIZES = {
    # n_indices of the world, (width, height), extraction image size, training steps, adaptation steps,
    # DDP steps, images of the CPU reference extraction, batch override (None: as configured)
    "gpu": dict(n_indices=400, render=(480, 320), image_size=None, steps=200, adapt_steps=60, ddp_steps=10,
                cpu_ref_pairs=32, batch=None, feat_bench=["--steps", "5", "--batch-size", "64"]),
    "tiny": dict(n_indices=30, render=(96, 64), image_size=64, steps=4, adapt_steps=2, ddp_steps=2,
                 cpu_ref_pairs=4, batch=4, feat_bench=["--steps", "1", "--warmup", "0", "--batch-size", "2",
                                                      "--image-size", "64"]),
}


# =============================================================================================== stage mode
def _python_tokenize(refs, preds):
    """Stand-in for PTBTokenizer where Java is missing: lower-case words, punctuation dropped."""
    def clean(text: str) -> str:
        return " ".join(re.sub(r"[^a-z0-9' ]+", " ", text.lower()).replace("'", " '").split())

    return ({k: [clean(c) for c in caps] for k, caps in refs.items()},
            {k: [clean(c)] for k, c in preds.items()})


def stage_main(argv: list[str]) -> int:
    """One pipeline stage in this process, with hooks: step losses and times, peak GPU memory, optional
    device sharing / backend override for the one-GPU DDP checks."""
    import torch

    stats_path = os.environ.get("BENCH_GPU_STATS")
    rank = os.environ.get("RANK", "0")
    rec: dict = {"argv": argv[:2], "rank": int(rank), "losses": [], "t": [], "notes": []}
    t_start = time.perf_counter()

    if shutil.which("java") is None or os.environ.get("BENCH_GPU_PY_TOKENIZER") == "1":
        import pipeline.evaluate as ev

        ev.tokenize = _python_tokenize
        rec["notes"].append("python tokenizer (no java)")

    from pipeline import engine

    orig_add = engine.LossMeans.add

    def add(self, loss, parts):
        rec["losses"].append(float(loss))
        rec["t"].append(time.perf_counter())
        return orig_add(self, loss, parts)

    engine.LossMeans.add = add

    if argv and argv[0] == "extract-features":  # time the extraction itself (decode + CNN + HDF5), not the build
        from pipeline.features import extract as ex

        orig_extract = ex.extract_to_hdf5

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return orig_extract(*a, **kw)
            finally:
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    torch.cuda.synchronize()
                rec["extract_s"] = round(time.perf_counter() - t0, 4)
                rec["images"] = len(a[0])

        ex.extract_to_hdf5 = timed

    if os.environ.get("BENCH_GPU_SHARE_DEVICE") == "1" and torch.cuda.is_available():
        # every process on GPU (LOCAL_RANK mod the GPU count): pipeline.distributed.setup takes cuda:LOCAL_RANK
        n = torch.cuda.device_count()
        os.environ["LOCAL_RANK"] = str(int(os.environ.get("LOCAL_RANK", "0")) % n)
        rec["notes"].append(f"LOCAL_RANK mapped modulo {n}")
    backend = os.environ.get("BENCH_GPU_BACKEND")
    if backend:
        import torch.distributed as dist

        orig_init = dist.init_process_group

        def init(*a, **kw):
            a = a[1:] if a else a
            kw["backend"] = backend
            return orig_init(*a, **kw)

        dist.init_process_group = init
        rec["notes"].append(f"backend forced to {backend}")

    def dump():
        rec["wall_s"] = round(time.perf_counter() - t_start, 2)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rec["gpu"] = torch.cuda.get_device_name()
            rec["peak_alloc_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
            rec["peak_reserved_mib"] = round(torch.cuda.max_memory_reserved() / 2**20, 1)
        t = rec.pop("t")
        dts = sorted(b - a for a, b in zip(t[1:], t[2:]))  # step 1 onwards (step 0 warms up)
        if dts:
            rec["step_s_median"] = round(dts[len(dts) // 2], 5)
            rec["step_s_min"] = round(dts[0], 5)
        if stats_path:
            p = Path(stats_path)
            p = p.with_name(f"{p.stem}.rank{rank}{p.suffix}")
            p.write_text(json.dumps(rec))

    atexit.register(dump)
    from pipeline.__main__ import main

    return main(argv)


def nccl_smoke() -> int:
    """Under torchrun (one process): NCCL init and the collectives pipeline.distributed uses, on CUDA tensors."""
    import datetime

    import torch
    import torch.distributed as dist

    from pipeline import distributed as ddp

    out: dict = {}
    t0 = time.perf_counter()
    try:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
        out["backend"] = dist.get_backend()
        out["world"] = dist.get_world_size()
        out["init_s"] = round(time.perf_counter() - t0, 2)
        x = torch.randn(8, 4, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = ddp._Gather.apply(x)  # the project's differentiable gather (all_gather / all_reduce in backward)
        (y.float() * 2).sum().backward()
        out["gather_ok"] = bool(torch.equal(y, x) and torch.allclose(x.grad.float(), torch.full((8, 4), 2.0, device="cuda")))
        r = ddp._reduced(torch.tensor([3], dtype=torch.int64))  # CPU tensor through the NCCL device
        out["reduced_ok"] = r.device.type == "cpu" and int(r) == 3
        objs = [None]
        dist.all_gather_object(objs, {"a": 1.5})
        box = [{"b": 2}] if dist.get_rank() == 0 else [None]
        dist.broadcast_object_list(box, src=0)
        out["objects_ok"] = objs == [{"a": 1.5}] and box == [{"b": 2}]
        flat = torch.ones(64 * 2**20, device="cuda")  # 256 MB fp32
        dist.all_reduce(flat)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        for _ in range(5):
            dist.all_reduce(flat)
        torch.cuda.synchronize()
        out["allreduce_256MB_ms"] = round((time.perf_counter() - t1) / 5 * 1e3, 2)
        dist.barrier()
        dist.destroy_process_group()
        out["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        out["ok"] = False
        out["error"] = f"{type(e).__name__}: {e}"[:600]
    print("NCCL_SMOKE " + json.dumps(out), flush=True)
    return 0 if out.get("ok") else 1


# =============================================================================================== orchestrator
class Runner:
    def __init__(self, work: Path, log):
        self.work, self.log = work, log
        self.env = dict(os.environ)
        extra = [str(ROOT)]
        pyc = ROOT / ".whl" / "pyc"  # pycocoevalcap's Python files carried to a machine without it
        if pyc.is_dir():
            extra.append(str(pyc))
        self.env["PYTHONPATH"] = os.pathsep.join(extra + [p for p in [self.env.get("PYTHONPATH")] if p])
        self.env["PYTHONUNBUFFERED"] = "1"

    def run(self, name: str, cmd: list[str], timeout: float = 600, env: dict | None = None) -> dict:
        """Run ``cmd`` in the repo root; its output goes to work/logs/<name>.log; returns rc, wall, output."""
        log_path = self.work / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(log_path, "w") as f:
            p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**self.env, **(env or {})},
                                 start_new_session=True)
            try:
                rc = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                rc = "timeout"
        wall = time.perf_counter() - t0
        text = log_path.read_text(errors="replace")
        self.log(f"[{name}] rc={rc} wall={wall:.1f}s")
        if rc != 0:
            self.log("    " + "\n    ".join(text.strip().splitlines()[-15:]))
        return {"rc": rc, "wall_s": round(wall, 2), "out": text}

    def stage(self, name: str, argv: list[str], timeout: float = 600, env: dict | None = None,
              torchrun: int = 0) -> dict:
        stats = self.work / "stats" / f"{name}.json"
        stats.parent.mkdir(parents=True, exist_ok=True)
        for old in stats.parent.glob(f"{name}.rank*.json"):
            old.unlink()
        head = [sys.executable]
        if torchrun:
            head += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
        res = self.run(name, head + [str(Path(__file__).resolve()), "stage", *argv], timeout,
                       {"BENCH_GPU_STATS": str(stats), **(env or {})})
        res["ranks"] = {}
        for p in sorted(stats.parent.glob(f"{name}.rank*.json")):
            res["ranks"][p.stem.rsplit("rank", 1)[1]] = json.loads(p.read_text())
        return res


def load_config():
    import yaml

    with open(ROOT / "config" / "config.yaml") as f:
        return yaml.safe_load(f)


def hparams_for(cfg, name, steps, batch=None, val_every=None, **train):
    import copy

    from pipeline.config import run_config

    b = copy.deepcopy(run_config(cfg, "clevr_change", name))
    t = b["train"]
    t["iterations"] = steps
    t["val_every"] = val_every or steps
    if batch:
        t["batch_size"] = batch
    t.update(train)
    return b


def summarize_losses(losses: list[float]) -> dict:
    if not losses:
        return {}
    k = max(1, min(10, len(losses) // 5))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    return {"loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
            f"loss_mean_first{k}": round(first, 4), f"loss_mean_last{k}": round(last, 4),
            "falls": last < first, "steps_logged": len(losses)}


def main_run(args) -> int:
    import torch

    size = SIZES[args.size]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).resolve()
    if work.exists() and not args.keep:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    t_begin = time.perf_counter()
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    def left() -> float:
        return args.budget_s - (time.perf_counter() - t_begin)

    R = Runner(work, log)
    results: dict = {"size": args.size, "torch": torch.__version__, "cuda": torch.cuda.is_available(),
                     "java": shutil.which("java") is not None, "cores": os.cpu_count()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        results["gpu"] = {"name": p.name, "mem_gib": round(p.total_memory / 2**30, 1), "cc": f"{p.major}.{p.minor}",
                          "sms": p.multi_processor_count, "bf16": torch.cuda.is_bf16_supported(),
                          "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    log(f"bench_gpu: {json.dumps(results)}")
    cfg = load_config()
    py = sys.executable
    raw, man, text = work / "raw", work / "manifest.jsonl", work / "text"
    feats = work / "features"
    feats.mkdir(exist_ok=True)
    cores = os.cpu_count() or 1

    def save():
        results["elapsed_s"] = round(time.perf_counter() - t_begin, 1)
        (out / "bench_gpu.json").write_text(json.dumps(results, indent=1))

    # ---- 1. data
    w, h = size["render"]
    if args.n_indices:
        size["n_indices"] = args.n_indices
    r = R.run("synth", [py, "-m", "pipeline", "synth-clevr-change", "--out", str(raw), "--n-indices",
                        str(size["n_indices"]), "--seed", "0", "--split-fractions", *args.split,
                        "--workers", str(min(cores, 16)), "--width", str(w), "--height", str(h), "--no-progress"])
    n_png = sum(1 for _ in raw.rglob("*.png"))
    results["synth"] = {"rc": r["rc"], "wall_s": r["wall_s"], "images": n_png,
                        "images_per_s": round(n_png / r["wall_s"], 1)}
    r = R.run("manifest", [py, "-m", "pipeline", "manifest", "--dataset", "clevr_change", "--raw-dir",
                           str(raw / "data"), "--source", "synthetic", "--out", str(man)])
    tc = {**cfg["text"], **cfg["datasets"]["clevr_change"].get("text", {})}
    r2 = R.run("text", [py, "-m", "pipeline", "text", "--manifest", str(man), "--out-dir", str(text),
                        "--max-words", str(tc["max_words"]), "--min-count", str(tc["min_count"])])
    if r["rc"] != 0 or r2["rc"] != 0 or results["synth"]["rc"] != 0:
        save()
        log("data stages failed: stopping")
        return 1
    records = [json.loads(x) for x in man.read_text().splitlines() if x.strip()]
    results["data"] = {s: sum(1 for x in records if x["split"] == s) for s in ("train", "val", "test")}
    sub = work / "manifest_cpu_ref.jsonl"  # the CPU reference's subset: the first pairs
    sub.write_text("".join(json.dumps(x) + "\n" for x in records[:size["cpu_ref_pairs"]]))
    save()

    # ---- 2. features
    def extract(backbone: str, manifest: Path, dest: Path, device: str, name: str) -> dict:
        fc = cfg["features"][backbone]
        argv = ["extract-features", "--manifest", str(manifest), "--raw-dir", str(raw / "data"),
                "--backbone", backbone, "--weights", fc["weights"], "--shortcut", fc.get("shortcut", "strided"),
                "--pool", str(fc.get("pool", 0)), "--weights-dir", str(work / "weights"), "--no-download",
                "--batch-size", str(fc["batch_size"]), "--dtype", fc["dtype"],
                "--image-size", str(size["image_size"] or fc["image_size"]),
                "--mean", *map(str, fc["mean"]), "--std", *map(str, fc["std"]), "--seed", str(fc["seed"]),
                "--threads", "0", "--device", device, "--out", str(dest), "--no-progress"]
        res = R.stage(name, argv)
        m = re.search(r"wrote .* \((\d+) images, ([\d.]+) s\)", res["out"])
        d = {"rc": res["rc"], "wall_s": res["wall_s"]}
        m2 = re.search(r"device (\S+), batch (\d+), (\d+) threads, (\d+) decode workers", res["out"])
        if m2:
            d.update(device=m2.group(1), batch=int(m2.group(2)), threads=int(m2.group(3)), workers=int(m2.group(4)))
        if m:
            n, dt = int(m.group(1)), float(m.group(2))
            d.update(images=n, extract_s=dt, images_per_s=round(n / max(dt, 1e-9), 1))
        rk = res["ranks"].get("0", {})
        if "peak_alloc_mib" in rk:
            d["peak_alloc_mib"] = rk["peak_alloc_mib"]
        if rk.get("extract_s"):  # the in-process timer (the stage prints one decimal only)
            d.update(images=rk["images"], extract_s=rk["extract_s"],
                     images_per_s=round(rk["images"] / rk["extract_s"], 1))
        return d

    results["features"] = {}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for bb in ("resnet101_layer3", "resnet101_layer4"):
        results["features"][bb] = {dev: extract(bb, man, feats / f"{bb}.h5", "auto", f"extract_{bb}")}
        if dev == "cuda":
            results["features"][bb]["cpu_ref"] = extract(bb, man if args.cpu_ref_full else sub,
                                                         work / f"cpu_ref_{bb}.h5", "cpu", f"extract_{bb}_cpu")
            g, c = results["features"][bb]["cuda"], results["features"][bb]["cpu_ref"]
            if g.get("images_per_s") and c.get("images_per_s"):
                results["features"][bb]["gpu_over_cpu"] = round(g["images_per_s"] / c["images_per_s"], 1)
        save()
    # bf16 against fp32 on the same images: only with the whole manifest on both devices (BatchNorm is calibrated on
    # the manifest's images, so a subset's features are another network's; the H200's first run compared those).
    if dev == "cuda" and args.cpu_ref_full:
        import h5py
        import numpy as np

        for bb in ("resnet101_layer3", "resnet101_layer4"):  # the same images on both devices: bf16 vs fp32
            try:
                with h5py.File(feats / f"{bb}.h5") as fg, h5py.File(work / f"cpu_ref_{bb}.h5") as fc_:
                    kg = [k.decode() if isinstance(k, bytes) else k for k in fg["keys"][:]]
                    kc = [k.decode() if isinstance(k, bytes) else k for k in fc_["keys"][:]]
                    idx = [kg.index(k) for k in kc]
                    a = np.asarray(fg["features"][sorted(idx)], np.float32)[np.argsort(np.argsort(idx))]
                    b = np.asarray(fc_["features"][:], np.float32)
                    results["features"][bb]["cuda_vs_cpu"] = {
                        "max_abs": float(np.abs(a - b).max()), "mean_abs": float(np.abs(a - b).mean()),
                        "mean": float(np.abs(b).mean()),
                        "cos": float((a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum()))}
            except Exception as e:  # noqa: BLE001
                results["features"][bb]["cuda_vs_cpu"] = f"{type(e).__name__}: {e}"
    r = R.run("cache_pixels", [py, "-m", "pipeline", "cache-pixels", "--manifest", str(man), "--raw-dir",
                               str(raw / "data"), "--out", str(feats / "clip_pixels224.h5"), "--workers",
                               str(min(cores, 16)), "--no-progress"])
    results["features"]["clip_pixels224"] = {"rc": r["rc"], "wall_s": r["wall_s"], "images": len(
        {k for x in records for k in (x["before"], x["after"]) if k})}
    if r["rc"] == 0:
        results["features"]["clip_pixels224"]["images_per_s_wall"] = round(
            results["features"]["clip_pixels224"]["images"] / r["wall_s"], 1)
    if args.feature_bench:
        fb = work / "bench_features.json"
        r = R.run("bench_features", [py, "benchmarks/bench_features.py", "--device", dev, "--json", str(fb),
                                     *size["feat_bench"]])
        results["bench_features"] = json.loads(fb.read_text()) if fb.exists() else {"rc": r["rc"]}
    save()

    # ---- 3. training
    def train(name: str, method: str, hp: dict, init: Path | None = None, stage: str = "train",
              torchrun: int = 0, env: dict | None = None, timeout: float = 600) -> dict:
        bb = hp.get("backbone", "clip_pixels224")
        run_dir = work / "runs" / name
        if run_dir.exists():
            shutil.rmtree(run_dir)
        argv = [stage, *(["--method", method] if stage == "train" else ["--name", method]),
                "--dataset", "clevr_change", "--seed", "0", "--hparams", json.dumps(hp),
                "--manifest", str(man), "--text-dir", str(text), "--features", str(feats / f"{bb}.h5"),
                "--run-dir", str(run_dir), "--threads", "1", *(["--init", str(init)] if init else [])]
        res = R.stage(name, argv, timeout=timeout, env=env, torchrun=torchrun)
        d = {"rc": res["rc"], "wall_s": res["wall_s"], "steps": hp["train"]["iterations"],
             "batch": hp["train"]["batch_size"], "config_precision": hp["train"].get("precision", "auto")}
        rk = res["ranks"].get("0", {})
        d.update({k: rk[k] for k in ("step_s_median", "step_s_min", "peak_alloc_mib", "peak_reserved_mib", "notes")
                  if k in rk})
        d.update(summarize_losses(rk.get("losses", [])))
        d["_losses"] = rk.get("losses", [])
        if (run_dir / "run.json").exists():
            rj = json.loads((run_dir / "run.json").read_text())
            d["run_json"] = {k: rj.get(k) for k in ("device", "devices", "precision", "steps_per_s", "train_seconds",
                                                    "val_CIDEr", "selected_step") if k in rj}
            if stage != "train":
                d["run_json"].update({k: v for k, v in rj.items() if "val" in k and not isinstance(v, (dict, list))})
        return d

    results["train"] = {}
    for m in METHODS if args.train else []:
        if left() < 60:
            log(f"budget: skipping {m}")
            continue
        results["train"][m] = train(m, m, hparams_for(cfg, m, size["steps"], size["batch"]))
        results["train"][m].pop("_losses")
        save()
    if left() > 60 and args.train:
        hp = hparams_for(cfg, "clip4idc_adapt", size["adapt_steps"], size["batch"])
        results["train"]["clip4idc_adapt"] = a = train("clip4idc_adapt", "clip4idc_adapt", hp, stage="adapt-clip4idc")
        a.pop("_losses")
        ck = work / "runs" / "clip4idc_adapt" / "checkpoint.pt"
        if ck.exists():
            results["train"]["clip4idc"] = train("clip4idc", "clip4idc", hparams_for(cfg, "clip4idc", size["steps"],
                                                                                      size["batch"]), init=ck)
            results["train"]["clip4idc"].pop("_losses")
        save()

    # ---- 4. DDP / NCCL (+ pytest in the background: these timings do not matter)
    pytest_proc = None
    if args.pytest and left() > 120:
        pytest_log = open(work / "logs" / "pytest_learns.log", "w")
        cmd = [py, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/test_learns.py"]
        if args.pytest_workers > 1:
            cmd += ["-n", str(args.pytest_workers)]
        pytest_proc = subprocess.Popen(["timeout", str(int(min(args.pytest_timeout, left() - 30))), *cmd], cwd=ROOT,
                                       stdout=pytest_log, stderr=subprocess.STDOUT, env=R.env, start_new_session=True)
        pytest_t0 = time.perf_counter()
    ddp: dict = {}
    results["ddp"] = ddp
    n_steps = size["ddp_steps"]
    # (a) as Snakemake runs it: python -m pipeline train with train.devices: 2 (relaunches itself under torchrun)
    hp2 = hparams_for(cfg, "dirl_ccr", n_steps, 16, devices=2)
    run_dir = work / "runs" / "ddp_cli"
    r = R.run("ddp_cli_devices2", [py, "-m", "pipeline", "train", "--method", "dirl_ccr", "--dataset", "clevr_change",
                                   "--seed", "0", "--hparams", json.dumps(hp2), "--manifest", str(man), "--text-dir",
                                   str(text), "--features", str(feats / "resnet101_layer3.h5"), "--run-dir",
                                   str(run_dir), "--threads", "2"], timeout=150)
    errs = [x for x in r["out"].splitlines() if re.search(r"Error|error:|NCCL WARN|invalid device", x)]
    ddp["a_cli_devices2"] = {"rc": r["rc"], "wall_s": r["wall_s"], "errors": errs[-6:]}
    if (run_dir / "run.json").exists():
        ddp["a_cli_devices2"]["run_json"] = {k: v for k, v in json.loads((run_dir / "run.json").read_text()).items()
                                             if k in ("device", "devices", "precision")}
    if dev == "cuda":
        # (b) two NCCL processes on the one GPU (set_device mapped modulo the GPU count)
        r = train("ddp_nccl_shared", "dirl_ccr", hp2, torchrun=2, env={"BENCH_GPU_SHARE_DEVICE": "1"}, timeout=150)
        out_b = (work / "logs" / "ddp_nccl_shared.log").read_text(errors="replace")
        r.pop("_losses")
        r["errors"] = [x for x in out_b.splitlines() if re.search(r"Error|error:|NCCL WARN|Duplicate", x)][-6:]
        ddp["b_nccl_two_procs_one_gpu"] = r
        # (d) NCCL collectives, one process
        res = R.run("nccl_smoke", [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                                   str(Path(__file__).resolve()), "nccl-smoke"], timeout=120)
        m = re.search(r"NCCL_SMOKE (\{.*\})", res["out"])
        ddp["d_nccl_one_proc"] = json.loads(m.group(1)) if m else {"rc": res["rc"], "tail": res["out"][-800:]}
    # (c) two processes, gloo backend (CUDA tensors on the GPU when there is one) vs one process, whole batch;
    # dropout off so that the two runs compute the same steps (pipeline/distributed.py: masks are per process)
    comp: dict = {}
    for m, prec in (("dirl_ccr", "fp32"), ("dirl_ccr", "fast"), ("duda", "fast")):
        if left() < 60:
            break
        hp1 = hparams_for(cfg, m, n_steps, 16, precision=prec)
        hp1["model"]["dropout"] = 0.0
        one = train(f"ddp_ref_{m}_{prec}", m, hp1)
        hpn = json.loads(json.dumps(hp1))
        hpn["train"]["devices"] = 2
        two = train(f"ddp_gloo_{m}_{prec}", m, hpn, torchrun=2, env={"BENCH_GPU_SHARE_DEVICE": "1",
                                                                     "BENCH_GPU_BACKEND": "gloo"}, timeout=150)
        la, lb = one.pop("_losses"), two.pop("_losses")
        rel = [abs(x - y) / max(abs(x), 1e-12) for x, y in zip(la, lb)]
        comp[f"{m}_{prec}"] = {"one_proc": {k: one.get(k) for k in ("rc", "step_s_median", "run_json")},
                               "two_procs": {k: two.get(k) for k in ("rc", "step_s_median", "run_json", "notes")},
                               "losses_1proc": [round(x, 5) for x in la], "losses_2proc": [round(x, 5) for x in lb],
                               "max_rel_loss_diff": max(rel) if rel and len(la) == len(lb) else None}
        save()
    ddp["c_gloo_two_procs_vs_one"] = comp
    save()
    if pytest_proc is not None:
        try:
            rc = pytest_proc.wait(timeout=max(5, left() - 5))
        except subprocess.TimeoutExpired:
            os.killpg(pytest_proc.pid, signal.SIGTERM)
            rc = "killed (budget)"
        tail = (work / "logs" / "pytest_learns.log").read_text(errors="replace").strip().splitlines()[-12:]
        results["pytest_test_learns"] = {"rc": rc, "wall_s": round(time.perf_counter() - pytest_t0, 1), "tail": tail}
        log("[pytest test_learns] rc=" + str(rc) + "\n    " + "\n    ".join(tail))
    save()

    # ---- summary
    log("\n==== summary ====")
    log(json.dumps(results, indent=1)[:20000])
    if args.archive:
        subprocess.run(
            ["tar", "czf", str(out / "bench_gpu_logs.tar.gz"), "-C", str(work), "logs", "stats",
             *[str(p.relative_to(work)) for p in (work / "runs").glob("*/*.json*")]], check=False)
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="gpu")
    p.add_argument("--work", default="/tmp/bench_gpu_work", help="scratch folder (emptied first)")
    p.add_argument("--out", default="/tmp/bench_gpu_out", help="where bench_gpu.json (and the log archive) go")
    p.add_argument("--split", nargs=3, default=["0.6", "0.2", "0.2"], help="train/val/test fractions of the world")
    p.add_argument("--keep", action="store_true", help="do not empty --work first")
    p.add_argument("--budget-s", type=float, default=360, help="skip optional steps when less than a minute is left")
    p.add_argument("--pytest", action="store_true", help="run tests/test_learns.py in the background during the DDP part")
    p.add_argument("--pytest-workers", type=int, default=0, help="pytest-xdist workers (0: none)")
    p.add_argument("--pytest-timeout", type=float, default=200)
    p.add_argument("--n-indices", type=int, default=0, help="world size (0: the --size default)")
    p.add_argument("--no-train", dest="train", action="store_false", help="skip part 3 (the single-process runs)")
    p.add_argument("--cpu-ref-full", action="store_true",
                   help="CPU reference extraction on the whole manifest (same calibration images as the GPU run, "
                        "so the features compare bf16 against fp32 alone); default: the first pairs only")
    p.add_argument("--no-feature-bench", dest="feature_bench", action="store_false")
    p.add_argument("--archive", action="store_true", help="also write bench_gpu_logs.tar.gz (logs, run.json) to --out")
    return p.parse_args(argv)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "stage":
        sys.exit(stage_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "nccl-smoke":
        sys.exit(nccl_smoke())
    sys.exit(main_run(parse_args()))
