"""`gpubook report`'s pictures: GPU-hours per user per week (stacked bars of booked hours, a mark for
the hours used) and each GPU's mean utilisation per day; as a PNG, or in one HTML file with the
table (the image inline, so the file stands alone: no server, no CDN).

matplotlib (Agg: no display) is imported here and only here, and only `gpubook report` imports
this module: the daemon never pays for it.
"""

from __future__ import annotations

import base64
import html
import io
from typing import TYPE_CHECKING

from gpubook.scheduler.outbox.report import COLUMNS, Report, text_row

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def figure(report: Report) -> Figure:
    from matplotlib.figure import Figure  # the Agg canvas comes with savefig: no pyplot, no display

    fig = Figure(figsize=(10, 7.5), layout="constrained")
    weekly, daily = fig.subplots(2, 1)
    labels = [f"{week:%d %b}" for week in report.weeks]
    positions = list(range(len(labels)))
    bottom = [0.0] * len(labels)
    for user, hours in report.weekly_booked.items():
        weekly.bar(positions, hours, bottom=bottom, label=user, width=0.6)
        bottom = [b + h for b, h in zip(bottom, hours, strict=True)]
    used = [sum(values[n] for values in report.weekly_used.values()) for n in positions]
    weekly.plot(positions, used, "k_", markersize=28, markeredgewidth=2.5, label="used (all users)")
    weekly.set_xticks(positions, labels)
    weekly.set_xlabel("week starting")
    weekly.set_ylabel("booked GPU-hours")
    weekly.set_title(f"GPU-hours per user per week, {report.start:%Y-%m-%d} to {report.end:%Y-%m-%d}")
    weekly.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    days = list(report.days)
    for gpu, values in report.daily_utilisation.items():
        daily.plot(days, [float("nan") if v is None else v for v in values], marker=".", label=f"GPU {gpu}")
    daily.set_ylim(0, 100)
    daily.set_ylabel("mean utilisation (%)")
    daily.set_title("utilisation per GPU per day (all samples, booked or not)")
    if report.daily_utilisation:
        daily.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    else:
        daily.text(0.5, 0.5, "no GPU samples in this window", ha="center", va="center", transform=daily.transAxes)
    daily.tick_params(axis="x", labelrotation=30)
    return fig


def png(report: Report) -> bytes:
    out = io.BytesIO()
    figure(report).savefig(out, format="png", dpi=100)
    return out.getvalue()


def html_page(report: Report, *, picture: bytes | None = None) -> str:
    """One standalone page: the table, the rejected requests and the plots inline."""
    image = base64.b64encode(picture if picture is not None else png(report)).decode()
    head = "".join(f"<th>{html.escape(c)}</th>" for c in (report.by, *COLUMNS))
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in text_row(row)) + "</tr>"
                   for row in (*report.rows, report.total))
    reasons = "".join(f"<li>{count} × {html.escape(kind)}</li>" for kind, count in report.rejections)
    title = html.escape(f"gpubook report {report.start:%Y-%m-%d} to {report.end:%Y-%m-%d}, by {report.by}")
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}"
            "td:first-child,th:first-child{text-align:left}</style></head><body>"
            f"<h1>{title}</h1><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
            f"<h2>Rejected requests: {report.rejected}</h2><ul>{reasons}</ul>"
            f'<img alt="GPU-hours per user per week, and utilisation per GPU" src="data:image/png;base64,{image}">'
            "</body></html>\n")
