"""`oobleck-hpc fleet status RUN_DIR [--json]`: a fleet run told from its own events.

RUN_DIR/events.jsonl is written by the manager of `oobleck-hpc fleet run` (launch/fleet.py,
fleet/manager.py): `fleet_started` (the first allocation and the fleet's WAF), `fleet_nodes`
(a job's node count changed: every job's count and the WAF then), `fleet_decision` (a re-solve:
why, the counts and the WAF before and after), `fleet_drain` / `fleet_grow` (the moves),
`fleet_job_started` / `fleet_job_ended`, `fleet_resumed` (a new manager took over from the
records), `fleet_ended`. From them: each job's state and its
nodes over time, the fleet's WAF now and over time, every decision. Pure reading: the run may
still be going on. `plot_status` draws it (matplotlib, imported only then): the fleet's WAF
over time above, each job's nodes below, the decisions and the manager's take-overs marked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oobleck_hpc.errors import ConfigError
from oobleck_hpc.records.events import read_events


def read_status(run_dir: str | Path) -> dict[str, Any]:
    """The fleet run in `run_dir` as one JSON-able object (module docstring)."""
    path = Path(run_dir) / "events.jsonl"
    if not path.exists():
        raise ConfigError("<command line>", "RUN_DIR", f"value {str(run_dir)!r} holds no "
                          "events.jsonl", "give the run dir of `oobleck-hpc fleet run` (its "
                          "--run-dir)")
    events = [e for e in read_events(path) if str(e.get("kind", "")).startswith("fleet_")]
    t0 = events[0]["t"] if events else 0.0
    jobs: dict[str, dict[str, Any]] = {}
    timeline: list[dict[str, Any]] = []
    decisions: list[dict[str, Any]] = []
    moves: list[dict[str, Any]] = []
    ended = None
    for e in events:
        t, kind = round(e["t"] - t0, 3), e["kind"]
        if kind == "fleet_started":
            for name, k in e["nodes"].items():
                jobs[name] = {"state": "waiting", "nodes": k, "run_dir": e["run_dirs"][name],
                              "nodes_over_time": [[t, k]], "code": None}
            timeline.append({"t": t, "counts": dict(e["nodes"]), "waf": e["waf"]})
        elif kind == "fleet_job_started":
            jobs[e["job"]]["state"] = "running"
        elif kind == "fleet_nodes":
            job = jobs[e["job"]]
            job["nodes"] = e["nodes"]
            job["nodes_over_time"].append([t, e["nodes"]])
            timeline.append({"t": t, "counts": dict(e["counts"]), "waf": e["waf"]})
        elif kind == "fleet_job_ended":
            jobs[e["job"]].update(state="requeued" if e.get("requeued") else
                                  "finished" if e["finished"] else "failed", code=e["code"])
        elif kind == "fleet_decision":
            decisions.append({"t": t, **{k: e[k] for k in (
                "trigger", "reason", "nodes_before", "nodes_after", "waf_before", "waf_after",
                "enacted", "moves")}})
        elif kind == "fleet_resumed":
            moves.append({"t": t, "move": "resumed", "pid": e["pid"], "since_s": e["since_s"],
                          "pending": e["pending"]})
        elif kind in ("fleet_drain", "fleet_grow", "fleet_move_failed", "fleet_stop"):
            moves.append({"t": t, "move": kind[len("fleet_"):],
                          **{k: v for k, v in e.items() if k in ("job", "node", "nodes",
                                                                 "for_job", "from_job",
                                                                 "reason")}})
        elif kind == "fleet_ended":
            ended = {"t": t, "codes": e["codes"]}
    return {"run_dir": str(run_dir), "jobs": jobs,
            "waf_now": timeline[-1]["waf"] if timeline else 0.0,
            "waf_over_time": [[x["t"], x["waf"]] for x in timeline], "timeline": timeline,
            "decisions": decisions, "moves": moves, "ended": ended,
            "last_t": round(events[-1]["t"] - t0, 3) if events else 0.0}


def format_status(rep: dict[str, Any]) -> str:
    """The status as text: jobs, WAF over time, decisions, moves."""
    state = "ended" if rep["ended"] else "running"
    lines = [f"fleet in {rep['run_dir']}: {state}; WAF now {rep['waf_now']:.3e} weighted FLOP/s"]
    lines.append(f"{'job':<20} {'state':<9} {'nodes':>5}  nodes over time (s: nodes)")
    for name, j in rep["jobs"].items():
        over = ", ".join(f"{t:g}: {k}" for t, k in j["nodes_over_time"])
        lines.append(f"{name:<20} {j['state']:<9} {j['nodes']:>5}  {over}")
    lines.append("WAF over time: " + ", ".join(f"{t:g} s {w:.3e}"
                                               for t, w in rep["waf_over_time"]))
    told = []  # (t, line): the decisions and the moves, in the order they happened
    for d in rep["decisions"]:
        moved = "; ".join(f"{n} {a}->{b}" for n, a, b in d["moves"]) or "no move"
        told.append((d["t"], f"decision: {d['reason']}: {moved}; WAF {d['waf_before']:.3e} -> "
                     f"{d['waf_after']:.3e}" + ("" if d["enacted"] else " (not enacted)")))
    for m in rep["moves"]:
        if m["move"] == "drain":
            what = f"drain {m['node']} of {m['job']} for {m['for_job'] or '(free)'}"
        elif m["move"] == "resumed":
            what = (f"a new manager (pid {m['pid']}) took over, {m['since_s']:g} s after the "
                    f"last records; it redid {', '.join(m['pending']) or 'nothing'}")
        elif m["move"] == "stop":
            what = f"stop: {m['reason']}"
        elif m["move"] == "grow":
            what = f"grow {m['job']} by {', '.join(m['nodes'])} (from {m['from_job'] or 'free'})"
        else:
            what = f"move failed in {m['job']}: {m['reason']}"
        told.append((m["t"], what))
    lines += [f"{t:>8.2f} s {line}" for t, line in sorted(told, key=lambda x: x[0])]
    return "\n".join(lines)


def is_fleet_run(run_dir: str | Path) -> bool:
    """Whether `run_dir` is a fleet's run dir (`oobleck-hpc report` tells it as `fleet status`
    does)."""
    path = Path(run_dir) / "events.jsonl"
    if not path.exists():
        return False
    with open(path, "rb") as f:
        first = f.readline()
    return b'"kind":"fleet_' in first


def plot_status(rep: dict[str, Any], path: str | Path) -> None:
    """The fleet's WAF over time (top) and each job's nodes (bottom), in seconds since its
    start; decisions dotted, a new manager's take-over dashed. Written atomically (call
    sim.report.check_plot_target first)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from oobleck_hpc.sim.report import save_figure

    end = rep["ended"]["t"] if rep["ended"] else rep["last_t"] * 1.05 + 0.1  # (still going)
    fig = Figure(figsize=(11, 6.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    waf = rep["waf_over_time"]
    if waf:
        top.stairs([w for _, w in waf], [t for t, _ in waf] + [end], baseline=None,
                   linewidth=1.4, label=f"fleet WAF (now {rep['waf_now']:.3g})")
    for name, job in rep["jobs"].items():
        over = job["nodes_over_time"]
        bottom.stairs([k for _, k in over], [t for t, _ in over] + [end], baseline=None,
                      linewidth=1.2, label=f"{name} ({job['state']})")
    marks = [(d["t"], ":", "tab:gray", "decision") for d in rep["decisions"]]
    marks += [(m["t"], "--", "tab:red", "new manager") for m in rep["moves"]
              if m["move"] == "resumed"]
    labelled = set()
    for t, style, color, what in marks:
        for ax in (top, bottom):
            ax.axvline(t, linestyle=style, color=color, linewidth=0.8,
                       label=what if ax is top and what not in labelled else None)
        labelled.add(what)
    bottom.set_xlabel("seconds since the fleet started")
    top.set_ylabel("fleet WAF (weighted FLOP/s)")
    bottom.set_ylabel("nodes per job")
    for ax in (top, bottom):
        ax.set_xlim(0, end)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left", fontsize=8)
    fig.suptitle(f"fleet in {rep['run_dir']}", fontsize=10)
    save_figure(fig, path)
