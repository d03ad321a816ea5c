"""A PNG of the table: TFLOP/s per implementation, one group of bars per shape/dtype/direction."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence


def write_plot(path: Path, rows: Sequence[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["case"], r["shape_label"], r["dtype"], r["direction"])
                                for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    ok = {(r["case"], r["shape_label"], r["dtype"], r["direction"], r["impl"]): r
          for r in rows if r["status"] == "ok"}
    missing = {(r["case"], r["shape_label"], r["dtype"], r["direction"], r["impl"])
               for r in rows if r["status"] != "ok"}
    width = 0.8 / max(len(impls), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) * max(len(impls), 2) / 2), 4.5))
    for i, impl in enumerate(impls):
        xs, ys, rs = [], [], []
        for g, key in enumerate(groups):
            row = ok.get((*key, impl))
            if row is not None:
                xs.append(g + (i - (len(impls) - 1) / 2) * width)
                ys.append(row["tflops"])
                rs.append(row.get("ratio_to_peer"))
        bars = ax.bar(xs, ys, width, label=impl)
        for g, key in enumerate(groups):  # rows that did not run (unavailable, skipped): "n/a"
            if (*key, impl) in missing:
                ax.annotate("n/a", (g + (i - (len(impls) - 1) / 2) * width, 0), ha="center",
                            va="bottom", fontsize=6, rotation=90,
                            color=bars.patches[0].get_facecolor() if bars.patches else "grey")
        for bar, ratio in zip(bars, rs):
            if ratio is not None:  # speed relative to the peer, on top of the bar
                ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)))
    labels = [f"{shape}\n{dtype} {direction}" + ("" if case == "dense" else f"\n{case}")
              for case, shape, dtype, direction in groups]
    ax.set_xticklabels(labels, fontsize=7)
    save_bar_chart(fig, ax, path, "TFLOP/s (median)", title)


def save_bar_chart(fig, ax, path: Path, ylabel: str, title: str) -> None:
    """The bench's bar charts share their finish: labels, legend, grid, the PNG, closed."""
    import matplotlib.pyplot as plt

    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
