"""The drift report as a PNG: mean and max |Δlogprob| per position bucket, one colour per state dtype, on a log
scale, with the end of the prompt marked. matplotlib is an optional extra (``pip install 'hybridserve[plot]'``),
imported only here and only when a plot is asked for."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

#: how to get the plot's one dependency
PLOT_INSTALL_HINT = "pip install 'hybridserve[plot]', or pip install matplotlib"


def plot_available() -> bool:
    """Whether matplotlib can be imported."""
    return importlib.util.find_spec("matplotlib") is not None


def write_plot(report: dict[str, Any], path: str) -> None:
    """Draw ``report`` (``measure_drift``'s dict) into the PNG file ``path``; RuntimeError naming the install
    command when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError(f"the plot needs matplotlib, which is not installed: {PLOT_INSTALL_HINT}") from exc
    figure = Figure(figsize=(9, 5), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    middles = [(row["start"] + row["end"] - 1) / 2 for row in report["buckets"]]
    for index, name in enumerate(report["state_dtypes"]):
        colour = f"C{index}"
        rows = [row["figures"][name] for row in report["buckets"]]
        axes.plot(middles, [r["mean"] for r in rows], color=colour, marker="o", markersize=3,
                  label=f"{name} state, mean")
        axes.plot(middles, [r["max"] for r in rows], color=colour, linestyle="--", linewidth=1,
                  label=f"{name} state, max")
    settings = report["settings"]
    if settings["generate_tokens"]:
        axes.axvline(settings["prompt_tokens"] - 0.5, color="grey", linewidth=1, linestyle=":")
        axes.annotate(" generated →", (settings["prompt_tokens"], 1), xycoords=("data", "axes fraction"),
                      va="top", color="grey", fontsize=8)
    if any(r["figures"][n]["max"] > 0 for r in report["buckets"] for n in report["state_dtypes"]):
        axes.set_yscale("symlog", linthresh=1e-7)  # exact zeros (float32 against itself) stay on the chart
        axes.set_ylim(bottom=0)
    axes.set_xlabel(f"position (token index; buckets of {settings['bucket']})")
    axes.set_ylabel(f"|Δlogprob| against {report['reference_state_dtype']} state")
    model = os.path.basename(os.path.normpath(report["model"]))
    axes.set_title(f"state-precision drift: {model} ({report['architecture']}), "
                   f"{report['cpu']['model']} ({report['cpu']['isa_in_force']})", fontsize=9)
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize=8, ncols=2)
    figure.tight_layout()
    figure.savefig(path, format="png")
