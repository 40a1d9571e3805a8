"""Line charts as self-contained SVG: run metadata shows curves without a plotting library."""

from __future__ import annotations

import base64
from collections.abc import Sequence

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")


def line_chart_svg(
    title: str, series: dict[str, Sequence[float]], width: int = 480, height: int = 220
) -> str:
    """One polyline per series over a shared y range, with the range and a legend."""
    values = [v for line in series.values() for v in line] or [0.0]
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    left, top, right, bottom = 48, 28, width - 12, height - 24
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="11">',
        f'<text x="{left}" y="16" font-size="13">{title}</text>',
        f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" '
        'fill="none" stroke="#bbb"/>',
        f'<text x="4" y="{top + 4}">{high:.3g}</text>',
        f'<text x="4" y="{bottom}">{low:.3g}</text>',
    ]
    for index, (name, line) in enumerate(series.items()):
        color = COLORS[index % len(COLORS)]
        step = (right - left) / max(len(line) - 1, 1)
        points = " ".join(
            f"{left + i * step:.1f},{bottom - (v - low) / span * (bottom - top):.1f}"
            for i, v in enumerate(line)
        )
        parts.append(
            f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}"/>'
        )
        parts.append(
            f'<text x="{right - 90}" y="{top + 14 + 13 * index}" fill="{color}">{name}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def markdown_image(svg: str, alt: str) -> str:
    encoded = base64.b64encode(svg.encode()).decode()
    return f"![{alt}](data:image/svg+xml;base64,{encoded})"
