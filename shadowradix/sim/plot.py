"""The sweep plot: hit rate against device memory, one line per policy."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    return plt


def _finish(plt: Any, fig: Any, ax: Any, runs: list[dict[str, Any]], out: Path,
            title: str) -> None:
    """The bound lines, axes and legend every hit-rate plot shares; writes the PNG."""
    bound = 100 * runs[0]["bound_hit_rate"]
    ax.axhline(bound, color="grey", linestyle="--", label=f"infinite-cache bound ({bound:.1f}%)")
    ax.axhline(0.9 * bound, color="grey", linestyle=":", label="90% of bound")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("device KV memory (GB)")
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def plot_sweep(runs: list[dict[str, Any]], out: Path, title: str) -> None:
    """Write a PNG. Needs matplotlib (`pip install shadowradix[plot]`)."""
    plt = _pyplot()
    lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in runs:
        if r["device_gb"] is not None:
            lines[r["policy"]].append((r["device_gb"], 100 * r["hit_rate"]))
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for policy, points in lines.items():
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker="o", label=policy)
    _finish(plt, fig, ax, runs, out, title)


STATIC_PREFIXES = ("periodic-", "eager-swa", "no-shadows")


def envelope(runs: list[dict[str, Any]]) -> dict[float, dict[str, Any]]:
    """Per device size, the best static setting (periodic K x window share, eager SWA,
    no shadows): what a flag tuned for that size alone would reach."""
    best: dict[float, dict[str, Any]] = {}
    for r in runs:
        gb = r["device_gb"]
        if gb is None or not r["policy"].startswith(STATIC_PREFIXES):
            continue
        if gb not in best or r["hit_rate"] > best[gb]["hit_rate"]:
            best[gb] = r
    return best


def plot_envelope(runs: list[dict[str, Any]], out: Path, title: str) -> None:
    """A PNG: the default policy, the old one and no shadows against the envelope of the
    static settings, hit rate vs device GB. Needs matplotlib."""
    plt = _pyplot()

    best = envelope(runs)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    xs = sorted(best)
    ax.plot(xs, [100 * best[x]["hit_rate"] for x in xs], color="black", linewidth=2.5,
            alpha=0.35, label="best static setting at each size")
    labels = {"shadowradix": "default (shadowradix)",
              "end-only": "end checkpoints only (the old default, share 0.1)"}
    for policy, style in (("shadowradix", "o-"), ("end-only", "s--"), ("no-shadows", "^:")):
        pts = sorted((r["device_gb"], 100 * r["hit_rate"]) for r in runs
                     if r["policy"] == policy and r["device_gb"] is not None
                     and (policy != "end-only" or r["window_ratio"] == 0.1))
        if pts:
            px, py = zip(*pts, strict=True)
            ax.plot(px, py, style, label=labels.get(policy, policy))
    _finish(plt, fig, ax, runs, out, title)
