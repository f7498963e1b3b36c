"""`nemo-dapo plot RUN_DIR`: the main training curves as PNG files, from ``metrics.jsonl``.

For a cluster where TensorBoard cannot be reached, or for a report: reward, accuracy
(training and validation), response length, entropy, clip fractions and the step-time
breakdown, written to ``RUN_DIR/plots/``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from nemo_dapo.algo import metric_names as mn

Series = dict[str, list[tuple[int, float]]]


@dataclass(frozen=True)
class Figure:
    file: str
    title: str
    ylabel: str
    patterns: tuple[str, ...]  # metric names, shell-style wildcards allowed


CURVES = (
    Figure("reward.png", "Reward (training batch)", "score", (mn.SCORE["mean"].name, mn.REWARDS["mean"].name)),
    Figure(
        "accuracy.png",
        "Accuracy: training batch and validation",
        "accuracy",
        (mn.ACC.name, "val-core/*", "eval/*"),
    ),
    Figure(
        "response_length.png",
        "Response length (tokens)",
        "tokens",
        tuple(m.name for m in mn.RESPONSE_LENGTH.values()),
    ),
    Figure("entropy.png", "Policy entropy", "nats per token", (mn.ENTROPY.name,)),
    Figure(
        "clip_fraction.png", "Clipped token fractions", "fraction", (mn.PG_CLIPFRAC.name, mn.PG_CLIPFRAC_LOWER.name)
    ),
)
TIMING_PREFIX = mn.TIMING_S.name.split("{")[0]


def read_records(path: Path) -> tuple[list[dict], int]:
    """The records of a ``metrics.jsonl`` that name their step, in order; also the number of
    unreadable lines (a run killed mid-write leaves a partial last line)."""
    records: list[dict] = []
    skipped = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            record["step"] = int(record["step"])
        except (ValueError, KeyError, TypeError):
            skipped += 1
            continue
        records.append(record)
    return records, skipped


def read_metrics(path: Path) -> tuple[Series, int]:
    """Every numeric metric as (step, value) pairs; also the number of unreadable lines."""
    records, skipped = read_records(path)
    series: Series = {}
    for record in records:
        for name, value in record.items():
            if name not in ("step", "time") and isinstance(value, (int, float)):
                series.setdefault(name, []).append((record["step"], float(value)))
    return series, skipped


def matching(series: Series, patterns: tuple[str, ...]) -> list[str]:
    """Metric names matching the patterns, in pattern order."""
    names: list[str] = []
    for pattern in patterns:
        names += sorted(n for n in series if fnmatch(n, pattern) and n not in names)
    return names


def _plot_lines(ax, series: Series, names: list[str]) -> None:
    for name in names:
        steps, values = zip(*sorted(series[name]))
        marker = "o" if len(steps) <= 30 or name.startswith(("val-", "eval/")) else None
        ax.plot(steps, values, label=name, marker=marker, markersize=3)


def _plot_timing(ax, series: Series) -> list[str]:
    """Stacked seconds per stage in execution order (first seen), so the top edge is the step time."""
    stages = [n for n in series if n.startswith(TIMING_PREFIX)]
    steps = sorted({step for name in stages for step, _ in series[name]})
    stacks = []
    for name in stages:
        by_step = dict(series[name])
        stacks.append([by_step.get(step, 0.0) for step in steps])
    if stages:
        ax.stackplot(steps, stacks, labels=[n[len(TIMING_PREFIX) :] for n in stages])
    return stages


def _save(fig, ax, title: str, ylabel: str, path: Path) -> None:
    ax.set_title(title)
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never hides a curve
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def render_plots(run_dir: str | Path) -> list[Path]:
    """Write one PNG per curve group that has data; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics_file = run_dir / "metrics.jsonl"
    if not metrics_file.is_file():
        raise FileNotFoundError(f"{metrics_file} not found: give a run's trainer.output_dir")
    series, skipped = read_metrics(metrics_file)
    if skipped:
        print(f"nemo-dapo plot: skipped {skipped} unreadable line(s) of {metrics_file}", file=sys.stderr)
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for figure in CURVES:
        names = matching(series, figure.patterns)
        if not names:
            continue
        fig, ax = plt.subplots(figsize=(10, 4.5))
        _plot_lines(ax, series, names)
        _save(fig, ax, figure.title, figure.ylabel, out_dir / figure.file)
        plt.close(fig)
        written.append(out_dir / figure.file)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    if _plot_timing(ax, series):
        _save(fig, ax, "Step time by stage (stacked)", "seconds", out_dir / "timing.png")
        written.append(out_dir / "timing.png")
    plt.close(fig)
    return written


def run_plot(args: argparse.Namespace) -> int:
    try:
        written = render_plots(args.run_dir)
    except FileNotFoundError as err:
        print(f"nemo-dapo plot: {err}", file=sys.stderr)
        return 1
    if not written:
        print(f"nemo-dapo plot: no known metric in {args.run_dir}/metrics.jsonl", file=sys.stderr)
        return 1
    print("\n".join(str(path) for path in written))
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "plot",
        help="PNG curves (reward, accuracy, length, entropy, clipping, timing) "
        "from RUN_DIR/metrics.jsonl into RUN_DIR/plots/",
    )
    parser.add_argument("run_dir", help="a run's trainer.output_dir (holds metrics.jsonl)")
    parser.set_defaults(fn=run_plot)
