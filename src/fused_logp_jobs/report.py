"""Agreement statistics, the drift report (Markdown + JSON) and its plots.

K3 per token is rho - 1 - log(rho) with rho = exp(logp_train - logp_rollout), computed in float64 from the
two FP32 logprobs; it is exactly 0 when the bytes agree.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fused_logp.atomic_io import atomic_path, atomic_write_text


def compare(rollout: np.ndarray, train: np.ndarray) -> dict:
    """Agreement of two per-token logprob arrays (FP32): mismatches by bytes, max |delta|, K3."""
    a = np.asarray(rollout, dtype=np.float32).ravel()
    b = np.asarray(train, dtype=np.float32).ravel()
    mism = int((a.view(np.int32) != b.view(np.int32)).sum())
    delta = b.astype(np.float64) - a.astype(np.float64)
    k3 = np.expm1(delta) - delta                                   # rho - 1 - log(rho)
    return {"tokens": int(a.size), "mismatches": mism, "max_abs_delta": float(np.abs(delta).max()) if a.size else 0.0,
            "mean_abs_delta": float(np.abs(delta).mean()) if a.size else 0.0,
            "k3_mean": float(k3.mean()) if a.size else 0.0, "k3_max": float(k3.max()) if a.size else 0.0}


def agreement_table(rows: dict) -> str:
    """rows: name -> compare() dict. A fixed-width table for the terminal."""
    head = f"{'comparison':66s} {'tokens':>7s} {'mismatch':>9s} {'max|dlogp|':>11s} {'K3 mean':>10s} {'K3 max':>10s}"
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        lines.append(f"{name:66s} {r['tokens']:7d} {r['mismatches']:9d} {r['max_abs_delta']:11.3g} "
                     f"{r['k3_mean']:10.3g} {r['k3_max']:10.3g}")
    return "\n".join(lines)


def _deltas(series: dict) -> dict:
    return {label: np.asarray(b, np.float64).ravel() - np.asarray(a, np.float64).ravel()
            for label, (a, b) in series.items()}


def plot_drift(out_dir, series: dict, positions: np.ndarray) -> list[str]:
    """series: label -> (rollout logp, train logp). Writes the CDF of |dlogp|, drift by position and K3."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    deltas = _deltas(series)
    pos = np.asarray(positions).ravel()

    def cdf(ax):
        for label, delta in deltas.items():
            d = np.sort(np.abs(delta))
            nz = d[d > 0]
            if nz.size:
                ax.step(nz, float((d == 0).mean()) + np.arange(1, nz.size + 1) / d.size, where="post", label=label)
            else:
                ax.axhline(1.0, label=f"{label}: all {d.size} tokens exactly equal", linestyle="--", color="black")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)

    def by_position(ax):
        ups = np.unique(pos)
        for label, delta in deltas.items():
            ax.plot(ups, [np.abs(delta[pos == p]).max() for p in ups], marker=".", label=label)

    def k3(ax):
        for label, delta in deltas.items():
            ax.plot(np.expm1(delta) - delta, marker=".", linestyle="none", label=label)

    figures = [
        ("drift_cdf.png", "Rollout vs trainer logprob drift (CDF)", cdf,
         "|logp_train - logp_rollout| per token (log scale; exact zeros sit at the curve's start)", "fraction of tokens"),
        ("drift_by_position.png", "Drift by position", by_position, "token position in the sequence",
         "max |dlogp| at that position"),
        ("k3.png", "Per-token K3", k3, "token index", "K3 = rho - 1 - log rho"),
    ]
    files = []
    for name, title, draw, xlabel, ylabel in figures:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        draw(ax)
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.legend(fontsize=8)
        fig.tight_layout()
        files.append(str(out / name))
        with atomic_path(files[-1]) as tmp:
            fig.savefig(tmp, dpi=120, format="png")
        plt.close(fig)
    return files


def write_report(out_dir, title: str, table_rows: dict, extra: dict, plots: list[str]) -> tuple[str, str]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {"title": title, "comparisons": table_rows, **extra, "plots": [Path(p).name for p in plots]}
    atomic_write_text(out / "report.json", json.dumps(data, indent=2, default=str) + "\n")
    md = [f"# {title}", "", "```", agreement_table(table_rows), "```", ""]
    for key, val in extra.items():
        md += [f"## {key}", "", "```", json.dumps(val, indent=2, default=str), "```", ""]
    md += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    atomic_write_text(out / "report.md", "\n".join(md) + "\n")
    return str(out / "report.md"), str(out / "report.json")
