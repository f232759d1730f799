"""Stage ``plots``: learning curves of trained runs, read from their ``train_log.jsonl`` (matplotlib, Agg).

Two figures, each written atomically as a PNG:

- ``--method M --runs DIR... [--first-stage DIR...] --out results/<dataset>/plots/M.png``: one row of panels
  per stage (the first stage, pre-training or adaptation, named by the method's ``init_from``, then the
  method's own training): the train losses per component (means over the steps between validations) on a
  log scale; the validation score against the step with the selected step marked (captioning: greedy
  decoding, the run's selection metric x100; adaptation: retrieval R@1+R@5+R@10 of both directions;
  pre-training: its validation losses and accuracies, no selection: the last step is kept); and, where a run logs them, the non-loss diagnostics
  (accuracies, stage flags, scales). One line style per seed.
- ``--table T --runs DIR... [--sanity DIR...] --manifest M --out results/<dataset>/plots/T_val_cider.png``:
  validation score of every method of the table (the metric its runs select on: CIDEr-D, ROUGE-L on
  Birds-to-Words; the file keeps its name) against the step (log scale) and against the fraction of its
  training budget, each selected step marked, and the sanity rows' validation score (scored here on their
  ``predictions_val.json`` with the same scorer as training's validation) as horizontal lines.

A log holds every session a run directory has seen (a rerun appends to it); ``read_log`` keeps the records
of the last run: those after its last ``started`` event, with the ``resumed`` sessions spliced in.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.utils.io import atomic_path, read_json, read_jsonl

META_KEYS = {"step", "lr", "val_score", "elapsed_s", "train_steps", "event", "validation"}
# numeric parts that are not losses: plotted on a linear "diagnostics" panel, never on the log-scale loss panel
DIAGNOSTIC = re.compile(r"acc|_r1|^stage$|hard_set|scale|omega|fed|^alpha_")
LINESTYLES = ("-", "--", ":", "-.")


# --------------------------------------------------------------------------------------------------
# Logs and runs
# --------------------------------------------------------------------------------------------------
def read_log(path: str | Path) -> list[dict]:
    """The validation records of the last run logged in ``path`` (see the module docstring), in step order.

    A pre-training validation record (``{"validation": n, "val_...": ...}``, logged just before the engine's
    record of the same step) is merged into that record.
    """
    kept: list[dict] = []
    pending: dict = {}
    for rec in read_jsonl(path):
        event = rec.get("event")
        if event == "started":
            kept, pending = [], {}
        elif event == "resumed":
            kept, pending = [r for r in kept if r["step"] <= rec.get("step", 0)], {}
        elif event is not None:
            continue
        elif "step" in rec and "val_score" in rec:
            kept = [r for r in kept if r["step"] < rec["step"]]  # an older run's records from this step on
            kept.append({**pending, **rec})
            pending = {}
        elif "validation" in rec:
            pending = {k: v for k, v in rec.items() if k != "validation"}
    return kept


def _numeric(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _keys(records: list[dict], want) -> list[str]:
    keys = dict.fromkeys(k for r in records for k, v in r.items() if k not in META_KEYS and _numeric(v) and want(k))
    return list(keys)


def loss_keys(records: list[dict]) -> list[str]:
    return _keys(records, lambda k: not k.startswith("val_") and not DIAGNOSTIC.search(k))


def diagnostic_keys(records: list[dict]) -> list[str]:
    return _keys(records, lambda k: not k.startswith("val_") and bool(DIAGNOSTIC.search(k)))


def validation_keys(records: list[dict]) -> list[str]:
    return _keys(records, lambda k: k.startswith("val_"))


@dataclass
class Run:
    path: Path
    name: str
    seed: str
    stage: str  # "captioning" | "adaptation" | "pre-training"
    records: list[dict] = field(default_factory=list)
    selected_step: int | None = None
    iterations: int | None = None
    metric: str = "CIDEr"  # captioning: the validation metric it selects on (pycocoevalcap's name)

    @property
    def has_log(self) -> bool:
        return bool(self.records)


def load_run(d: str | Path) -> Run:
    """A run directory of any stage: ``run.json`` (captioning, adaptation) or ``pretrain.json`` (pre-training)."""
    d = Path(d)
    seed = d.name.removeprefix("seed")
    if (d / "run.json").exists():
        info = read_json(d / "run.json")
        stage = "adaptation" if info.get("stage") == "adapt-clip4idc" else "captioning"
        name = info.get("method", d.parent.name)
    elif (d / "pretrain.json").exists():
        info = read_json(d / "pretrain.json")
        stage, name = "pre-training", info.get("name", d.parent.name)
    else:
        raise PipelineError(f"{d}: neither run.json nor pretrain.json (not a run directory)")
    log = d / "train_log.jsonl"
    records = read_log(log) if log.exists() else []
    iterations = (info.get("config") or {}).get("train", {}).get("iterations") or info.get("steps")
    selected = info.get("selected_step")
    if stage == "pre-training" and records:
        selected = records[-1]["step"]  # no selection: the last step's weights are kept
    # train writes val_<metric> for every metric it knows, the selection's with a value
    metric = next((k[4:] for k, v in info.items() if k.startswith("val_") and v is not None), "CIDEr")
    return Run(d, name, seed, stage, records, selected, iterations, metric)


METRIC_NAMES = {"CIDEr": "CIDEr-D", "ROUGE_L": "ROUGE-L", "METEOR": "METEOR", "Bleu_4": "BLEU-4", "SPICE": "SPICE"}


def metric_name(metric: str) -> str:
    return METRIC_NAMES.get(metric, metric)


# --------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: str | Path) -> None:
    out = Path(out)
    with atomic_path(out, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=110, metadata={"Software": None})
    _pyplot().close(fig)


def _score_axis(stage: str, metric: str = "CIDEr") -> tuple[str, float]:
    if stage == "captioning":
        return f"validation {metric_name(metric)} (x100)", 100.0
    if stage == "adaptation":
        return "validation R@1+R@5+R@10, both directions", 1.0
    return "validation (pre-training tasks)", 1.0


def _mark_selected(ax, run: Run, y: float | None, style: str) -> None:
    if run.selected_step is None:
        return
    ax.axvline(run.selected_step, color="grey", lw=0.8, ls=style)
    if y is not None:
        ax.plot([run.selected_step], [y], marker="*", ms=12, color="crimson", ls="none",
                label=f"selected: step {run.selected_step}" + (f" (seed {run.seed})" if run.seed != "0" else ""))


def _colour(ax, colours: dict, key: str) -> str:
    """The figure-wide colour of ``key``; a new key takes a colour no curve of ``ax`` has yet (the palette has 10,
    a pre-training's keys alone can be more: numbering keys in order gave two curves of one panel one colour)."""
    if key not in colours:
        used = {line.get_color() for line in ax.get_lines()}
        colours[key] = next((f"C{i}" for i in range(10) if f"C{i}" not in used), f"C{len(colours) % 10}")
    return colours[key]


def _stage_row(axes, runs: list[Run], title: str, colours: dict, with_diag: bool) -> None:
    ax_loss, ax_val = axes[0], axes[1]
    stage = runs[0].stage
    any_log = False
    all_values = []
    for i, run in enumerate(runs):
        style = LINESTYLES[i % len(LINESTYLES)]
        seed = f" seed {run.seed}" if len(runs) > 1 else ""
        if not run.has_log:
            continue
        any_log = True
        steps = [r["step"] for r in run.records]
        for k in loss_keys(run.records):
            pts = [(r["step"], r[k]) for r in run.records if _numeric(r.get(k))]
            all_values += [v for _, v in pts]
            ax_loss.plot([p[0] for p in pts], [p[1] for p in pts], ls=style, marker=".",
                         color=_colour(ax_loss, colours, k), label=f"{k}{seed}")
        if stage == "pre-training":
            for k in validation_keys(run.records):
                pts = [(r["step"], r[k]) for r in run.records if _numeric(r.get(k))]
                ax_val.plot([p[0] for p in pts], [p[1] for p in pts], ls=style, marker=".",
                            color=_colour(ax_val, colours, k), label=f"{k}{seed}")
            _mark_selected(ax_val, run, None, style)
        else:
            _, scale = _score_axis(stage)
            vals = [r["val_score"] * scale for r in run.records]
            ax_val.plot(steps, vals, ls=style, marker="o", color="C0", label=f"validation{seed}")
            sel = {r["step"]: r["val_score"] * scale for r in run.records}.get(run.selected_step)
            _mark_selected(ax_val, run, sel, style)
        if with_diag:
            for k in diagnostic_keys(run.records):
                pts = [(r["step"], r[k]) for r in run.records if _numeric(r.get(k))]
                axes[2].plot([p[0] for p in pts], [p[1] for p in pts], ls=style, marker=".",
                             color=_colour(axes[2], colours, k), label=f"{k}{seed}")
    ax_loss.set_title(f"{title}: train losses (means between validations)", fontsize=9)
    ax_val.set_title(f"{title}: {_score_axis(stage, runs[0].metric)[0]}", fontsize=9)
    if all_values:
        ax_loss.set_yscale("log" if min(all_values) > 0 else "symlog")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if with_diag:
        axes[2].set_title(f"{title}: diagnostics (not losses)", fontsize=9)
        if not axes[2].lines:
            axes[2].set_axis_off()
    if not any_log:
        for ax in axes:
            ax.text(0.5, 0.5, "no train_log.jsonl records", ha="center", va="center", transform=ax.transAxes)


def method_figure(method: str, runs: list[Run], first_stage: list[Run], out: str | Path) -> None:
    """One figure per method: a row of panels per stage (first stage, then the method's training)."""
    if not runs:
        raise PipelineError(f"plots: no runs given for {method!r}")
    plt = _pyplot()
    stages = ([(f"{first_stage[0].stage} ({first_stage[0].name})", first_stage)] if first_stage else [])
    stages.append((method, runs))
    with_diag = any(diagnostic_keys(r.records) for _, rs in stages for r in rs)
    ncols = 3 if with_diag else 2
    fig, axes = plt.subplots(len(stages), ncols, figsize=(5.2 * ncols, 3.6 * len(stages)), squeeze=False)
    colours: dict = {}
    for row, (title, rs) in zip(axes, stages):
        _stage_row(row, rs, title, colours, with_diag)
    seeds = ",".join(r.seed for r in runs)
    fig.suptitle(f"{method}: learning curves (seeds {seeds})", fontsize=11)
    fig.tight_layout()
    _save(fig, out)


def table_metric(runs: dict[str, list[Run]]) -> str:
    """The validation metric the table's runs select on (they must agree: one axis)."""
    metrics = {r.metric for rs in runs.values() for r in rs}
    if len(metrics) > 1:
        raise PipelineError(f"plots --table: the runs select on different metrics {sorted(metrics)}")
    return metrics.pop() if metrics else "CIDEr"


def table_figure(table: str, runs: dict[str, list[Run]], sanity: dict[str, float], out: str | Path) -> None:
    """Validation score (the runs' selection metric: CIDEr-D, or ROUGE-L on Birds-to-Words) of every method of a
    table, with the sanity rows as horizontal reference lines."""
    plt = _pyplot()
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter
    score_name = metric_name(table_metric(runs))
    fig, (ax_step, ax_frac) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, (method, rs) in enumerate(runs.items()):
        colour = f"C{i % 10}"
        for j, run in enumerate(rs):
            if not run.records:
                continue
            style = LINESTYLES[j % len(LINESTYLES)]
            label = method if j == 0 else None
            steps = [r["step"] for r in run.records]
            vals = [100.0 * r["val_score"] for r in run.records]
            ax_step.plot(steps, vals, ls=style, marker=".", color=colour, label=label)
            total = run.iterations or max(steps)
            ax_frac.plot([s / total for s in steps], vals, ls=style, marker=".", color=colour, label=label)
            sel = {r["step"]: 100.0 * r["val_score"] for r in run.records}.get(run.selected_step)
            if sel is not None:
                ax_step.plot([run.selected_step], [sel], marker="*", ms=11, color=colour, ls="none")
                ax_frac.plot([run.selected_step / total], [sel], marker="*", ms=11, color=colour, ls="none")
    for k, (name, cider) in enumerate(sanity.items()):
        for ax in (ax_step, ax_frac):
            ax.axhline(cider, color="black", ls=LINESTYLES[(k + 1) % len(LINESTYLES)], lw=1.0,
                       label=f"sanity: {name} ({cider:.1f})")
    ax_step.set_xscale("log")
    # plain step numbers at 1-2-5 ticks: the default minor labels (3x10^2, 4x10^2, ...) overlap
    ax_step.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax_step.xaxis.set_major_formatter(FormatStrFormatter("%d"))
    ax_step.xaxis.set_minor_formatter(NullFormatter())
    ax_step.set_xlabel("step (log scale)")
    ax_frac.set_xlabel("fraction of the run's training steps")
    for ax in (ax_step, ax_frac):
        ax.set_ylabel(f"validation {score_name} (x100)")
        ax.grid(True, alpha=0.3)
    ax_frac.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(f"{table}: validation {score_name} (greedy decoding); * = selected step", fontsize=11)
    fig.tight_layout()
    _save(fig, out)


def sanity_val_cider(run_dirs, manifest: str | Path, metric: str = "CIDEr") -> dict[str, float]:
    """Validation ``metric`` (CIDEr: CIDEr-D) x100 of each sanity run's ``predictions_val.json`` (mean over its
    seeds)."""
    from pipeline.evaluate import score

    refs = {r["pair_id"]: r["captions"] for r in read_jsonl(manifest) if r["split"] == "val"}
    got: dict[str, list[float]] = {}
    for d in map(Path, run_dirs):
        run = read_json(d / "run.json")
        preds = {p["image_id"]: p["caption"] for p in read_json(d / "predictions_val.json")}
        got.setdefault(run["method"], []).append(100.0 * score(refs, preds, metrics=(metric,))[metric])
    return {m: sum(v) / len(v) for m, v in got.items()}


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--method", help="draw this method's learning curves (all its --runs, one per seed)")
    what.add_argument("--table", help="draw the validation CIDEr-D of all the --runs of this table")
    parser.add_argument("--runs", nargs="+", required=True, help="run directories results/<dataset>/<method>/seed<k>/")
    parser.add_argument("--first-stage", nargs="*", default=[],
                        help="--method: the runs it was initialised from (pre-training, adaptation), one per seed")
    parser.add_argument("--sanity", nargs="*", default=[], help="--table: sanity run dirs (their predictions_val.json)")
    parser.add_argument("--manifest", help="--table with --sanity: the manifest (validation references)")
    parser.add_argument("--out", required=True, help="PNG to write (results/<dataset>/plots/...)")


def run(args: argparse.Namespace) -> None:
    runs = [load_run(d) for d in args.runs]
    if args.method:
        method_figure(args.method, runs, [load_run(d) for d in args.first_stage], args.out)
    else:
        if args.sanity and not args.manifest:
            raise PipelineError("plots --table: --sanity needs --manifest (the validation references)")
        by_method: dict[str, list[Run]] = {}
        for r in runs:
            by_method.setdefault(r.name, []).append(r)
        sanity = sanity_val_cider(args.sanity, args.manifest, table_metric(by_method)) if args.sanity else {}
        table_figure(args.table, by_method, sanity, args.out)
    print(f"plots: wrote {args.out}")
