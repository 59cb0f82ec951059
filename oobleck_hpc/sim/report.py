"""Results as a table, as JSON, and as a PNG of throughput over time (matplotlib, optional)."""

from __future__ import annotations

import json
from pathlib import Path

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


class PlotUnavailable(RuntimeError):
    pass


def plot(results: dict[str, PolicyResult], path: str | Path, title: str = "") -> None:
    """Throughput over time per policy (a step line per policy), written to `path` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailable(
            "--plot needs matplotlib, which is not installed. Fix: pip install "
            "'oobleck_hpc[plot]' (or pip install matplotlib), or leave out --plot") from e
    fig, ax = plt.subplots(figsize=(9, 4))
    for name, r in results.items():
        xs, ys = [], []
        for t0, t1, rate in r.timeline:
            xs += [t0 / 3600, t1 / 3600]
            ys += [rate, rate]
        ax.plot(xs, ys, label=f"{name} (mean {r.samples_per_s:.3g}/s)", linewidth=1)
    ax.set_xlabel("time (hours)")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title(title, loc="left", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = Path(str(path) + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
