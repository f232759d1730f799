import torch

from pipeline.engine import TrainConfig, lr_factor, train
from pipeline.models.duda import DUDA
from tests.test_duda import small_batch


def batch_fn(step):
    g = torch.Generator().manual_seed(1000 + step)  # a pure function of the step, like TrainBatches
    b = small_batch()
    for k in ("before", "after", "distractor"):
        b[k] = torch.randn(b[k].shape, generator=g)
    return b


def run(tmp, stop_after=None, log=None):
    torch.manual_seed(0)
    model = DUDA(vocab_size=12, feat_dim=16, att_hidden=32, embed_dim=8, hidden=16, dropout=0.3)
    fixed = batch_fn(999)

    def validate(m):
        with torch.no_grad():
            return -m.training_loss(fixed)[0].item(), None

    cfg = TrainConfig(iterations=20, lr=1e-2, batch_size=4, val_every=5, lr_step_epochs=2, lr_gamma=0.5)
    summary = train(model, batch_fn, validate, cfg, tmp, n_train=16, device=torch.device("cpu"),
                    identity={"test": 1}, log=log or (lambda r: None), stop_after=stop_after)
    return model, summary


def _without_time(history):
    return [{k: v for k, v in h.items() if k != "elapsed_s"} for h in history]


def test_resumed_run_equals_uninterrupted(tmp_path):
    logs_a, logs_b = [], []
    full, s_full = run(tmp_path / "a", log=logs_a.append)
    part, s_part = run(tmp_path / "b", stop_after=12, log=logs_b.append)  # interrupted after step 12; saved at 10
    assert not s_part["finished"]
    resumed, s_res = run(tmp_path / "b", log=logs_b.append)
    assert s_res["finished"]
    for (n, p), q in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(p, q), n
    assert s_res["best_step"] == s_full["best_step"]
    assert [h["val_score"] for h in s_res["history"]] == [h["val_score"] for h in s_full["history"]]
    # the logged train-loss means (loss and every part) are those of the uninterrupted run, also after resuming
    assert _without_time(s_res["history"]) == _without_time(s_full["history"])
    assert {"loss", "ce_pos", "ce_neg", "train_steps", "lr", "val_score", "elapsed_s"} <= set(s_res["history"][-1])
    events = [r.get("event") for r in logs_b if "event" in r]
    assert events == ["started", "resumed"] and logs_b[-1]["step"] == 20
    steps_b = [r["step"] for r in logs_b if "val_score" in r]
    assert steps_b == [5, 10, 15, 20]  # nothing logged twice: the interrupted session stopped before step 15
    assert _without_time([r for r in logs_b if "val_score" in r]) == _without_time([r for r in logs_a if "val_score" in r])
    a = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_logged_losses_are_means_over_the_steps_since_the_last_validation(tmp_path):
    seen = []

    class Recording(DUDA):
        def training_loss(self, batch):
            loss, parts = super().training_loss(batch)
            parts = {**parts, "odd_only": 1.0} if len(seen) % 2 else dict(parts)  # a part some steps lack
            seen.append((loss.item(), parts))
            return loss, parts

    torch.manual_seed(0)
    model = Recording(vocab_size=12, feat_dim=16, att_hidden=32, embed_dim=8, hidden=16, dropout=0.3)
    cfg = TrainConfig(iterations=7, lr=1e-2, batch_size=4, val_every=3)
    logs = []
    summary = train(model, batch_fn, lambda m: (0.5, None), cfg, tmp_path, 16, torch.device("cpu"), {"t": 1},
                    log=logs.append)
    recs = [r for r in logs if "val_score" in r]
    assert [r["step"] for r in recs] == [3, 6, 7] and [r["train_steps"] for r in recs] == [3, 3, 1]
    for rec, (lo, hi) in zip(recs, ((0, 3), (3, 6), (6, 7))):
        window = seen[lo:hi]
        assert abs(rec["loss"] - sum(w[0] for w in window) / len(window)) < 1e-12
        assert abs(rec["ce_pos"] - sum(w[1]["ce_pos"] for w in window) / len(window)) < 1e-12
        odd = [w[1]["odd_only"] for w in window if "odd_only" in w[1]]
        assert rec.get("odd_only") == (1.0 if odd else None)  # averaged over the steps that returned it
    assert recs[0]["loss"] != seen[2][0]  # not the last step's loss
    assert logs[0] == {"event": "started", "step": 0, "iterations": 7, "val_every": 3}
    assert summary["history"] == recs


def test_resume_state_of_another_configuration_is_ignored(tmp_path):
    run(tmp_path, stop_after=10)
    torch.manual_seed(0)
    model = DUDA(vocab_size=12, feat_dim=16, att_hidden=32, embed_dim=8, hidden=16)
    cfg = TrainConfig(iterations=5, lr=1e-2, batch_size=4, val_every=5)
    logs = []
    train(model, batch_fn, lambda m: (0.0, None), cfg, tmp_path, 16, torch.device("cpu"), {"test": 2}, log=logs.append)
    assert not any(r.get("event") == "resumed" for r in logs)


def test_step_schedule_decays_at_epoch_blocks():
    cfg = TrainConfig(iterations=100, lr=1.0, batch_size=4, val_every=10, lr_step_epochs=15, lr_gamma=0.1)
    spe = 265.0  # official DUDA: ~265 iterations per epoch
    assert lr_factor(0, cfg, spe) == 1.0
    assert lr_factor(int(15 * spe) - 1, cfg, spe) == 1.0
    assert abs(lr_factor(int(15 * spe) + 1, cfg, spe) - 0.1) < 1e-12
    assert abs(lr_factor(int(30 * spe) + 1, cfg, spe) - 0.01) < 1e-12


def test_linear_decay_warms_up_then_falls_to_zero_at_the_last_iteration():
    """BertAdam's warmup_linear (CLIP4IDC): 1 at the end of the warm-up, then linear to 0 at ``iterations``."""
    cfg = TrainConfig(iterations=110, lr=1.0, batch_size=4, val_every=10, warmup_steps=10, linear_decay=True)
    assert lr_factor(4, cfg, 1.0) == 0.5  # warm-up: (4 + 1) / 10
    assert lr_factor(10, cfg, 1.0) == 1.0
    assert abs(lr_factor(60, cfg, 1.0) - 0.5) < 1e-12  # half-way from step 10 to 110
    assert abs(lr_factor(109, cfg, 1.0) - 0.01) < 1e-12
    assert lr_factor(110, cfg, 1.0) == 0.0
    cfg.linear_decay = False
    assert lr_factor(60, cfg, 1.0) == 1.0


def test_resume_does_not_need_the_deleted_checkpoint(tmp_path):
    """Snakemake deletes the declared outputs of an interrupted job (checkpoint.pt) before running it again:
    the rerun still continues from resume.pt and writes the same checkpoint, byte for byte."""
    run(tmp_path / "a")
    run(tmp_path / "b", stop_after=17)  # state saved at step 15
    (tmp_path / "b" / "checkpoint.pt").unlink()
    logs = []
    _, summary = run(tmp_path / "b", log=logs.append)
    assert {"event": "resumed", "step": 15} in logs
    assert not any("ignored" in str(r.get("event")) for r in logs)
    assert summary["finished"] and [r["step"] for r in logs if "val_score" in r] == [20]
    assert (tmp_path / "b" / "checkpoint.pt").read_bytes() == (tmp_path / "a" / "checkpoint.pt").read_bytes()


def test_identical_runs_write_identical_checkpoint_bytes(tmp_path):
    # torch.save(obj, path) names the archive's records after the (random) temporary file
    run(tmp_path / "a")
    run(tmp_path / "b")
    assert (tmp_path / "a" / "checkpoint.pt").read_bytes() == (tmp_path / "b" / "checkpoint.pt").read_bytes()


def test_train_log_restarts_with_a_fresh_run_and_rewinds_to_a_resumed_step(tmp_path):
    from pipeline.engine import TrainLog
    from pipeline.utils.io import read_jsonl

    log_path = tmp_path / "train_log.jsonl"
    run(tmp_path, log=TrainLog(log_path))
    (tmp_path / "resume.pt").unlink()  # the stage deletes it once finished: the next run starts afresh
    run(tmp_path, stop_after=12, log=TrainLog(log_path))  # a dead run: validated at 5 and 10, then killed
    with open(log_path, "a") as f:  # what a kill leaves after the last saved state: a record and a cut line
        f.write('{"step": 15, "loss": 1.0, "val_score": 0.1}\n{"step": 2')
    recs = read_jsonl_lenient(log_path)
    assert [r.get("step") for r in recs if "val_score" in r] == [5, 10, 15]
    run(tmp_path, log=TrainLog(log_path))
    recs = read_jsonl(log_path)
    # one fresh start (the finished run's history is gone), the resumed session, each validation once
    assert [r.get("event") for r in recs if "event" in r] == ["started", "resumed"]
    assert [r["step"] for r in recs if "val_score" in r] == [5, 10, 15, 20]
    assert recs[3] == {"event": "resumed", "step": 10}


def read_jsonl_lenient(path):
    import json

    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def test_stale_temporaries_of_a_killed_save_are_removed(tmp_path):
    from pipeline.engine import discard_resume_state

    run(tmp_path, stop_after=12)
    # what SIGKILL during atomic saves leaves (mkstemp names), and files that only look alike
    stale = [".checkpoint.pt.k1ll_9ab.tmp", ".resume.pt.abcd1234.tmp", ".predictions_val.json.x_y_z123.tmp"]
    keep = [".checkpoint.pt.notmine.tmp", "notes.tmp", ".checkpoint.pt.gz.abcd1234.tmp"]
    for name in stale + keep:
        (tmp_path / name).write_bytes(b"partial")
    run(tmp_path)  # resumes: saves checkpoint.pt (best at resume) and resume.pt again
    from pipeline.utils.io import write_json

    write_json(tmp_path / "predictions_val.json", [])
    discard_resume_state(tmp_path)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert not set(stale) & set(left) and set(keep) <= set(left)
    assert "resume.pt" not in left and "checkpoint.pt" in left


def test_truncated_checkpoint_names_the_file(tmp_path, capsys):
    import pytest

    from pipeline.__main__ import main
    from pipeline.engine import load_checkpoint
    from pipeline.errors import PipelineError

    run(tmp_path)
    capsys.readouterr()
    ck = tmp_path / "checkpoint.pt"
    data = ck.read_bytes()
    ck.write_bytes(data[: len(data) // 2])
    with pytest.raises(PipelineError, match=f"{ck}: not a readable checkpoint"):
        load_checkpoint(ck)
    out = tmp_path / "predictions_test.json"
    assert main(["decode", "--checkpoint", str(ck), "--manifest", "m.jsonl", "--text-dir", "t", "--features", "f.h5",
                 "--split", "test", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {ck}: not a readable checkpoint") and "Traceback" not in err and not out.exists()
    # a resume state that cannot be read is only a lost head start
    (tmp_path / "resume.pt").write_bytes(b"PK\x03\x04 cut")
    logs = []
    ck.unlink()
    _, summary = run(tmp_path, log=logs.append)
    assert summary["finished"] and "unreadable" in logs[0]["event"] and logs[1]["event"] == "started"


def test_precision_chooses_the_autocast():
    import pytest

    from pipeline.engine import autocast
    from pipeline.train import parse_hparams
    from pipeline.errors import PipelineError

    cpu = torch.device("cpu")
    with autocast(cpu, "auto"):  # the default keeps fp32 on a CPU
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with autocast(cpu, "fp32"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with autocast(cpu, "bf16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="precision"):
        autocast(cpu, "fp16")
    # fast: bf16 exactly where the CPU has native bf16 products, else fp32
    from pipeline.engine import native_bf16, resolved_precision

    with autocast(cpu, "fast"):
        want = torch.bfloat16 if native_bf16(cpu) else torch.float32
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == want
    assert resolved_precision(cpu, "fast") == ("bf16" if native_bf16(cpu) else "fp32")
    assert resolved_precision(cpu, "auto") == "fp32" and resolved_precision(torch.device("cuda"), "fast") == "bf16"
    _, cfg = parse_hparams('{"train": {"iterations": 1, "lr": 1e-3, "batch_size": 2, "val_every": 1, "precision": "bf16"}}')
    assert cfg.precision == "bf16"
    with pytest.raises(PipelineError, match="precision"):
        parse_hparams('{"train": {"iterations": 1, "lr": 1e-3, "batch_size": 2, "val_every": 1, "precision": "half"}}')


def test_fast_precision_needs_the_bf16_instruction_not_onednn_emulation(monkeypatch):
    # oneDNN reports bf16 support on every AVX-512 CPU (it emulates it, ~5x slower than fp32 there): on x86 `fast`
    # must find the instruction itself
    import platform

    from pipeline.engine import native_bf16

    cpu = torch.device("cpu")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    for avx512_bf16, amx, want in ((False, False, False), (True, False, True), (False, True, True)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert native_bf16(cpu) is want, (avx512_bf16, amx)
    assert native_bf16(torch.device("cuda"))
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert not native_bf16(cpu)  # the instruction without oneDNN's kernels: no bf16 path
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert native_bf16(cpu)  # on ARM oneDNN's check is the hardware's


def test_bf16_training_on_cpu_follows_fp32():
    from pipeline.engine import autocast
    from tests.test_scorer import make, small_batch

    batch = small_batch()
    curves = {}
    for precision in ("fp32", "bf16"):
        model = make("scorer_cbr", dropout=0.0)
        opt = torch.optim.Adam(model.parameters(), 1e-3)
        curves[precision] = []
        for _ in range(30):
            with autocast(torch.device("cpu"), precision):
                loss, parts = model.training_loss(batch)
            assert loss.dtype == torch.float32 and "sim" in parts and "cbr" in parts
            opt.zero_grad()
            loss.backward()
            opt.step()
            curves[precision].append(loss.item())
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    fp32, bf16 = curves["fp32"], curves["bf16"]
    assert abs(bf16[0] - fp32[0]) < 0.02 * fp32[0]  # same start, up to bf16 rounding
    assert bf16[-1] < 0.8 * bf16[0] and abs(bf16[-1] - fp32[-1]) < 0.1 * fp32[-1]


def _select(tmp, verdicts):
    """Train 20 steps validating every 5 with scripted (score, eligible) verdicts; the selected step."""
    torch.manual_seed(0)
    model = DUDA(vocab_size=12, feat_dim=16, att_hidden=32, embed_dim=8, hidden=16, dropout=0.3)
    it = iter(verdicts)

    def validate(m):
        score, eligible = next(it)
        return score, None, eligible

    cfg = TrainConfig(iterations=20, lr=1e-2, batch_size=4, val_every=5)
    s = train(model, batch_fn, validate, cfg, tmp, n_train=16, device=torch.device("cpu"),
              identity={"test": 2}, log=lambda r: None)
    return s["best_step"], [h.get("eligible", True) for h in s["history"]]


def test_an_eligible_checkpoint_beats_a_higher_scoring_ineligible_one(tmp_path):
    # steps 5..20: the generic checkpoint at step 10 scores highest, but only 15 and 20 are eligible
    step, logged = _select(tmp_path / "a", [(0.40, False), (0.50, False), (0.45, True), (0.44, True)])
    assert step == 15 and logged == [False, False, True, True]
    # every checkpoint ineligible: the best-scoring one is still selected (a run always yields a checkpoint)
    step, _ = _select(tmp_path / "b", [(0.40, False), (0.50, False), (0.45, False), (0.44, False)])
    assert step == 10
    # every checkpoint eligible: the highest score, as without the rule
    step, _ = _select(tmp_path / "c", [(0.40, True), (0.50, True), (0.45, True), (0.44, True)])
    assert step == 10


SEEDED = """
import sys, torch
from pipeline.utils.seed import seed_everything
seed_everything(0)
print(torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
      "torch._inductor.config" in sys.modules)
"""


def test_seeding_sets_deterministic_algorithms_without_loading_inductor():
    """Every job seeds: the deterministic flag (warn-only) is on, as torch.use_deterministic_algorithms sets it, but
    without importing torch._inductor (seconds of CPU per job); where inductor is loaded its flag is set too."""
    import subprocess
    import sys

    import torch._inductor.config as inductor

    from pipeline.utils.seed import seed_everything

    out = subprocess.run([sys.executable, "-c", SEEDED], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True", "False"]  # a fresh process, as a job
    inductor.deterministic = False
    seed_everything(0)
    assert inductor.deterministic and torch.are_deterministic_algorithms_enabled()
