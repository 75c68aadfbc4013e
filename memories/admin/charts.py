"""The geometry of the dashboard's charts: server-rendered SVG (the templates draw the shapes
computed here), so no JavaScript, no CDN, readable without network access."""

from __future__ import annotations

from datetime import date

from memories.selectors.dashboard import DAYS, TenantFigures

# One colour per operations series (memories.selectors.dashboard.SERIES), in legend order.
SERIES_COLORS = {"reads": "#417690", "writes": "#5b9b3a", "misses": "#d9a400", "denials": "#ba2121"}

BAR_WIDTH = 320
BAR_HEIGHT = 18
BAR_GAP = 6
LINE_W, LINE_H = 560, 160


def dashboard_context(figures: TenantFigures) -> dict:
    """The dashboard template's figures, with its charts drawn."""
    return {
        "memory_count": figures.memory_count,
        "memory_figures_at": figures.memory_figures_at,
        # Shown only when the sizes are older than the counts (a large tenant's, summed less often).
        "chars_at": figures.chars_at if figures.chars_at != figures.memory_figures_at else None,
        "trash_count": figures.trash_count,
        "category_chart": bar_chart([(c or "-", n) for c, n in figures.by_category]),
        "namespace_chart": bar_chart([(ns or "(top level)", n) for ns, n in figures.by_namespace]),
        "expiring_count": figures.expiring_count,
        "expiring": figures.expiring,
        "forget": figures.forget,
        "ops_chart": line_chart(figures.days, figures.operations),
        "ops_totals": {name: sum(values) for name, values in figures.operations.items()},
        "tokens": figures.tokens,
        "tokens_returned": bar_chart(
            [(d.strftime("%m-%d"), n) for d, n in zip(figures.days, figures.tokens_returned, strict=True)]
        ),
        "days": DAYS,
    }


def bar_chart(items: list[tuple[str, int]]) -> dict:
    """Horizontal bars: label, value and the bar's y and width in SVG units."""
    top = max((n for _, n in items), default=0) or 1
    bars = [
        {
            "label": label,
            "value": n,
            "y": i * (BAR_HEIGHT + BAR_GAP),
            "text_y": i * (BAR_HEIGHT + BAR_GAP) + BAR_HEIGHT - 5,
            "width": max(1, round(BAR_WIDTH * n / top)),
        }
        for i, (label, n) in enumerate(items)
    ]
    return {"bars": bars, "height": max(len(bars), 1) * (BAR_HEIGHT + BAR_GAP), "bar_height": BAR_HEIGHT}


def line_chart(days: list[date], series: dict[str, list[int]]) -> dict:
    """One polyline per series over the days, scaled to the largest daily figure."""
    top = max((v for values in series.values() for v in values), default=0) or 1
    step = LINE_W / max(len(days) - 1, 1)

    def y(v):
        return round(LINE_H - LINE_H * v / top, 1)

    lines = [
        {
            "name": name,
            "color": color,
            "points": " ".join(f"{round(i * step, 1)},{y(v)}" for i, v in enumerate(series[name])),
            "total": sum(series[name]),
        }
        for name, color in SERIES_COLORS.items()
    ]
    ticks = [{"x": round(i * step, 1), "label": d.strftime("%m-%d")} for i, d in enumerate(days) if i % 2 == 0]
    return {"lines": lines, "ticks": ticks, "width": LINE_W, "height": LINE_H, "top": top}
