"""`oobleck-hpc fleet chaos FLEET.yaml --trials N --seed S`: random faults in the jobs of a fleet,
and its manager killed, against each job's exact fp64 reference (issue 32).

A trial runs the whole fleet on this machine (`oobleck-hpc fleet run`, launch/fleet.py) with
every job as `oobleck-hpc chaos` makes a trial of it (operate/chaos.trial_job: fp64, `--steps`
+ `--tail-steps` steps, final parameters saved, a checkpoint every --checkpoint-every steps, the
launcher's short kill grace) and its own random fault set: nothing for about a third of the
jobs, else faults of --kinds drawn as chaos.draw_trial draws them, on the node count the
fleet's first decision gives the job: 1..f of them, which the job survives in place (a drain
or a grow changes its count), or, with probability --beyond-share where the job has more than
f + 1 nodes, f + 1 or more: beyond its guarantee, so it may fall back to its checkpoint, wait
inside the fleet and be started again (a requeue in the fleet). A move between jobs follows a
loss whenever it pays. Once
per trial the manager is SIGKILLed at a random time in the first --manager-kill-s seconds and a
new one takes over (`fleet run --resume`) after a random pause of up to 3 s: mid-move, mid-
recovery, or while nothing happens.

Judged per trial: the last manager's exit code (0: every job finished), and for every job that
its metrics hold every step once per attempt (chaos.check_steps) and its final parameters equal
those of its own failure-free fp64 run (engine.reference_run, once per distinct job) within
--tol. Outcomes: exact, wrong_state (exit 0 but a job's steps or parameters are off), dead_end
(exit != 0), hung (past --trial-timeout: every process of the trial is killed, by pid:
cleanup.kill_fleet). Each trial records the faults drawn and fired, the moves (drains, grows),
the requeues inside the fleet, the manager's kill time and its take-over, and every job's
recovery times. Exit code: 0 when every trial was exact, else 1.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from oobleck_hpc.config import FaultConfig
from oobleck_hpc.files import write_json
from oobleck_hpc.operate.chaos import KINDS, check_steps, draw_trial, max_rel_diff, trial_job
from oobleck_hpc.operate.cleanup import kill_fleet
from oobleck_hpc.records import events as ev

RESUME_PAUSE_S = 3.0
"""The longest pause between the manager's kill and the new one's start."""


@dataclass
class FleetTrial:
    index: int
    faults: dict[str, list[FaultConfig]]
    kill_at_s: float
    """When the manager is SIGKILLed, seconds after the fleet started."""
    resume_after_s: float
    exit: int | None = None
    outcome: str = ""
    killed: bool = False
    """The manager was killed (the fleet had not ended by kill_at_s) and a new one took over."""
    fired: dict[str, list[FaultConfig]] = field(default_factory=dict)
    max_rel_diff: dict[str, float | None] = field(default_factory=dict)
    steps_complete: dict[str, bool] = field(default_factory=dict)
    recovery_s: dict[str, list[float]] = field(default_factory=dict)
    moves: int = 0
    requeues: int = 0
    wall_s: float = 0.0
    dir: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["faults"] = {j: [asdict(x) for x in fs] for j, fs in self.faults.items()}
        d["fired"] = {j: [asdict(x) for x in fs] for j, fs in self.fired.items()}
        return d


def draw(seed: int, index: int, counts: dict[str, int], fs: dict[str, int], steps: int,
         kinds: list[str], kill_window_s: float, beyond_share: float = 0.0) -> FleetTrial:
    """Trial `index`'s faults and manager kill, from its own generator (module docstring)."""
    rng = random.Random(f"oobleck-fleet-chaos/{seed}/{index}")
    faults = {}
    for job, k in counts.items():
        none = k == 0 or rng.random() < 1 / 3
        faults[job] = [] if none else draw_trial(rng, k, steps, fs[job], kinds, beyond_share)
    return FleetTrial(index, faults, round(rng.uniform(1.0, kill_window_s), 2),
                      round(rng.uniform(0.0, RESUME_PAUSE_S), 2))


def run_trial(trial: FleetTrial, fleet_data: dict, jobs: dict, references: dict, total: int,
              every: int, campaign: Path, timeout_s: float, tol: float) -> FleetTrial:
    import yaml

    from oobleck_hpc.records.events import read_events, read_jsonl

    trial_dir = campaign / f"trial-{trial.index:03d}"
    shutil.rmtree(trial_dir, ignore_errors=True)
    trial_dir.mkdir(parents=True)
    trial.dir = str(trial_dir)
    entries = []
    for entry in fleet_data["jobs"]:
        name = entry["name"]
        d = trial_job(jobs[name], trial.faults[name], trial_dir / name, total, every)
        d["cluster"]["nodes"] = max([d["cluster"]["nodes"]]  # (a fault's node must be in it)
                                    + [x.node + 1 for x in trial.faults[name]])
        (trial_dir / f"{name}.yaml").write_text(yaml.safe_dump(d, sort_keys=False))
        entries.append({**entry, "job": f"{name}.yaml"})
    path = trial_dir / "fleet.yaml"
    path.write_text(yaml.safe_dump({**fleet_data, "jobs": entries}, sort_keys=False))
    run_dir = trial_dir / "run"
    cmd = [sys.executable, "-m", "oobleck_hpc", "fleet", "run", str(path), "--run-dir",
           str(run_dir)]
    managers: list[subprocess.Popen] = []
    t0 = time.monotonic()
    with open(trial_dir / "out.log", "w") as log:
        def manager(*extra: str) -> subprocess.Popen:
            managers.append(subprocess.Popen(cmd + list(extra), stdout=log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True))
            return managers[-1]
        try:
            first = manager()
            try:
                trial.exit = first.wait(timeout=trial.kill_at_s)
            except subprocess.TimeoutExpired:
                first.send_signal(signal.SIGKILL)  # (only the manager: the jobs train on)
                first.wait()
                trial.killed = True
                time.sleep(trial.resume_after_s)
                left = timeout_s - (time.monotonic() - t0)
                trial.exit = manager("--resume").wait(timeout=max(1.0, left))
        except subprocess.TimeoutExpired:
            trial.exit = None
        finally:
            kill_fleet(managers, run_dir)
    trial.wall_s = round(time.monotonic() - t0, 2)

    fleet_events = read_events(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() \
        else []
    trial.moves = sum(e["kind"] in (ev.FLEET_DRAIN, ev.FLEET_GROW) for e in fleet_events)
    trial.requeues = sum(bool(e.get("requeued")) for e in fleet_events
                         if e["kind"] == ev.FLEET_JOB_ENDED)
    exact = True
    for name, reference in references.items():
        job_dir = run_dir / name
        events = read_events(job_dir / "events.jsonl") if (job_dir / "events.jsonl").exists() \
            else []
        fired = {(e.get("node"), e.get("step"), e.get("phase"), e.get("fault"))
                 for e in events if e.get("kind") == ev.FAULT_INJECTED}
        trial.fired[name] = [x for x in trial.faults[name]
                             if (f"node{x.node}", x.step, x.phase, x.kind) in fired]
        trial.recovery_s[name] = [round(float(e["seconds"]), 3) for e in events
                                  if e.get("kind") == ev.RECOVERED]
        rows = read_jsonl(job_dir / "metrics.jsonl") if (job_dir / "metrics.jsonl").exists() \
            else []
        trial.steps_complete[name] = check_steps(rows, total)
        trial.max_rel_diff[name] = max_rel_diff(job_dir / "final", reference)
        diff = trial.max_rel_diff[name]
        exact &= trial.steps_complete[name] and diff is not None and diff <= tol
    trial.outcome = ("hung" if trial.exit is None else "dead_end" if trial.exit != 0 else
                     "exact" if exact else "wrong_state")
    return trial


def summarize(trials: list[FleetTrial], fs: dict[str, int]) -> dict[str, Any]:
    kills = [r for t in trials for rs in t.recovery_s.values() for r in rs]
    return {"trials": len(trials),
            **{k: sum(t.outcome == k for t in trials)
               for k in ("exact", "wrong_state", "dead_end", "hung")},
            "manager_killed": sum(t.killed for t in trials),
            "faults": sum(len(fs) for t in trials for fs in t.faults.values()),
            "faults_fired": sum(len(fs) for t in trials for fs in t.fired.values()),
            "jobs_beyond_f": sum(len(x) > fs[j] for t in trials for j, x in t.faults.items()),
            "moves": sum(t.moves for t in trials),
            "requeues_in_fleet": sum(t.requeues for t in trials),
            "recoveries": len(kills),
            "recovery_s_max": max(kills, default=None)}


def _result(trials: list[FleetTrial], fs: dict[str, int], counts: dict[str, int],
            done: bool) -> dict[str, Any]:
    """The campaign's result so far (`done`: every trial ran)."""
    return {"trials": [t.to_dict() for t in trials], "summary": summarize(trials, fs),
            "first_allocation": counts, "complete": done}


def run(args: argparse.Namespace) -> int:
    from oobleck_hpc.config import load_job
    from oobleck_hpc.engine import reference_run
    from oobleck_hpc.errors import ConfigError
    from oobleck_hpc.fleet.allocate import decide
    from oobleck_hpc.fleet.config import load_fleet
    from oobleck_hpc.fleet.curves import job_curve
    from oobleck_hpc.fleet.manager import JobState
    from oobleck_hpc.schema import read_mapping

    fleet, entries = load_fleet(args.fleet)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        raise ConfigError("<command line>", "--kinds", f"value {args.kinds!r} names no fault kind "
                          "or unknown ones", f"use some of {','.join(KINDS)}")
    if not 0.0 <= args.beyond_share <= 1.0:
        raise ConfigError("<command line>", "--beyond-share", f"value {args.beyond_share} is "
                          "not a share", "give a number from 0 (always within f) to 1")
    for fj in entries:
        if fj.job.cluster.launch != "local":
            raise ConfigError(str(fleet.job_path(fj.entry)), "cluster.launch",
                              f"value {fj.job.cluster.launch!r}: chaos trials run on this "
                              "machine", "set cluster.launch: local")
    total = args.steps + args.tail_steps
    every = args.checkpoint_every or max(1, args.steps // 3)
    states = [JobState(fj.name, job_curve(fj, fleet.pool.nodes).waf, fj.entry.min_nodes,
                       fj.entry.max_nodes, fj.entry.transition_s) for fj in entries]
    first = decide([s.curve() for s in states], fleet.pool.nodes)
    counts = {fj.name: k for fj, k in zip(entries, first.nodes)}
    fs = {fj.name: fj.job.fault_tolerance.f for fj in entries}
    jobs = {fj.name: fj.job for fj in entries}
    references: dict[str, Any] = {}
    by_job: dict[str, Any] = {}  # (one reference per distinct job: its file)
    for fj in entries:
        key = str(fleet.job_path(fj.entry).resolve())
        if key not in by_job:  # (the trials' fp64 job, as trial_job makes it)
            base = load_job(fleet.job_path(fj.entry), {"model.dtype": "float64",
                                                        "train.steps": total, "faults": []})
            by_job[key] = reference_run(base, total)[1]
        references[fj.name] = by_job[key]
    data = read_mapping(Path(args.fleet), "fleet file")
    data["jobs"] = [{**raw, "name": fj.name} for raw, fj in zip(data["jobs"], entries)]
    campaign = Path(args.out or f"runs/fleet-chaos-{fleet.name}-seed{args.seed}")
    campaign.mkdir(parents=True, exist_ok=True)
    trials = []
    for i in range(args.trials):
        t = run_trial(draw(args.seed, i, counts, fs, args.steps, kinds, args.manager_kill_s,
                           args.beyond_share),
                      data, jobs, references, total, every, campaign, args.trial_timeout,
                      args.tol)
        trials.append(t)
        write_json(campaign / "result.json",  # after every trial, whole (chaos.write_result)
                   _result(trials, fs, counts, done=i + 1 == args.trials))
        if not args.json:
            drawn = "; ".join(f"{j}: " + ", ".join(f"{x.kind} node{x.node}@{x.step}/{x.phase}"
                                                  for x in fs_) for j, fs_ in t.faults.items()
                              if fs_) or "no faults"
            print(f"trial {i}: {drawn}; manager killed at {t.kill_at_s} s "
                  f"{'(took over)' if t.killed else '(had ended)'} -> {t.outcome} "
                  f"({t.moves} moves, {t.requeues} requeues, {t.wall_s:.1f} s)", flush=True)
    result = _result(trials, fs, counts, done=True)  # (as written after the last trial)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print("summary: " + ", ".join(f"{k} {v}" for k, v in result["summary"].items()))
        print(f"campaign: {campaign} (result.json, trial-<i>/out.log, trial-<i>/run/)")
    return 0 if all(t.outcome == "exact" for t in trials) else 1


def register(fleet_sub: argparse._SubParsersAction) -> None:
    p = fleet_sub.add_parser("chaos", help="random faults in a fleet's jobs and a kill of its "
                             "manager, against each job's exact fp64 reference",
                             description=__doc__.splitlines()[0])
    p.add_argument("fleet", help="YAML fleet file (its jobs: cluster.launch local)")
    p.add_argument("--trials", type=int, default=5, help="number of trials (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the trials (default 0)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"fault kinds to draw from (default {','.join(KINDS)})")
    p.add_argument("--steps", type=int, default=12, help="steps faults are drawn in (default 12)")
    p.add_argument("--tail-steps", type=int, default=100, metavar="T",
                   help="steps every job trains after those (default 100)")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help="checkpoint.every_steps of the jobs (default: steps // 3)")
    p.add_argument("--beyond-share", type=float, default=0.25, metavar="P",
                   help="share of the faulted jobs (with more than f + 1 nodes) that get more "
                        "than f faults: they may fall back and be requeued in the fleet "
                        "(default 0.25)")
    p.add_argument("--manager-kill-s", type=float, default=30.0, metavar="S",
                   help="the manager is killed at a random time in the first S seconds "
                        "(default 30)")
    p.add_argument("--trial-timeout", type=float, default=600.0, metavar="S",
                   help="wall bound of one trial; past it the trial is 'hung' (default 600)")
    p.add_argument("--tol", type=float, default=1e-9,
                   help="max relative difference to the fp64 references (default 1e-9)")
    p.add_argument("--out", default=None, help="campaign directory (default runs/fleet-chaos-"
                   "<name>-seed<S>)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)
