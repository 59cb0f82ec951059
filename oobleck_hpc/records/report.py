"""`oobleck-hpc report RUN_DIR [--run ID] [--plot FILE] [--json]`: the story of a run after the fact.

Reads the run's records (oobleck_hpc/records/runs.py: RUN_DIR/events.jsonl and metrics.jsonl for the
current run, RUN_DIR/history/ID/ for an earlier one) and tells:

- the timeline: the console's lines (oobleck_hpc/records/story.py), each with its time since the start;
- the steps: committed, computed (a step replayed after a fallback counts twice), loss first
  and last, step time (median, p90);
- each recovery and its phases, from the first sign of the failure (an injected fault or a
  `kill-node`: the moment of the kill; else the first survivor that noticed) to the first step
  committed on the new plan: detect (-> the first survivor noticed it), agree (-> the new
  generation was decided), plan (-> the plan was chosen), regroup (-> process groups rebuilt),
  transfer (-> the last rank finished moving layer state), first_step (-> the replayed step
  committed);
- time lost per cause: `startup` (each attempt's start until its first committed step, less
  one step), `recovery` (each in-place recovery, less the one step it replays), `replayed`
  (steps computed again after a fallback: their first computation was thrown away), `requeue`
  (from the last step of an attempt to the first of the next, less one step);
- start-up as a phase of its own: each attempt from its start (the launch, a requeue's
  restart) to its first committed step -- processes starting, torch imported, the plan, the
  process groups, the first step's warm-up -- in the timeline (`startups`, `startup_s`);
- goodput: samples of distinct committed steps per second of the run's wall time, start-up
  included, next to the throughput (every sample computed, replays included, per second of that
  same time), and the goodput while training (`training_goodput_samples_per_s`): samples of
  the distinct steps committed after the run's first committed step, per second from that
  step's commit to the last (`training_s`; recoveries and requeues inside it count). The
  console's `done:` line counts something else again: its attempt's training loop only (from
  the start of its first step to the final parameters written, oobleck_hpc/records/story.py).

`--plot FILE` draws loss and throughput per step against time, with the faults, recoveries,
checkpoints and requeues marked (matplotlib, Agg). `--json` prints the report as one object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from oobleck_hpc.records import runs
from oobleck_hpc.records import events as ev
from oobleck_hpc.records.events import read_events, read_jsonl
from oobleck_hpc.errors import OobleckError
from oobleck_hpc.records.story import SIGNS, Story, plural

PHASES = ("detect", "agree", "plan", "regroup", "transfer", "first_step")


class ReportError(OobleckError):
    exit_code = 2


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="what happened in a run: timeline, recoveries, goodput",
                       description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="the job's run directory (e.g. runs/gpt-tiny-local)")
    p.add_argument("--run", default=None, metavar="ID",
                   help="an earlier run (its id under RUN_DIR/history/); default: the current one")
    p.add_argument("--plot", default=None, metavar="FILE", help="draw the run into this PNG")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.set_defaults(func=main)


def records(run_dir: str | Path, run: str | None = None) -> tuple[str, list[dict], list[dict]]:
    """(run id, events, metrics rows) of the current run of RUN_DIR, or of run `run`."""
    run_dir, where = Path(run_dir), where_of(run_dir, run)
    run_id = run or runs.read_run_id(run_dir)
    events = read_events(where / "events.jsonl")
    rows = read_jsonl(where / "metrics.jsonl")
    if run_id:  # a file may hold lines of records written before run ids existed
        events = [e for e in events if e.get("run", run_id) == run_id]
        rows = [r for r in rows if r.get("run", run_id) == run_id]
    return run_id, events, rows


def where_of(run_dir: str | Path, run: str | None = None) -> Path:
    """The directory holding the records of RUN_DIR's current run, or of run `run`."""
    run_dir = Path(run_dir)
    where = run_dir
    if run is not None and run != runs.read_run_id(run_dir):
        where = run_dir / runs.HISTORY / run
        if not where.is_dir():
            known = [p.name for p in runs.history(run_dir)]
            raise ReportError(f"{run_dir}: no run {run!r}. Fix: pick one of "
                              f"{', '.join(known) or '(no earlier run)'}, or leave out --run")
    if not (where / "events.jsonl").exists():
        raise ReportError(f"{where}: no events.jsonl: not the run directory of a job that ran "
                          f"(the job file's run_dir, default runs/<name>). Fix: pass that "
                          "directory")
    return where


def recovery_phases(events: list[dict], recovered: dict, t0: float) -> dict[str, float]:
    """The phases (module docstring) of the recovery that ended with `recovered`, from `t0`
    (the first sign of the failure); each phase's seconds, 0 when it had nothing to do."""
    window = [e for e in events if t0 <= e["t"] <= recovered["t"]]

    def first(*kinds: str) -> float | None:
        ts = [e["t"] for e in window if e["kind"] in kinds]
        return min(ts) if ts else None

    transferred = [e["t"] for e in window if e["kind"] == ev.STATE_TRANSFERRED]
    marks = [("detect", first(ev.FAILURE_DETECTED, ev.STEP_FAILED, ev.ROUND_STARTED)),
             ("agree", first(ev.AGREEMENT_REACHED, ev.MEMBERSHIP_AGREED)),
             ("plan", first(ev.PLAN_CHOSEN)), ("regroup", first(ev.GROUPS_REBUILT)),
             ("transfer", max(transferred) if transferred else None),
             ("first_step", recovered["t"])]
    out, prev = {}, t0
    for name, t in marks:
        t = prev if t is None else max(prev, t)
        out[name] = round(t - prev, 4)
        prev = t
    return out


def build(run_dir: str | Path, run: str | None = None) -> dict[str, Any]:
    run_id, events, rows = records(run_dir, run)
    if not events:
        raise ReportError(f"{run_dir}: the run {run_id or ''} recorded no events yet")
    t_start = events[0]["t"]
    t_end = max([events[-1]["t"]] + [r["time"] for r in rows])
    started = next((e for e in events if e["kind"] == ev.RUN_STARTED), {})
    finished = next((e for e in reversed(events) if e["kind"] == ev.RUN_FINISHED), None)
    outcome = runs.outcome(where_of(run_dir, run), run_id)  # the verdict every command uses
    step_s = [r["seconds"] for r in rows]
    median = statistics.median(step_s) if step_s else 0.0

    # The timeline, and the recoveries with their phases, as the story tells them.
    story, timeline, recoveries, sign = Story(), [], [], None
    for e in events:
        if e["kind"] in SIGNS:
            sign = e["t"] if sign is None else min(sign, e["t"])
        for line in story.feed(e):
            timeline.append({"t": round(e["t"] - t_start, 3), "kind": e["kind"], "line": line})
        if e["kind"] == ev.RECOVERED:
            t0 = sign if sign is not None else e["t"] - e.get("seconds", 0.0)
            recoveries.append({"step": e["step"], "lost": e.get("lost", []),
                               "joined": e.get("joined", []), "drained": e.get("drained", []),
                               "generation": e.get("generation"), "plan": e.get("plan"),
                               "t": round(e["t"] - t_start, 3), "t_fault": round(t0 - t_start, 3),
                               "recovery_s": round(e["t"] - t0, 4),
                               "phases": recovery_phases(events, e, t0),
                               "bytes_moved": e.get("bytes_moved", 0),
                               "rounds": e.get("rounds", 1)})
            sign = None
        elif e["kind"] in (ev.FALLBACK, ev.REQUEUED):
            sign = None

    # Steps per attempt; a step computed again by a later attempt was thrown away the first time.
    attempts = sorted({r.get("attempt", 0) for r in rows} | {e.get("attempt", 0) for e in events})
    by_attempt = {a: [r for r in rows if r.get("attempt", 0) == a] for a in attempts}
    final = {}
    for r in rows:
        final[r["step"]] = r  # the last computation of each step is the one that counts
    replayed = [r for r in rows if final[r["step"]] is not r]
    lost = {"startup": 0.0, "recovery": 0.0, "replayed": 0.0, "requeue": 0.0}
    for a in attempts:
        mine = by_attempt[a]
        begun = [e["t"] for e in events if e.get("attempt", 0) == a
                 and e["kind"] in (ev.RUN_STARTED, ev.AGENT_STARTED)]
        if mine and begun:
            lost["startup"] += max(0.0, mine[0]["time"] - min(begun) - median)
    for prev, nxt in zip(attempts, attempts[1:]):
        if by_attempt[prev] and by_attempt[nxt]:
            lost["requeue"] += max(0.0, by_attempt[nxt][0]["time"] - by_attempt[prev][-1]["time"]
                                   - median)
    lost["recovery"] = sum(max(0.0, r["recovery_s"] - median) for r in recoveries)
    lost["replayed"] = sum(r["seconds"] for r in replayed)
    wall = max(t_end - t_start, 1e-9)
    useful = sum(r["samples"] for r in final.values())
    computed = sum(r["samples"] for r in rows)

    # Start-up, a phase of its own: each attempt's start to its first committed step.
    startups = []
    for a in attempts:
        begun = [e["t"] for e in events if e.get("attempt", 0) == a
                 and e["kind"] in (ev.RUN_STARTED, ev.AGENT_STARTED)]
        if by_attempt[a] and begun:
            first = by_attempt[a][0]
            startups.append({"attempt": a, "t": round(min(begun) - t_start, 3),
                             "t_first_step": round(first["time"] - t_start, 3),
                             "first_step": first["step"],
                             "seconds": round(first["time"] - min(begun), 3)})
    for x in startups:
        line = (f"start-up done: step {x['first_step']} committed {x['seconds']:.2f} s after "
                + (f"attempt {x['attempt']} started" if x["attempt"] else "the launch")
                + " (processes, torch, plan, groups, the first step's warm-up)")
        timeline.append({"t": x["t_first_step"], "kind": "startup", "line": line})
    timeline.sort(key=lambda x: x["t"])  # stable: the events' own order where times tie

    # Goodput while training: from the run's first committed step to its last.
    t_first = rows[0]["time"] if rows else t_start
    t_last = max((r["time"] for r in rows), default=t_start)
    training_s = t_last - t_first
    trained = sum(r["samples"] for r in final.values() if r["time"] > t_first)
    return {
        "run": run_id, "run_dir": str(run_dir), "job": started.get("job"),
        "model": started.get("model") or (finished or {}).get("model"),
        "launch": started.get("launch"), "attempts": len(attempts),
        "started_at": t_start, "wall_s": round(wall, 3),
        "finished": outcome.finished, "outcome": outcome.describe(),
        "steps": {"committed": len(final), "computed": len(rows),
                  "total": started.get("steps"), "replayed": len(replayed)},
        "loss": {"first": rows[0]["loss"] if rows else None,
                 "last": final[max(final)]["loss"] if final else None},
        "step_time_s": {"median": round(median, 4),
                        "p90": round(_quantile(step_s, 0.9), 4) if step_s else 0.0},
        "throughput_samples_per_s": round(computed / wall, 2),
        "goodput_samples_per_s": round(useful / wall, 2),
        "goodput_fraction": round(useful / computed, 4) if computed else 0.0,
        "startup_s": round(sum(x["seconds"] for x in startups), 3),
        "startups": startups,
        "training_s": round(training_s, 3),
        "training_goodput_samples_per_s": (round(trained / training_s, 2)
                                           if training_s > 0 else 0.0),
        "time_lost_s": {k: round(v, 3) for k, v in lost.items()},
        "recoveries": recoveries,
        "checkpoints": [{"step": e["step"], "t": round(e["t"] - t_start, 3),
                         "bytes": e.get("bytes", 0)}
                        for e in events if e["kind"] == ev.CHECKPOINT_SAVED],
        "requeues": [{"t": round(e["t"] - t_start, 3), "next_attempt": e.get("next_attempt"),
                      "nodes": e.get("nodes"), "reason": e.get("reason")}
                     for e in events if e["kind"] == ev.REQUEUED],
        "timeline": timeline,
    }


def what(r: dict[str, Any]) -> str:
    """What a recovery was about: 'lost node2', 'drained node3', '+node5' (joined), or
    '(retry)' when no node left or came (a retry in place, a restarted worker)."""
    lost = [n for n in r["lost"] if n not in r.get("drained", [])]
    parts = ([f"lost {','.join(lost)}"] if lost else []) + (
        [f"drained {','.join(r.get('drained', []))}"] if r.get("drained") else []) + (
        [f"+{','.join(r.get('joined', []))}"] if r.get("joined") else [])
    return " ".join(parts) or "(retry)"


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def text(rep: dict[str, Any]) -> str:
    st = rep["steps"]
    lines = [f"run {rep['run'] or '(unnamed)'} of {rep['job'] or 'the job'} ({rep['run_dir']}): "
             f"{st['committed']}" + (f"/{st['total']}" if st["total"] else "")
             + f" steps committed in {rep['wall_s']:.1f} s over {rep['attempts']} "
             f"attempt{'s' if rep['attempts'] != 1 else ''}"
             + ("" if rep["finished"] else f" ({rep['outcome']})")]
    if rep["loss"]["first"] is not None:
        lines.append(f"loss {rep['loss']['first']:.4f} -> {rep['loss']['last']:.4f}; step time "
                     f"median {rep['step_time_s']['median'] * 1000:.1f} ms, p90 "
                     f"{rep['step_time_s']['p90'] * 1000:.1f} ms")
    starts = rep["startups"]
    startup = (f"start-up {rep['startup_s']:.1f} s" if len(starts) < 2 else
               "start-ups " + " + ".join(f"{x['seconds']:.1f}" for x in starts) + " s")
    lines.append(f"goodput {rep['goodput_samples_per_s']:.1f} samples/s over the whole run "
                 f"({rep['wall_s']:.1f} s, {startup} included); "
                 f"{rep['training_goodput_samples_per_s']:.1f} samples/s while training (first "
                 f"committed step to last, {rep['training_s']:.1f} s)")
    lines.append(f"throughput {rep['throughput_samples_per_s']:.1f} samples/s over the whole run "
                 f"(every sample computed; {plural(st['replayed'], 'step')} computed twice)")
    lost = rep["time_lost_s"]
    lines.append("time lost: " + ", ".join(f"{k} {v:.2f} s" for k, v in lost.items()))
    if rep["recoveries"]:
        lines.append("\nrecoveries (seconds from the fault):")
        lines.append(f"{'step':>5} {'what':<14} {'total':>6}  "
                     + " ".join(f"{p:>10}" for p in PHASES) + "  moved")
        for r in rep["recoveries"]:
            lines.append(f"{r['step']:>5} {what(r):<14} "
                         f"{r['recovery_s']:>6.2f}  "
                         + " ".join(f"{r['phases'][p]:>10.3f}" for p in PHASES)
                         + f"  {r['bytes_moved'] / 1e6:.2f} MB")
    lines.append("\ntimeline:")
    for x in rep["timeline"]:
        first, *more = x["line"].split("\n")
        lines += [f"{x['t']:>9.2f} s  {first}"] + [" " * 13 + m for m in more]
    return "\n".join(lines)


def check_plot_target(path: str) -> None:
    """Fail before any work when the plot cannot be made (no matplotlib, unwritable path)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ReportError(f"--plot needs matplotlib ({e}). Fix: pip install matplotlib (it is a "
                          "dependency of oobleck_hpc: reinstall with `pip install -e .`)") from e
    parent = Path(path).expanduser().absolute().parent
    if not parent.is_dir():
        raise ReportError(f"--plot {path}: directory {parent} does not exist. Fix: create it or "
                          "pick another path")


def plot(rep: dict[str, Any], rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = rep["started_at"]
    fig, (ax_loss, ax_tp) = plt.subplots(2, 1, sharex=True, figsize=(10, 6.5))
    for a in sorted({r.get("attempt", 0) for r in rows}):
        mine = [r for r in rows if r.get("attempt", 0) == a]
        t = [r["time"] - t0 for r in mine]
        label = f"attempt {a}" if rep["attempts"] > 1 else None
        ax_loss.plot(t, [r["loss"] for r in mine], ".-", ms=3, lw=1, label=label)
        ax_tp.plot(t, [r["samples"] / max(r["seconds"], 1e-9) for r in mine], ".", ms=3)
    # The goodput over the whole run (start-up included) spans the whole run; the goodput
    # while training spans the first committed step to the last.
    ax_tp.hlines(rep["goodput_samples_per_s"], 0, rep["wall_s"], color="k", ls="--", lw=1,
                 label=f"goodput over the whole run (start-up included): "
                       f"{rep['goodput_samples_per_s']:.1f} samples/s")
    if rows and rep["training_s"] > 0:
        first = rows[0]["time"] - t0
        ax_tp.hlines(rep["training_goodput_samples_per_s"], first, first + rep["training_s"],
                     color="tab:green", ls="--", lw=1.2,
                     label=f"goodput while training (first committed step to last): "
                           f"{rep['training_goodput_samples_per_s']:.1f} samples/s")
    for ax in (ax_loss, ax_tp):
        for i, x in enumerate(rep["startups"]):
            ax.axvspan(x["t"], x["t_first_step"], color="tab:blue", alpha=0.12,
                       label=("start-up (launch -> first committed step)"
                              if ax is ax_tp and i == 0 else None))
        for i, r in enumerate(rep["recoveries"]):
            ax.axvspan(r["t_fault"], r["t"], color="tab:red", alpha=0.25,
                       label=("recovery (fault -> first committed step)"
                              if ax is ax_tp and i == 0 else None))
            ax.axvline(r["t_fault"], color="tab:red", lw=1)
        for i, c in enumerate(rep["checkpoints"]):
            ax.axvline(c["t"], color="tab:gray", lw=0.6, ls=":",
                       label="checkpoint written" if ax is ax_tp and i == 0 else None)
        for i, q in enumerate(rep["requeues"]):
            ax.axvline(q["t"], color="tab:orange", lw=1.5,
                       label="fallback + requeue" if ax is ax_tp and i == 0 else None)
    for x in rep["startups"]:
        ax_loss.annotate(f"start-up\n{x['seconds']:.1f} s", (x["t"], 1),
                         xycoords=("data", "axes fraction"), va="top", fontsize=8,
                         color="tab:blue", xytext=(3, -3), textcoords="offset points")
    for r in rep["recoveries"]:
        ax_loss.annotate(f"{what(r)}\n{r['recovery_s']:.2f} s",
                         (r["t_fault"], 1), xycoords=("data", "axes fraction"), va="top",
                         fontsize=8, color="tab:red", xytext=(3, -3), textcoords="offset points")
    ax_loss.set_ylabel("loss")
    ax_tp.set_ylabel("samples/s (per step)")
    ax_tp.set_xlabel("seconds since the run started")
    ax_tp.set_xlim(0, rep["wall_s"] * 1.01)  # from the launch: start-up is part of the run
    # Where start-up dominates the run its span is empty of points: the legend goes there.
    startup_share = rep["startup_s"] / max(rep["wall_s"], 1e-9)
    ax_tp.legend(loc="upper left" if startup_share > 0.4 else "lower right", fontsize=8)
    if rep["attempts"] > 1:
        ax_loss.legend(loc="upper right", fontsize=8)
    fig.suptitle(f"{rep['job'] or 'run'} {rep['run']}: {rep['steps']['committed']} steps, "
                 f"{plural(len(rep['recoveries']), 'recovery', 'recoveries')} in place, "
                 f"{plural(len(rep['requeues']), 'requeue')}\n"
                 f"goodput {rep['goodput_samples_per_s']:.1f} samples/s over the whole run, "
                 f"{rep['training_goodput_samples_per_s']:.1f} while training")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    from oobleck_hpc.fleet.status import is_fleet_run

    if is_fleet_run(args.run_dir):  # (a fleet's run dir: its jobs, nodes and WAF over time)
        from oobleck_hpc.fleet.cli import status

        return status(args)
    if args.plot:
        check_plot_target(args.plot)
    rep = build(args.run_dir, args.run)
    if args.plot:
        _, _, rows = records(args.run_dir, args.run)
        plot(rep, rows, args.plot)
        rep["plot"] = str(args.plot)
    if args.json:
        json.dump(rep, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(text(rep))
        if args.plot:
            print(f"\nplot: {args.plot}")
    return 0
