"""Per-change-type bar chart of a table (rule `report_by_type`), from its ``_by_type.csv``: one group of bars
per change type (the columns between ``n_pairs`` and ``notes``, subset-IDF CIDEr-D, not the global-IDF twins),
one bar per row (reproduced, sanity, paper), the std over seeds as error bars where there is one."""


import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402


def type_columns(t: pd.DataFrame) -> list[str]:
    cols = list(t.columns)
    end = cols.index("notes") if "notes" in cols else len(cols)
    middle = cols[cols.index("n_pairs") + 1:end]
    return [c for c in middle if not c.endswith(" std") and "(global IDF)" not in c]


def row_label(r) -> str:
    label = f"{r['method']} ({r['kind']})" if r["kind"] != "reproduced" else r["method"]
    return f"{r['subset']}: {label}" if "subset" in r and isinstance(r["subset"], str) else label


def draw(csv: str, title: str, out: str) -> None:
    t = pd.read_csv(csv, dtype=str)
    types = type_columns(t)
    vals = t[types].apply(pd.to_numeric, errors="coerce")
    stds = pd.DataFrame({c: pd.to_numeric(t[f"{c} std"], errors="coerce") if f"{c} std" in t else np.nan
                         for c in types})
    n = len(t)
    width = 0.8 / max(n, 1)
    fig, ax = plt.subplots(figsize=(min(16.0, max(6.0, 2.0 + 0.12 * n * len(types))), 4.5))
    x = np.arange(len(types))
    hatch = {"reproduced": "", "sanity": "//", "paper": ".."}
    methods = list(dict.fromkeys(t["method"]))  # one colour per method: its reproduced and paper bars side by side
    colours = plt.get_cmap("tab20")(np.linspace(0, 1, 20))
    for i, (_, r) in enumerate(t.iterrows()):
        ax.bar(x + (i - (n - 1) / 2) * width, vals.iloc[i].fillna(0).to_numpy(), width,
               yerr=stds.iloc[i].to_numpy(), capsize=2, label=row_label(r), hatch=hatch.get(r["kind"], ""),
               color=colours[methods.index(r["method"]) % 20], edgecolor="black", linewidth=0.4)
    ax.set_xticks(x, types)
    ax.set_ylabel("CIDEr-D (x100)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2 if n > 6 else 1, bbox_to_anchor=(1.01, 1), loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sm = snakemake  # noqa: F821 - injected by Snakemake's script directive
    sys.stdout = sys.stderr = open(sm.log[0], "w")  # noqa: SIM115 - the rule's log, for the whole script
    draw(sm.input.by_type, f"{sm.wildcards.table}: CIDEr-D by change type (test split)", sm.output[0])
