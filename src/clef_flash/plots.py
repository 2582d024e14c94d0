"""Figures a reader can read, drawn with matplotlib (the `plots` extra): each has axes with labels,
a title and a legend, and comes back as PNG bytes.

    reliability_figure(bins)     eval labelled: accuracy per confidence bin against the diagonal
    calibration_figure(report)   eval labelled --fit-calibration: the held-out reliability before and after, per adapter
    agreement_figure(report)     eval agreement: the distribution of |dp| over every option
    bench_figure(results)        bench: latency percentiles and throughput by batch size
    explanation_figure(body)     explain: each part's contribution to each question's decision, a bar chart per question

Only matplotlib's object API is used (`Figure` + the Agg canvas), never pyplot: nothing global (a
backend, open figures) changes in the caller's process.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .errors import ClefError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ACCURACY, GAP, DIAGONAL = "#4278be", "#eb968c", "#6e6e6e"
SUPPORTS, OPPOSES = "#2e8b57", "#c0392b"  # a part that raises the decision's probability, one that lowers it


def _figure(width: float = 5.5, height: float = 5.0) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ClefError("plots need matplotlib: pip install 'clef-flash[plots]'") from None
    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def png(figure: Figure) -> bytes:
    """The figure as a PNG (the Agg canvas; no display needed)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def reliability_figure(bins: Sequence[dict[str, float]]) -> Figure:
    """Accuracy per bin of the top probability (bars), the gap to the bin's mean confidence, and the
    diagonal a perfectly calibrated model would sit on."""
    figure = _figure()
    draw_reliability(figure.add_subplot(), bins, "Reliability diagram")
    return figure


def calibration_figure(report: dict[str, Any]) -> Figure:
    """A row per adapter that has held-out labels (the base first, as fitted): its held-out reliability diagram
    before the temperatures (left) and after (right), each titled with its ECE."""
    sides = [side for side in report["sides"] if side["before"] is not None]
    if not sides:
        raise ClefError("no held-out record has a label: no reliability diagram to draw")
    figure = _figure(11, 5.0 * len(sides))
    for row, side in zip(figure.subplots(len(sides), 2, squeeze=False), sides):
        name = "base" if side["adapter"] is None else f"adapter {side['adapter']}"
        for axes, when in zip(row, ("before", "after")):
            figures = side[when]
            title = f"{name}, held out, {when} calibration: ECE {figures['ece']:.3f}, log-loss {figures['log_loss']:.3f}"
            draw_reliability(axes, figures["reliability"], title)
    return figure


def draw_reliability(axes: Any, bins: Sequence[dict[str, float]], title: str) -> None:
    """One reliability diagram on `axes` (see reliability_figure)."""
    used = [b for b in bins if b["count"]]
    lefts = [b["lower"] for b in used]
    widths = [b["upper"] - b["lower"] for b in used]
    accuracies = [b["accuracy"] for b in used]
    axes.bar(lefts, accuracies, widths, align="edge", color=ACCURACY, edgecolor="white", label="accuracy in the bin")
    gaps = [b["confidence"] - b["accuracy"] for b in used]
    axes.bar(lefts, gaps, widths, bottom=accuracies, align="edge", color=GAP, alpha=0.8, edgecolor="white", label="gap to mean confidence")
    axes.plot([0, 1], [0, 1], linestyle="--", color=DIAGONAL, label="perfect calibration")
    for b in used:
        axes.annotate(f"n={b['count']}", (b["lower"] + (b["upper"] - b["lower"]) / 2, 0.01), ha="center", va="bottom", fontsize=7, color="white")
    axes.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence (top option's probability)", ylabel="accuracy")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left")


def agreement_figure(report: dict[str, Any]) -> Figure:
    """How far the candidate's option probabilities are from the reference's: a histogram of |dp| on
    log-spaced bins, with the median and the max marked."""
    histogram = report["abs_dp_histogram"]
    edges, counts = histogram["edges"], histogram["counts"]
    figure = _figure(6.5, 4.0)
    axes = figure.add_subplot()
    axes.stairs(counts, edges, fill=True, color=ACCURACY, alpha=0.8, label=f"{sum(counts)} option probabilities")
    axes.set_xscale("log")
    for value, name, style in ((report["median_abs_dp"], "median", "--"), (report["max_abs_dp"], "max", ":")):
        if value > 0:
            axes.axvline(value, color="black", linestyle=style, label=f"{name} {value:.2e}")
    axes.set(xlabel="|dp|: |candidate - reference| per option probability", ylabel="options")
    axes.set_title(
        f"Agreement: {report['answers_differing']} of {report['questions']} answers differ"
        f" ({report['near_ties']} near-ties)"
    )
    axes.grid(alpha=0.3)
    axes.legend()
    return figure


def bench_figure(results: Sequence[dict[str, Any]]) -> Figure:
    """Latency percentiles per record (left) and records/s (right) against the batch size."""
    results = sorted(results, key=lambda result: result["batch_size"])
    sizes = [result["batch_size"] for result in results]
    figure = _figure(10, 4.0)
    latency, throughput = figure.subplots(1, 2)
    for name in results[0]["latency_ms"]:
        latency.plot(sizes, [result["latency_ms"][name] for result in results], marker="o", label=name)
    latency.set(xlabel="batch size (records per forward)", ylabel="latency per record (ms)")
    latency.set_title("Latency")
    throughput.plot(sizes, [result["records_per_s"] for result in results], marker="o", color=ACCURACY, label="records/s")
    throughput.set(xlabel="batch size (records per forward)", ylabel="records per second")
    throughput.set_title("Throughput")
    for axes in (latency, throughput):
        axes.set_xscale("log", base=2)
        axes.set_xticks(sizes, [str(size) for size in sizes])
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)
        axes.legend()
    first = results[0]
    figure.suptitle(
        f"{first['model']} ({first['precision']}, {first['device']}), ~{first['tokens_per_record']:.0f} tokens per record"
        + (" - random weights" if first["random_weights"] else "")
    )
    return figure


def explanation_figure(body: dict[str, Any]) -> Figure:
    """One horizontal bar chart per question (`Explanation.to_dict()`): each part's contribution to the question's
    decision, green where the part supports it, red where it opposes it."""
    from matplotlib.patches import Patch

    questions = list(body["questions"].items())
    # a text's part by its words, any other by its label (a JSON path, images[0])
    labels = [part["excerpt"] if part["kind"] in ("line", "sentence") else part["label"] for part in body["parts"]]
    labels = [label if len(label) <= 32 else label[:31] + "…" for label in labels]
    height = 1.0 + 0.28 * len(labels)
    figure = _figure(6.5, max(2.5, height) * len(questions))
    for axes, (question_id, question) in zip(figure.subplots(len(questions), 1, squeeze=False)[:, 0], questions):
        decision = question["decision"]
        values = question["options"][decision]["contributions"]
        positions = list(range(len(values)))[::-1]  # the first part on top
        axes.barh(positions, values, color=[SUPPORTS if value >= 0 else OPPOSES for value in values])
        axes.set_yticks(positions, labels)
        axes.axvline(0, color=DIAGONAL, linewidth=0.8)
        probability = question["options"][decision]["probability"]
        axes.set_title(f"{question_id} -> {decision} (p {probability:.3f})")
        unit = "p - p without the part" if body["method"] == "leave-out" else "attribution"
        axes.set_xlabel(f"contribution to {decision!r} ({unit})")
        axes.grid(axis="x", alpha=0.3)
        axes.legend(handles=[Patch(color=SUPPORTS, label="supports the decision"), Patch(color=OPPOSES, label="opposes it")], fontsize=8)
    figure.suptitle(f"Why: {body['method']}, {len(labels)} parts ({body['model']})")
    return figure
