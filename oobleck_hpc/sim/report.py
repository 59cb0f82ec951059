"""Results as a table, as JSON, and as a plot of goodput over time (matplotlib, imported only
when a plot is asked for)."""

from __future__ import annotations

import json
from pathlib import Path

from oobleck_hpc.files import atomic_open, temp_path
from oobleck_hpc.sim.engine import CATEGORIES, PolicyResult

_SHORT = {"effective": "effective", "redundant": "redundant", "idle": "idle",
          "checkpoint": "ckpt", "reconfiguration": "reconfig", "restart": "restart",
          "lost": "lost", "stopped": "stopped"}


def format_table(results: dict[str, PolicyResult], title: str = "") -> str:
    cols = [c for c in CATEGORIES
            if c == "effective" or any(r.seconds[c] > 0 for r in results.values())]
    head = (["policy"] + [_SHORT[c] for c in cols]
            + ["samples/s", "samples", "failures", "fallbacks"])
    rows = []
    for name, r in results.items():
        rows.append([name] + [f"{100 * r.shares[c]:.1f}%" for c in cols]
                    + [f"{r.samples_per_s:.4g}", f"{r.samples:.4g}", str(r.failures),
                       str(r.fallbacks)])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = [title] if title else []
    lines.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                           for i, (h, w) in enumerate(zip(head, widths))))
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))))
    lines.append("Shares are of the simulated wall time and sum to 100 % per row; 'lost' is "
                 "training thrown away (the interrupted step, or all since the last checkpoint).")
    return "\n".join(lines)


def to_json(results: dict[str, PolicyResult], meta: dict) -> str:
    return json.dumps({"meta": meta, "policies": {k: v.to_dict() for k, v in results.items()}},
                      indent=2)


PLOT_FORMATS = (".png", ".svg", ".pdf")

# what the plot's legend calls each policy (the table keeps the short names)
_LONG = {"oobleck": "oobleck (in-place reconfiguration)",
         "restart": "checkpoint-restart",
         "redundant": "redundant computation",
         "recycle": "ReCycle-like (micro-batches re-routed to peers)"}

# "nice" averaging windows of the goodput panel, in seconds
_WINDOWS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200,
            86400)


class PlotError(RuntimeError):
    """--plot cannot be honoured (matplotlib missing, a path that cannot be written)."""


def check_plot_target(path: str | Path) -> None:
    """Everything about `--plot PATH` that can fail before any simulation: matplotlib is
    importable, the suffix is a format we write, and a file can be created next to PATH (which
    is where the plot is written first, then renamed over PATH). Raises PlotError naming the
    option and the fix."""
    p = Path(path)
    where = f"--plot {path}"
    if p.is_dir():
        raise PlotError(f"{where}: is a directory. Fix: give a file name, e.g. "
                        f"--plot {p / 'goodput.png'}")
    if p.suffix.lower() not in PLOT_FORMATS:
        raise PlotError(f"{where}: unknown format {p.suffix or '(no suffix)'!r}. Fix: name the "
                        f"file with one of {', '.join(PLOT_FORMATS)}, e.g. --plot goodput.png")
    parent = p.parent
    if not parent.exists():
        raise PlotError(f"{where}: directory {str(parent)!r} does not exist. Fix: create it "
                        f"(mkdir -p {parent}) or pass a path in an existing directory")
    if not parent.is_dir():
        raise PlotError(f"{where}: {str(parent)!r} is not a directory. Fix: pass a path in an "
                        "existing directory")
    probe = temp_path(p)
    try:
        with open(probe, "xb"):
            pass
        probe.unlink()
    except OSError as e:
        raise PlotError(f"{where}: cannot write in {str(parent)!r} ({e.strerror}). Fix: pass a "
                        "path in a writable directory") from e
    try:
        import matplotlib
    except ImportError as e:
        raise PlotError(f"{where}: needs matplotlib, which is not installed in this "
                        "environment (it is a dependency of oobleck_hpc). Fix: pip install "
                        "'matplotlib>=3.8' (or reinstall: pip install -e .), or leave out "
                        "--plot") from e
    matplotlib.use("Agg")  # files only, never a display


def plot_window_s(duration_s: float) -> float:
    """The averaging window of the goodput panel: about 1/100 of the run, rounded up to a
    round number of seconds, minutes or hours."""
    want = duration_s / 100
    for w in _WINDOWS:
        if w >= want:
            return float(w)
    return float(_WINDOWS[-1])


def duration_text(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:g} s"
    if seconds < 3600:
        return f"{seconds / 60:g} min"
    return f"{seconds / 3600:g} h"


def two_panels(duration_s: float):
    """A matplotlib Figure (Agg) of two panels over simulated time, sharing the hour axis:
    (figure, top, bottom, the top panel's averaging window in seconds)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 6.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    return fig, top, bottom, plot_window_s(duration_s)


def mark_times(top, bottom, times_s, duration_s: float, what: str, color: str, style: str,
               alpha: float) -> None:
    """Vertical lines at `times_s` (before `duration_s`) on both panels, labelled once (top);
    fainter when there are more than 100."""
    hours = [t / 3600 for t in times_s if t < duration_s]
    if not hours:
        return
    for ax in (top, bottom):
        ax.vlines(hours, 0, 1, transform=ax.get_xaxis_transform(), colors=color,
                  linestyles=style, linewidth=0.8, alpha=alpha if len(hours) <= 100 else 0.2,
                  label=f"{what} ({len(hours)})" if ax is top else None)


def finish_axes(top, bottom, duration_s: float) -> None:
    """Both panels from 0 to the end of the simulation, from 0 up, with a light grid."""
    bottom.set_xlabel("simulated time (hours)")
    for ax in (top, bottom):
        ax.set_xlim(0, duration_s / 3600)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)


def save_figure(fig, path: str | Path) -> None:
    """Write `fig` to `path` (.png, .svg or .pdf) atomically: first to a hidden file next to
    it, then renamed. Call check_plot_target(path) first."""
    p = Path(path)
    try:
        with atomic_open(p) as f:
            fig.savefig(f, dpi=120, format=p.suffix.lower().lstrip("."))
    except OSError as e:
        raise PlotError(f"--plot {path}: writing failed ({e.strerror}). Fix: pass a path on a "
                        "writable file system with free space") from e


def goodput_figure(results: dict[str, PolicyResult], job: str = "", failure_rate: str = "",
                   failure_times_s: tuple[float, ...] | list[float] = (),
                   join_times_s: tuple[float, ...] | list[float] = ()):
    """A matplotlib Figure (Agg) of goodput over time, one line per policy: on top goodput
    averaged over short windows (samples/s), below the samples kept so far. Node failures are
    vertical lines; `job` and `failure_rate` make the two lines of the title."""
    duration_s = max(r.duration_s for r in results.values())
    fig, top, bottom, window_s = two_panels(duration_s)
    for i, (name, r) in enumerate(results.items()):
        wins = r.goodput_windows(window_s)
        edges = [wins[0][0] / 3600] + [t1 / 3600 for _, t1, _ in wins]
        label = (f"{_LONG.get(name, name)}: mean {r.samples_per_s:.4g} samples/s, "
                 f"{100 * r.shares['effective']:.1f} % of the time useful")
        top.stairs([g for _, _, g in wins], edges, baseline=None, label=label, color=f"C{i}",
                   linewidth=1.4)
        cum = r.goodput_cumulative()
        bottom.plot([t / 3600 for t, _ in cum], [n for _, n in cum], color=f"C{i}",
                    linewidth=1.4)
    mark_times(top, bottom, failure_times_s, duration_s, "node failure", "tab:red", ":", 0.6)
    mark_times(top, bottom, join_times_s, duration_s, "node joins", "tab:green", "--", 0.6)
    top.set_ylabel(f"goodput (samples/s,\nmean over {duration_text(window_s)})")
    bottom.set_ylabel("samples kept (cumulative)")
    finish_axes(top, bottom, duration_s)
    fig.legend(*top.get_legend_handles_labels(), loc="outside lower center", ncols=2,
               fontsize=8, frameon=False, title_fontsize=7,
               title="goodput: samples of training that are kept, per second -- work thrown "
               "away (a replayed step, everything since the last checkpoint on a restart) "
               "counts 0, as do recoveries and checkpoint writes")
    title = "Goodput under failures" + (f": {job}" if job else "")
    if failure_rate:
        title += f"\n{failure_rate}"
    fig.suptitle(title, fontsize=10)
    return fig


def plot(results: dict[str, PolicyResult], path: str | Path, job: str = "",
         failure_rate: str = "", failure_times_s: tuple[float, ...] | list[float] = (),
         join_times_s: tuple[float, ...] | list[float] = ()) -> None:
    """Write goodput_figure(...) to `path` (save_figure). Call check_plot_target(path) first."""
    save_figure(goodput_figure(results, job, failure_rate, failure_times_s, join_times_s), path)
