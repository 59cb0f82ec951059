"""`oobleck-hpc chaos JOB.yaml --trials N --seed S`: qualify a site's recovery before a long run.

A campaign runs the job N times on this machine, each trial with a random set of injected faults
drawn from the seed (same seed, same trials), and checks each trial against arithmetic:

- Reference: the fp64 single-process run of the same job (`engine.reference_run`), once. The
  trials run the job in fp64 too (`model.dtype: float64`), so "equal" means a max relative
  difference <= --tol (default 1e-9) of every final parameter. The single-process reference
  shares no code path with the distributed run (no plan, no pipeline, no reduce, no transfer),
  so a bug there cannot hide itself, and it costs one process for a few seconds instead of a
  full multi-process run.
- Trials: the job with `train.steps = --steps`, `train.save_final_params`, a checkpoint every
  --checkpoint-every steps, and its `faults:` replaced by the drawn set, run by `oobleck-hpc run`
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

Expected outcome (`expected_outcomes`): the faults that fired (the run's `fault_injected`
events; a drawn fault whose phase the code does not fire is reported, not counted), each the loss
of its node (a `crash` only before a step committed: later its worker is restarted in place,
`restarted`; a `drain` only where the job accepts it, `judge`; a `slow` node never: the trials
run with `straggler: none`), taken in membership rounds in time
order (`round_orders`): a step's own failures, then one round per recovery phase a further node
dies in, then a node lost after the step's commit, noticed while the next step runs (after the
last step: when the survivors agree they reached the end). Each round must keep the quorum of
the view before it (`elastic.membership.has_quorum`, the agents' rule), and the recovery, from
the plan of the last commit, must find every layer on a survivor, at least n0 survivors and a
plan (`planning.reconfigure`):
then in place, else fallback (and the rest of the set never fires: a requeued job runs without
faults). Where timing decides (did a vote complete before its node died; are nodes that fail in
the same window, each when it gets there, agreed away in one round or one by one) every way
counts, and any of their outcomes is expected.

Observed outcome: in_place (exit 0, no requeue, params equal), fallback (a requeue happened,
exit 0, params equal), wrong_state (exit 0, params differ or missing), dead_end (exit != 0),
hung (past the wall bound). Exit code: 0 when every trial ended as expected, else 1.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from oobleck_hpc.config import FaultConfig, JobConfig
from oobleck_hpc.elastic.faults import IN_STEP_PHASES
from oobleck_hpc.elastic.membership import has_quorum

PHASES: tuple[str, ...] = typing.get_args(typing.get_type_hints(FaultConfig)["phase"])
KINDS: tuple[str, ...] = typing.get_args(typing.get_type_hints(FaultConfig)["kind"])
START_PHASES = ("rendezvous", "restore")
"""Fire before the first step of a run (`step` = the first step it trains: 1 for a trial)."""
RECOVERY_PHASES = ("reconfiguration", "transfer")
"""Fire only while the survivors recover from an earlier fault at the same step."""
AFTER_STEP_PHASES = ("checkpoint",)
"""Fire after the step committed (inside the periodic save)."""
AFTER_VOTE_PHASES = ("optimizer", "commit")
"""Fire after the commit vote completed: the step commits on every other node."""
STEP_PHASES = IN_STEP_PHASES
"""Fire inside a training step."""


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


def positions(x: FaultConfig, steps: int = 0) -> tuple[float, ...]:
    """Where the survivors may notice the loss of a fired fault's node, in step units (module
    docstring, "Expected outcome"). Step s (numbered from 1) fails at s; its recovery rounds are
    at s + 0.1 (reconfiguration) and s + 0.2 (transfer); it commits at s + 0.3; a node lost
    after that commit (optimizer, commit, a vote that completed elsewhere, the checkpoint after
    step s) is noticed at s + 0.5, while step s + 1 runs or, after the last step, when the
    survivors agree they reached the end (`ElasticDriver.finish`).

    A drain (`steps`: the run's last step) leaves right after the commit of whichever step's
    vote first carries its request -- step s or any later one, at s + 0.45 -- if the verdict
    then accepts it (`judge`); or never (inf): the run ended first. A crashed worker restarted
    in place (`restarted`) loses no node (inf)."""
    s = x.step
    if x.kind == "slow":  # the node stays (the trials run with `straggler: none`)
        return (math.inf,)
    if x.kind == "drain":
        return tuple(c + 0.45 for c in range(max(1, s), steps + 1)) + (math.inf,)
    if x.kind == "crash" and restarted(x) is not False:
        return (math.inf,) if restarted(x) else _positions(x) + (math.inf,)
    return _positions(x)


def _positions(x: FaultConfig) -> tuple[float, ...]:
    s = x.step
    if x.phase in START_PHASES:
        return (-1.0,)
    if x.phase == "vote":
        return (s, s + 0.5)
    if x.phase in AFTER_VOTE_PHASES or x.phase == "checkpoint":
        return (s + 0.5,)
    if x.phase in RECOVERY_PHASES:
        return (s + 0.1 * (1 + RECOVERY_PHASES.index(x.phase)),)
    return (float(s),)


def restarted(x: FaultConfig) -> bool | None:
    """Whether a `crash` fault's worker is restarted in place (its node stays: no loss), which
    its agent does once a step committed on the node (agent.py): True from step 2 on and after
    step 1's commit (its checkpoint); None (either) in step 1's vote, optimizer and commit
    windows, where a local peer may have committed first; False before."""
    if x.step >= 2 and x.phase not in START_PHASES or (x.step, x.phase) == (1, "checkpoint"):
        return True
    return None if x.step == 1 and x.phase in ("vote", *AFTER_VOTE_PHASES) else False


def round_orders(faults: Sequence[FaultConfig],
                 steps: int = 0) -> list[list[tuple[float, list[FaultConfig]]]]:
    """Every order the fired `faults` can be lost in: [(position, faults)] by position
    (`positions`), one entry per way a vote fault can go (did its vote complete elsewhere?).
    Faults at one position fire on each node when it gets there (the rendezvous seconds apart on
    a loaded machine, a commit tens of ms apart) while a round is decided in milliseconds: they
    may be agreed away in one round or several, in any order (`judge` counts every way). A node
    lost after step s's commit is noticed while step s + 1 runs: it joins step s + 1's losses."""
    orders = []
    for pick in itertools.product(*(positions(x, steps) for x in faults)):
        at: dict[float, list[FaultConfig]] = {}
        for x, p in zip(faults, pick):
            at.setdefault(p, []).append(x)
        for p in [p for p in at if p % 1 == 0.5 and p + 0.5 in at]:
            at[p + 0.5] = at.pop(p) + at[p + 0.5]
        orders.append(sorted(at.items()))
    return orders


def layers_kept(plan, lost: set[str]) -> bool:
    """Every layer of `plan` still has a holder on a node not in `lost`."""
    kept = {layer for r in plan.ranks if r.node not in lost
            for layer in range(r.layer_start, r.layer_end)}
    return len(kept) == plan.num_layers


def quorum_ways(view: Sequence[str], survivors: Sequence[str], quorum: str) -> set[bool]:
    """Whether the `survivors` of `view` keep the quorum, over every way of losing the others:
    in one round or several, in any order. At once is the strictest way (if it keeps the quorum,
    every way does); one by one, the first node of the view last, the most lenient."""
    at_once = has_quorum(view, survivors, quorum)
    if at_once:
        return {True}
    # One by one: a view of 3 or more keeps a majority losing one node; from 2 to 1 only the
    # view's first node may stay, so the last node lost must come after the survivor.
    one_by_one = len(survivors) >= 2 or (
        len(survivors) == 1 and view.index(survivors[0]) < len(view) - 1)
    return {False, True} if one_by_one else {False}


def judge(order: list[tuple[float, list[FaultConfig]]], plan, templates, profile, f: int,
          quorum: str = "majority") -> set[str]:
    """The outcomes ('in_place', 'fallback') of one order of losses on the job's initial `plan`.
    Each round must keep the quorum of the view before it (`quorum_ways`); a recovery starts
    from the plan of the last commit (its base: the driver reconfigures the base without every
    node lost since, and moves layers only from the base's holders): every layer must keep a
    holder on the base's surviving nodes, at least n0 of them, and the planner must have a plan
    for them. A drain (only drains share its positions) happens only where the driver's
    verdict accepts it (elastic/drain.py: the quorum kept at once and a plan without the nodes,
    from the plan just committed); refused, nothing changes."""
    from oobleck_hpc.errors import GuaranteeExceeded
    from oobleck_hpc.planning.reconfigure import reconfigure

    n0 = min(templates)
    out: set[str] = set()
    view, base, current, lost, last = list(plan.nodes), plan, plan, set(), None
    for p, group in order:
        gone = {f"node{x.node}" for x in group} & set(view)
        if not gone or p == math.inf:
            continue
        if group[0].kind == "drain":
            from oobleck_hpc.elastic.drain import verdict

            if not verdict(current, sorted(gone), False, templates, profile, f, view).accepted:
                continue
        if last is not None and math.floor(p - 0.3) > math.floor(last - 0.3):
            base, lost = current, set()  # a step committed on `current` in between
        last = p
        survivors = [n for n in view if n not in gone]
        ways = quorum_ways(view, survivors, quorum)
        if False in ways:
            out.add("fallback")
            if True not in ways:
                return out
        lost |= gone
        if not layers_kept(base, lost) or len(base.nodes) - len(lost) < n0:
            return out | {"fallback"}
        try:
            current = reconfigure(base, lost, templates, profile, f)
        except GuaranteeExceeded:
            return out | {"fallback"}
        view = survivors
    return out | {"in_place"}


def expected_outcomes(faults: Sequence[FaultConfig], plan, templates, profile, f: int,
                      quorum: str = "majority", steps: int = 0) -> list[str]:
    """The outcomes `faults` (those that fired) may have: `judge` over every `round_orders`
    (`steps`: the run's last step, for drains). Crashed workers restarted in place cost a
    retry generation each; more than MAX_RETRIES of them may end in the fallback."""
    from oobleck_hpc.elastic.recovery import MAX_RETRIES

    out = set().union(*(judge(order, plan, templates, profile, f, quorum)
                        for order in round_orders(faults, steps)))
    if sum(x.kind == "crash" and restarted(x) is not False for x in faults) >= MAX_RETRIES:
        out.add("fallback")
    return sorted(out)


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
    """The job file of one trial: fp64, final parameters saved, its own run and checkpoint
    directories, the drawn faults."""
    d = base.to_dict()
    d["model"]["dtype"] = "float64"
    d["train"]["steps"] = steps
    d["train"]["save_final_params"] = True
    d["run_dir"] = str(trial_dir / "run")
    d["checkpoint"].update(dir=str(trial_dir / "ckpt"), every_steps=checkpoint_every,
                           every_minutes=0.0)
    # A slow node stays: the straggler policy's choices are timing-dependent by design (and
    # checked by bench/straggler.py and tests/test_recovery.py), so they stay out of the oracle.
    d["fault_tolerance"]["straggler"] = "none"
    d["faults"] = [asdict(x) for x in faults]
    return json.loads(json.dumps(d))  # tuples -> lists, for yaml.safe_dump


def kill_leftovers(launcher: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL the launcher's session and every oobleck_hpc process in the process groups of
    the agents named in RUN_DIR/agents.json (agents run in their own sessions). Processes are
    matched by process group and command line, so a recycled pid is never hit."""
    if launcher.poll() is None:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.wait()
    try:
        groups = set(json.loads((run_dir / "agents.json").read_text()).values())
    except (FileNotFoundError, ValueError):
        return
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pgid = int(stat.read_text().rsplit(")", 1)[1].split()[2])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # the process ended meanwhile
        if pgid in groups and b"oobleck_hpc" in cmdline:
            try:
                os.kill(int(stat.parent.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


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
              max_requeues: int) -> Trial:
    import yaml

    from oobleck_hpc.elastic.events import read_events

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
                        if e.get("kind") == "recovered" and "seconds" in e]
    fired = {(e.get("node"), e.get("step"), e.get("phase"), e.get("fault"))
             for e in events if e.get("kind") == "fault_injected"}
    trial.fired = [x for x in trial.faults if (f"node{x.node}", x.step, x.phase, x.kind) in fired]
    trial.expected = expected_outcomes(trial.fired, plan, templates, profile,
                                       base.fault_tolerance.f,  # the agents' default quorum
                                       steps=steps)
    trial.requeues = sum(e.get("kind") == "requeued" for e in events)  # the launcher's record
    if trial.exit is None:
        trial.outcome = "hung"
    elif trial.exit != 0:
        trial.outcome = "dead_end"
    else:
        trial.max_rel_diff = max_rel_diff(run_dir / "final", reference)
        if trial.max_rel_diff is None or not trial.max_rel_diff <= tol:
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
                   help="train.steps of every trial (default 12: a trial takes well under a "
                        "minute on 2 cores)")
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


def run(args: argparse.Namespace) -> int:
    from oobleck_hpc.config import load_job
    from oobleck_hpc.engine import reference_run
    from oobleck_hpc.errors import ConfigError
    from oobleck_hpc.planning import plan_job
    from oobleck_hpc.planning.cost import job_profile
    from oobleck_hpc.profiling import resolve_profile

    base = load_job(args.job, {"model.dtype": "float64", "train.steps": args.steps, "faults": []})
    if base.cluster.launch != "local":
        raise ConfigError(base.source, "cluster.launch", f"value {base.cluster.launch!r}: chaos "
                          "trials run on this machine", "set cluster.launch: local")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ConfigError("<command line>", "--kinds", f"value {args.kinds!r} names no fault kind "
                          f"or unknown ones {bad}", f"use some of {','.join(KINDS)}")
    for key in ("trials", "steps", "max_requeues"):
        if getattr(args, key) < (0 if key == "max_requeues" else 1):
            raise ConfigError("<command line>", f"--{key.replace('_', '-')}",
                              f"value {getattr(args, key)} is too small", "use a positive number")
    every = args.checkpoint_every or max(1, args.steps // 3)
    campaign = Path(args.out or f"runs/chaos-{base.name}-seed{args.seed}")
    campaign.mkdir(parents=True, exist_ok=True)

    profile = resolve_profile(base)
    nodes = [f"node{i}" for i in range(base.cluster.nodes)]
    _, templates, plan = plan_job(base, profile, nodes)
    profile = job_profile(base, profile)  # what plan_job planned with (reconfigure needs it)
    _, reference = reference_run(base, args.steps)
    f = base.fault_tolerance.f
    sets = draw_campaign(args.seed, args.trials, base.cluster.nodes, args.steps, f, kinds)
    trials = []
    for i, faults in enumerate(sets):
        t = run_trial(Trial(i, faults, beyond_f=len(faults) > f), base, campaign, reference,
                      plan, templates, profile, args.steps, every, args.trial_timeout, args.tol,
                      args.max_requeues)
        trials.append(t)
        if not args.json:
            print(f"trial {i}: {', '.join(map(_describe, faults))} -> {t.outcome} "
                  f"(expected {' or '.join(t.expected)}, {t.wall_s:.1f} s)", flush=True)
    summary = summarize(trials)
    result = {"trials": [t.to_dict() for t in trials], "summary": summary}
    (campaign / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(table(trials))
        print("summary: " + ", ".join(f"{k} {v}" for k, v in summary.items()))
        print(f"campaign: {campaign} (result.json, trial-<i>/out.log, trial-<i>/run/)")
    return 0 if summary["unexpected"] == 0 else 1
