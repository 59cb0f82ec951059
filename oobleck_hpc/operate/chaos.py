"""`oobleck-hpc chaos JOB.yaml --trials N --seed S`: qualify a site's recovery before a long run.

A campaign runs the job N times on this machine, each trial with a random set of injected faults
drawn from the seed (same seed, same trials), and checks each trial against arithmetic:

- Reference: the fp64 single-process run of the same job (`engine.reference_run`), once. The
  trials run the job in fp64 too (`model.dtype: float64`), so "equal" means a max relative
  difference <= --tol (default 1e-9) of every final parameter. The single-process reference
  shares no code path with the distributed run (no plan, no pipeline, no reduce, no transfer),
  so a bug there cannot hide itself, and it costs one process for a few seconds instead of a
  full multi-process run.
- Trials: the job with `train.steps = --steps + --tail-steps` (faults are drawn in the first
  --steps; the tail makes every trial train on long enough after its last fault to outlive
  every grace period twice: `longest_grace`, with the launcher's `cluster.kill_grace_s` set to
  KILL_GRACE_S), `train.save_final_params`, a checkpoint every --checkpoint-every steps, and
  its `faults:` replaced by the drawn set, run by `oobleck-hpc run`
  (launch/cli.py: the local launcher and its requeue loop, so a fallback exits 75, is started
  again on the survivors and resumes from the trial's checkpoint) as a subprocess in its own
  session, in CAMPAIGN/trial-<i>/{job.yaml,run,ckpt,out.log}. Its wall time is bounded
  (--trial-timeout): past it, the launcher's session and every process of the agents' process
  groups (RUN_DIR/agents.json) are killed; the trial is "hung".

Fault sets (`draw_trial`): nodes distinct (node0, the first node and generation 0's store host,
included), steps biased to the first and last step, every phase of `FaultConfig.phase`, every
kind of --kinds. A set holds 1..f faults, or (about a quarter of the sets, when the job has
enough nodes) f+1..N-1: beyond the guarantee (one node always survives). After the first fault each further one is
"simultaneous" (same step and phase), "during recovery" (phase reconfiguration or transfer at
the step of an earlier fault) or "later" (a later step, after a first recovery).

Expected outcome (`expected_outcomes`): see oobleck_hpc/operate/chaos_oracle.py.

Observed outcome: in_place (exit 0, no requeue, params equal), fallback (a requeue happened,
exit 0, params equal), wrong_state (exit 0, but params differ or missing, or a step of 1..N
missing from the metrics or twice in one attempt's, or the run's record -- runs.outcome, the
verdict every command uses -- not finished: a silent end), dead_end (exit != 0), hung (past
the wall bound). Each trial also records `tail_s`, how long the run trained on after its last
fault fired (checked against twice the longest grace period: `short_tail`). Exit code: 0 when
every trial ended as expected, else 1.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from oobleck_hpc.operate.chaos_oracle import (AFTER_STEP_PHASES, RECOVERY_PHASES, START_PHASES,
                                      STEP_PHASES, expected_outcomes)
from oobleck_hpc.config import FaultConfig, JobConfig
from oobleck_hpc.files import write_json
from oobleck_hpc.records import events as ev
from oobleck_hpc.operate.cleanup import kill_leftovers

PHASES: tuple[str, ...] = typing.get_args(typing.get_type_hints(FaultConfig)["phase"])
KINDS: tuple[str, ...] = typing.get_args(typing.get_type_hints(FaultConfig)["kind"])
KILL_GRACE_S = 2.0
"""The trials' `cluster.kill_grace_s` (the launcher's wait for the last nodes once the run
finished): short, so that a tail of a few seconds outlives it twice."""
AGENT_KILL_GRACE_S = 2.0
"""What an agent gives its fenced or stopped workers (control/agent.py's --kill-grace-s default)."""


def longest_grace(job: JobConfig) -> float:
    """The longest grace period a trial of `job` could end a node or the run after: the
    launcher's (KILL_GRACE_S in a trial), an agent's, and the lease of a silent node."""
    return max(KILL_GRACE_S, AGENT_KILL_GRACE_S, job.fault_tolerance.lease_s)


# ----------------------------------------------------------------------------- fault sets


def draw_trial(rng: random.Random, nodes: int, steps: int, f: int, kinds: Sequence[str],
               beyond_share: float = 0.25) -> list[FaultConfig]:
    """One random fault set (module docstring): 1..f faults, or f+1..nodes-1 (one node always
    survives) with probability `beyond_share` when the job has more than f+1 nodes (f = 0:
    always beyond)."""
    can_exceed = f + 1 <= nodes - 1
    beyond = can_exceed and (f == 0 or rng.random() < beyond_share)
    count = rng.randint(f + 1, nodes - 1) if beyond else rng.randint(1, max(1, f))
    victims = rng.sample(range(nodes), min(count, nodes))

    def a_step() -> int:  # steps are numbered from 1 (config.FaultConfig.step)
        return rng.choice([1, steps, rng.randint(1, steps)])

    phase = rng.choice([p for p in PHASES if p not in RECOVERY_PHASES])
    first = FaultConfig(victims[0], 1 if phase in START_PHASES else a_step(), phase,
                        rng.choice(kinds))
    out = [first]
    for node in victims[1:]:
        anchors = [x for x in out if x.phase in STEP_PHASES]
        last = max(x.step for x in out)
        modes = ["simultaneous"] + (["during_recovery"] if anchors else []) + (
            ["later"] if last < steps else [])
        mode = rng.choice(modes)
        if mode == "simultaneous":
            step, phase = first.step, first.phase
        elif mode == "during_recovery":
            step, phase = rng.choice(anchors).step, rng.choice(RECOVERY_PHASES)
        else:
            step = rng.randint(last + 1, steps)
            phase = rng.choice(STEP_PHASES + AFTER_STEP_PHASES)
        out.append(FaultConfig(node, step, phase, rng.choice(kinds)))
    return out


def draw_campaign(seed: int, trials: int, nodes: int, steps: int, f: int,
                  kinds: Sequence[str]) -> list[list[FaultConfig]]:
    """The campaign's fault sets: trial i is drawn from its own generator seeded by (seed, i),
    so a trial's set does not depend on how many trials run."""
    return [draw_trial(random.Random(f"oobleck-chaos/{seed}/{i}"), nodes, steps, f, kinds)
            for i in range(trials)]


# ----------------------------------------------------------------------------- one trial


@dataclass
class Trial:
    index: int
    faults: list[FaultConfig]
    beyond_f: bool
    exit: int | None = None
    """The `oobleck-hpc run` exit code; None when it was killed at the wall bound."""
    outcome: str = ""
    expected: list[str] = field(default_factory=list)
    """The outcomes the fired faults may have (`expected_outcomes`)."""
    max_rel_diff: float | None = None
    """Largest max|got - ref| / max|ref| over every final parameter; None: nothing to compare."""
    recovery_s: list[float] = field(default_factory=list)
    fired: list[FaultConfig] = field(default_factory=list)
    requeues: int = 0
    wall_s: float = 0.0
    steps_complete: bool = False
    """Every step 1..N in the metrics, none twice within one attempt (`check_steps`)."""
    finished: bool = False
    """The run's record says finished (runs.outcome: the verdict behind exit 0)."""
    tail_s: float | None = None
    """Seconds the run trained on after its last fault fired (None: none fired)."""
    short_tail: bool = False
    """tail_s fell short of twice the longest grace period (`longest_grace`)."""
    dir: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome in self.expected

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["faults"] = [asdict(x) for x in self.faults]
        d["fired"] = [asdict(x) for x in self.fired]
        d["ok"] = self.ok
        return d


def trial_job(base: JobConfig, faults: Sequence[FaultConfig], trial_dir: Path, steps: int,
              checkpoint_every: int) -> dict[str, Any]:
    """The job file of one trial: fp64, `steps` steps (the tail included), final parameters
    saved, its own run and checkpoint directories, the launcher's KILL_GRACE_S, the drawn
    faults."""
    d = base.to_dict()
    d["model"]["dtype"] = "float64"
    d["train"]["steps"] = steps
    d["cluster"]["kill_grace_s"] = KILL_GRACE_S
    d["train"]["save_final_params"] = True
    d["run_dir"] = str(trial_dir / "run")
    d["checkpoint"].update(dir=str(trial_dir / "ckpt"), every_steps=checkpoint_every,
                           every_minutes=0.0)
    # A slow node stays: the straggler policy's choices are timing-dependent by design (and
    # checked by bench/straggler.py and tests/test_recovery.py), so they stay out of the oracle.
    d["fault_tolerance"]["straggler"] = "none"
    d["faults"] = [asdict(x) for x in faults]
    return json.loads(json.dumps(d))  # tuples -> lists, for yaml.safe_dump


def check_steps(rows: Sequence[dict[str, Any]], steps: int) -> bool:
    """The metrics hold every step 1..`steps` and no step twice within one attempt (a step
    replayed after a fallback is there once per attempt that ran it)."""
    seen: dict[Any, list[int]] = {}
    for r in rows:
        seen.setdefault(r.get("attempt", 0), []).append(r.get("step"))
    if any(len(got) != len(set(got)) for got in seen.values()):
        return False
    return {k for got in seen.values() for k in got} == set(range(1, steps + 1))


def max_rel_diff(final_dir: Path, reference: dict[int, dict[str, Any]]) -> float | None:
    """Max relative difference of the run's final parameters to the reference; None when a
    layer file is missing."""
    import torch

    worst = 0.0
    for layer, params in reference.items():
        path = final_dir / f"layer-{layer}.pt"
        if not path.exists():
            return None
        got = torch.load(path)
        for name, ref in params.items():
            if name not in got or got[name].shape != ref.shape:
                return None
            diff = float((got[name].double() - ref.double()).abs().max())
            worst = max(worst, diff / max(float(ref.double().abs().max()), 1e-300))
    return worst


def run_trial(trial: Trial, base: JobConfig, campaign: Path, reference, plan, templates,
              profile, steps: int, checkpoint_every: int, timeout_s: float, tol: float,
              max_requeues: int, grace_s: float = 0.0) -> Trial:
    """Run one trial of `steps` steps (the tail included) and judge it (module docstring);
    `grace_s`: the longest grace period, for `short_tail`."""
    import yaml

    from oobleck_hpc.records import runs
    from oobleck_hpc.records.events import read_events, read_jsonl

    trial_dir = campaign / f"trial-{trial.index:03d}"
    shutil.rmtree(trial_dir, ignore_errors=True)
    trial_dir.mkdir(parents=True)
    trial.dir = str(trial_dir)
    job_path = trial_dir / "job.yaml"
    job_path.write_text(yaml.safe_dump(trial_job(base, trial.faults, trial_dir, steps,
                                                 checkpoint_every), sort_keys=False))
    run_dir = trial_dir / "run"
    cmd = [sys.executable, "-m", "oobleck_hpc", "run", str(job_path),
           "--max-requeues", str(max_requeues)]
    t0 = time.monotonic()
    with open(trial_dir / "out.log", "w") as log:
        launcher = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            trial.exit = launcher.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            trial.exit = None
        finally:
            kill_leftovers(launcher, run_dir)
    trial.wall_s = round(time.monotonic() - t0, 2)

    events = read_events(run_dir / "events.jsonl")
    trial.recovery_s = [round(float(e["seconds"]), 3) for e in events
                        if e.get("kind") == ev.RECOVERED and "seconds" in e]
    fired = {(e.get("node"), e.get("step"), e.get("phase"), e.get("fault"))
             for e in events if e.get("kind") == ev.FAULT_INJECTED}
    trial.fired = [x for x in trial.faults if (f"node{x.node}", x.step, x.phase, x.kind) in fired]
    trial.expected = expected_outcomes(trial.fired, plan, templates, profile,
                                       base.fault_tolerance.f,  # the agents' default quorum
                                       steps=steps)
    trial.requeues = sum(e.get("kind") == ev.REQUEUED for e in events)  # the launcher's record
    rows = read_jsonl(run_dir / "metrics.jsonl")
    trial.steps_complete = check_steps(rows, steps)
    trial.finished = runs.outcome(run_dir).finished
    fired_at: dict[tuple, float] = {}  # each fault's first firing (another local rank of a
    for e in events:                   # hung node may fire it again once it is let go)
        if e.get("kind") == ev.FAULT_INJECTED:
            key = (e.get("node"), e.get("step"), e.get("phase"), e.get("fault"))
            fired_at[key] = min(fired_at.get(key, e["t"]), e["t"])
    if fired_at and rows:
        trial.tail_s = round(max(r["time"] for r in rows) - max(fired_at.values()), 2)
        trial.short_tail = trial.tail_s < 2 * grace_s
    if trial.exit is None:
        trial.outcome = "hung"
    elif trial.exit != 0:
        trial.outcome = "dead_end"
    else:
        trial.max_rel_diff = max_rel_diff(run_dir / "final", reference)
        if (trial.max_rel_diff is None or not trial.max_rel_diff <= tol
                or not trial.steps_complete or not trial.finished):
            trial.outcome = "wrong_state"
        else:
            trial.outcome = "fallback" if trial.requeues else "in_place"
    return trial


# ----------------------------------------------------------------------------- campaign


def summarize(trials: Sequence[Trial]) -> dict[str, int]:
    return {
        "within_f": sum(not t.beyond_f for t in trials),
        "beyond_f": sum(t.beyond_f for t in trials),
        "in_place_exact": sum(t.outcome == "in_place" for t in trials),
        "fallback_exact": sum(t.outcome == "fallback" for t in trials),
        "wrong_state": sum(t.outcome == "wrong_state" for t in trials),
        "dead_end": sum(t.outcome == "dead_end" for t in trials),
        "hung": sum(t.outcome == "hung" for t in trials),
        "unexpected": sum(not t.ok for t in trials),
        "faults_not_fired": sum(len(t.faults) - len(t.fired) for t in trials),
        "steps_incomplete": sum(t.exit is not None and not t.steps_complete for t in trials),
        "short_tail": sum(t.short_tail for t in trials),
    }


def _describe(x: FaultConfig) -> str:
    return f"{x.kind} node{x.node}@{x.step}/{x.phase}"


def table(trials: Sequence[Trial]) -> str:
    lines = [f"{'#':>3}  {'faults (fired marked *)':<58} {'expected':<9} {'outcome':<11} "
             f"{'exit':>4} {'max_rel':>9} {'wall_s':>6}  recovery_s"]
    for t in trials:
        faults = ", ".join(_describe(x) + ("*" if x in t.fired else "") for x in t.faults)
        rel = "-" if t.max_rel_diff is None else f"{t.max_rel_diff:.1e}"
        mark = "" if t.ok else "  <-- unexpected"
        lines.append(f"{t.index:>3}  {faults:<58} {'|'.join(t.expected):<9} {t.outcome:<11} "
                     f"{'-' if t.exit is None else t.exit:>4} {rel:>9} {t.wall_s:>6.1f}  "
                     f"{','.join(f'{s:.2f}' for s in t.recovery_s) or '-'}{mark}")
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chaos", help="random fault campaign against an exact fp64 reference",
                       description=__doc__.splitlines()[0])
    p.add_argument("job", help="YAML job file (cluster.launch: local)")
    p.add_argument("--trials", type=int, default=10, help="number of trials (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault sets (default 0)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"comma-separated fault kinds to draw from (default {','.join(KINDS)})")
    p.add_argument("--steps", type=int, default=12,
                   help="the steps faults are drawn in (default 12)")
    p.add_argument("--tail-steps", type=int, default=200, metavar="T",
                   help="steps every trial trains after those (default 200: 9-20 s on 2 cores, "
                        "longer than twice every grace period even on the fewest nodes; each "
                        "trial checks it, short_tail). A trial takes well under a minute on 2 "
                        "cores")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help="checkpoint.every_steps of the trials (default: steps // 3)")
    p.add_argument("--trial-timeout", type=float, default=300.0, metavar="S",
                   help="wall bound of one trial in seconds; past it the trial is 'hung' and "
                        "all its processes are killed (default 300)")
    p.add_argument("--tol", type=float, default=1e-9,
                   help="max relative difference to the fp64 reference (default 1e-9)")
    p.add_argument("--max-requeues", type=int, default=2,
                   help="requeues of a trial after a fallback (default 2)")
    p.add_argument("--out", default=None, help="campaign directory (default runs/chaos-<name>-"
                   "seed<S>); each trial in trial-<i>/")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def write_result(path: Path, trials: Sequence[Trial], done: bool) -> None:
    """The campaign's result so far (its trials and their summary; `done`: every trial ran),
    replaced whole: a reader never sees half of it."""
    write_json(path, {"trials": [t.to_dict() for t in trials], "summary": summarize(trials),
                      "complete": done})


def run(args: argparse.Namespace) -> int:
    from oobleck_hpc.config import load_job
    from oobleck_hpc.engine import reference_run
    from oobleck_hpc.errors import ConfigError
    from oobleck_hpc.planning import plan_job
    from oobleck_hpc.planning.cost import job_profile
    from oobleck_hpc.profiling import resolve_profile

    total = args.steps + args.tail_steps
    base = load_job(args.job, {"model.dtype": "float64", "train.steps": total, "faults": []})
    if base.cluster.launch != "local":
        raise ConfigError(base.source, "cluster.launch", f"value {base.cluster.launch!r}: chaos "
                          "trials run on this machine", "set cluster.launch: local")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ConfigError("<command line>", "--kinds", f"value {args.kinds!r} names no fault kind "
                          f"or unknown ones {bad}", f"use some of {','.join(KINDS)}")
    for key in ("trials", "steps", "max_requeues", "tail_steps"):
        if getattr(args, key) < (0 if key in ("max_requeues", "tail_steps") else 1):
            raise ConfigError("<command line>", f"--{key.replace('_', '-')}",
                              f"value {getattr(args, key)} is too small", "use a positive number")
    every = args.checkpoint_every or max(1, args.steps // 3)
    campaign = Path(args.out or f"runs/chaos-{base.name}-seed{args.seed}")
    campaign.mkdir(parents=True, exist_ok=True)

    profile = resolve_profile(base)
    nodes = [f"node{i}" for i in range(base.cluster.nodes)]
    _, templates, plan = plan_job(base, profile, nodes)
    profile = job_profile(base, profile)  # what plan_job planned with (reconfigure needs it)
    grace = longest_grace(base)
    _, reference = reference_run(base, total)
    f = base.fault_tolerance.f
    sets = draw_campaign(args.seed, args.trials, base.cluster.nodes, args.steps, f, kinds)
    trials = []
    for i, faults in enumerate(sets):
        t = run_trial(Trial(i, faults, beyond_f=len(faults) > f), base, campaign, reference,
                      plan, templates, profile, total, every, args.trial_timeout, args.tol,
                      args.max_requeues, grace)
        trials.append(t)
        # (after each trial: a long campaign stopped early keeps the verdicts of its trials)
        write_result(campaign / "result.json", trials, done=i + 1 == len(sets))
        if not args.json:
            print(f"trial {i}: {', '.join(map(_describe, faults))} -> {t.outcome} "
                  f"(expected {' or '.join(t.expected)}, {t.wall_s:.1f} s)", flush=True)
    summary = summarize(trials)
    if args.json:
        print((campaign / "result.json").read_text(), end="")
    else:
        print(table(trials))
        print("summary: " + ", ".join(f"{k} {v}" for k, v in summary.items()))
        print(f"campaign: {campaign} (result.json, trial-<i>/out.log, trial-<i>/run/)")
    return 0 if summary["unexpected"] == 0 else 1
