"""`simulate --fleet` results as a table, as JSON, and as a plot of the fleet's WAF over time
(matplotlib, imported only when a plot is asked for; sim/report.py's checks and windows)."""

from __future__ import annotations

import json
from pathlib import Path

from oobleck_hpc.fleet.simulate import FleetResult
from oobleck_hpc.sim.report import (duration_text, finish_axes, mark_times, plot_window_s,
                                    save_figure, two_panels)

LONG = {"fleet": "fleet manager (in place, then nodes moved between jobs)",
        "own": "every job on its own (in place, keeps its nodes)",
        "restart": "checkpoint-restart per job"}


def format_table(results: dict[str, FleetResult], title: str, ceiling: float) -> str:
    """One row per policy, then `ceiling` (fleet/simulate.ceiling_waf): the WAF no policy
    exceeds on this trace."""
    names = list(next(iter(results.values())).jobs)
    base = results.get("own")
    head = ["policy", "WAF", "x own"] + names + ["moves", "fallbacks"]
    rows = []
    for policy, r in results.items():
        ratio = f"{r.mean_waf / base.mean_waf:.3f}" if base and base.mean_waf > 0 else "-"
        per = r.job_waf()
        rows.append([policy, f"{r.mean_waf:.4g}", ratio] + [f"{per[n]:.3g}" for n in names]
                    + [str(r.moves), str(sum(j.fallbacks for j in r.jobs.values()))])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = [title] if title else []
    for row in [head] + rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))))
    ratio = f" = {ceiling / base.mean_waf:.3f} x own" if base and base.mean_waf > 0 else ""
    lines.append(f"ceiling: WAF {ceiling:.4g}{ratio} (the best allocation of the nodes alive at "
                 "every moment, free of cost: no policy exceeds it)")
    lines.append("WAF: mean over the simulated time of sum over jobs of weight x FLOPs per "
                 "sample x goodput (samples kept per second); per job columns are each job's "
                 "share.")
    return "\n".join(lines)


def to_json(results: dict[str, FleetResult], meta: dict, ceiling: float) -> str:
    window = plot_window_s(meta["duration_s"])
    own = results.get("own")
    ratios = ({k: r.mean_waf / own.mean_waf for k, r in results.items()}
              | {"ceiling": ceiling / own.mean_waf} if own and own.mean_waf > 0 else {})
    return json.dumps({"meta": {**meta, "window_s": window}, "ratio_to_own": ratios,
                       "ceiling_waf": ceiling,
                       "policies": {k: r.to_dict(window) for k, r in results.items()}},
                      indent=1)


def waf_figure(results: dict[str, FleetResult], title: str, failure_times_s: list[float],
               ceiling: float):
    """WAF over time per policy and the ceiling (top), and each job's nodes under the manager
    (bottom)."""
    duration_s = max(r.duration_s for r in results.values())
    fig, top, bottom, window_s = two_panels(duration_s)
    top.axhline(ceiling, color="0.4", linestyle="--", linewidth=1.0,
                label=f"ceiling (the nodes alive, best allocated; mean): {ceiling:.3g}")
    for i, (name, r) in enumerate(results.items()):
        wins = r.waf_windows(window_s)
        edges = [0.0] + [t1 / 3600 for _, t1, _ in wins]
        top.stairs([w for _, _, w in wins], edges, baseline=None, color=f"C{i}", linewidth=1.4,
                   label=f"{LONG.get(name, name)}: mean {r.mean_waf:.3g}")
    fleet = results.get("fleet") or next(iter(results.values()))
    names = list(fleet.jobs)
    times = [t / 3600 for t, _ in fleet.nodes] + [duration_s / 3600]
    for k, name in enumerate(names):
        bottom.stairs([c[k] for _, c in fleet.nodes], times, baseline=None, linewidth=1.2,
                      label=f"{name} (weight x FLOPs/sample {fleet.waf_per_sample[name]:.3g})")
    mark_times(top, bottom, failure_times_s, duration_s, "node failure", "tab:red", ":", 0.5)
    finish_axes(top, bottom, duration_s)
    top.set_ylabel(f"fleet WAF (weighted FLOP/s,\nmean over {duration_text(window_s)})")
    bottom.set_ylabel(f"nodes per job\n({fleet.policy})")
    top.legend(loc="lower left", fontsize=8)
    bottom.legend(loc="upper right", fontsize=7, ncols=2)
    fig.suptitle(title, fontsize=10)
    return fig


def plot(results: dict[str, FleetResult], path: str | Path, title: str,
         failure_times_s: list[float], ceiling: float) -> None:
    """Write waf_figure(...) to `path` atomically (sim.report.save_figure; call
    sim.report.check_plot_target first)."""
    save_figure(waf_figure(results, title, failure_times_s, ceiling), path)
