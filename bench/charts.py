"""Grouped bar charts for the benches' ``--plot``: a PNG with matplotlib (the ``plot``
extra), else an SVG written by hand beside the asked path, so a plot never needs a
dependency."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")


def bars(groups: Sequence[str], series: dict[str, Sequence[float]], path: Path, *,
         ylabel: str, log: bool = False) -> Path:
    """One group of bars per ``groups`` entry, one bar per series in each (values are
    per group, in order). Returns the file written: ``path`` as PNG, or beside it as
    SVG when matplotlib is missing."""
    for name, values in series.items():
        if len(values) != len(groups):
            raise ValueError(f"series {name!r} has {len(values)} values for "
                             f"{len(groups)} groups")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib); drawing an SVG")
        return _svg(groups, series, path.with_suffix(".svg"), ylabel, log)
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) * max(1, len(series)) / 2),
                                    4))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + width * i for x in range(len(groups))], list(values), width=width,
               label=name, color=COLORS[i % len(COLORS)])
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(groups))],
                  list(groups), fontsize=7)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _svg(groups: Sequence[str], series: dict[str, Sequence[float]], path: Path,
         ylabel: str, log: bool) -> Path:
    bar_w, gap = 20, 24
    group_w = bar_w * max(1, len(series)) + gap
    height, left, bottom, top = 360, 60, 80, 20
    width = max(80 + group_w * len(groups), left + 110 * len(series) + 20)
    values = [v for vs in series.values() for v in vs if v > 0] or [1.0]
    if log:
        lo = math.floor(math.log10(min(values)))
        hi = max(math.ceil(math.log10(max(values))), lo + 1)
        ticks = [10.0 ** e for e in range(lo, hi + 1)]

        def frac(v: float) -> float:
            return (math.log10(max(v, 10.0 ** lo)) - lo) / (hi - lo)
    else:
        top_v = max(values) * 1.05
        ticks = [top_v * k / 4 for k in range(5)]

        def frac(v: float) -> float:
            return max(v, 0.0) / top_v

    def y(v: float) -> float:
        return height - bottom - frac(v) * (height - bottom - top)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           'font-family="sans-serif" font-size="10">']
    for t in ticks:
        out.append(f'<line x1="{left}" x2="{width - 10}" y1="{y(t):.1f}" y2="{y(t):.1f}" '
                   f'stroke="#ddd"/><text x="{left - 5}" y="{y(t) + 3:.1f}" '
                   f'text-anchor="end">{t:.3g}</text>')
    for i, label in enumerate(groups):
        x0 = left + 10 + group_w * i
        for j, (name, vs) in enumerate(series.items()):
            v = vs[i]
            out.append(f'<rect x="{x0 + bar_w * j}" y="{y(v):.1f}" width="{bar_w - 2}" '
                       f'height="{height - bottom - y(v):.1f}" '
                       f'fill="{COLORS[j % len(COLORS)]}"><title>{name}: {v:.4g}</title>'
                       '</rect>')
        for k, part in enumerate(label.split("\n")):
            out.append(f'<text x="{x0 + bar_w * len(series) / 2:.0f}" '
                       f'y="{height - bottom + 14 + 12 * k}" text-anchor="middle">'
                       f'{part}</text>')
    for j, name in enumerate(series):
        out.append(f'<rect x="{left + 110 * j}" y="{height - 24}" width="10" height="10" '
                   f'fill="{COLORS[j % len(COLORS)]}"/><text x="{left + 110 * j + 14}" '
                   f'y="{height - 15}">{name}</text>')
    out.append(f'<text x="14" y="{(height - bottom) / 2}" transform="rotate(-90 14 '
               f'{(height - bottom) / 2})" text-anchor="middle">{ylabel}</text></svg>')
    path.write_text("\n".join(out) + "\n")
    return path
