"""Launch a job on Slurm with submitit: one driver in the batch script, one agent per node.

The only module that imports submitit: what the login node does (submit a job or a replacement,
ask the controller, wait for the result). What runs inside the job -- `SlurmDriver`,
`JoinDriver`, `LaunchResult` -- is launch/slurm_driver.py. The shape of a submitted job:

    sbatch  --nodes=N --no-kill --requeue --signal=USR2@90 --time=T ...   (submitit SlurmExecutor)
      batch script, first node:  python -m submitit.core._submit FOLDER  ->  SlurmDriver()
        1. srun --mpi=pmix -N N --ntasks-per-node=1 python -m oobleck_hpc.bootstrap discover
              a short MPI step: the nodes agree on RUN_DIR/roster.json, then MPI is finalized
        2. srun --no-kill --kill-on-bad-exit=0 -N N --ntasks-per-node=1 AGENT_COMMAND
              one agent per node, no MPI; per-node logs RUN_DIR/logs/agent-JOB-rR-TASK.out (task t = roster node t)
              (each agent wrapped by oobleck_hpc.launch.slurm_task, which records its exit code)
           meanwhile `Supervisor` (supervise.py) gives back nodes the agents agreed away that
           the job still holds, and with fault_tolerance.replace submits replacement jobs
           (JoinDriver: agents with --join) that end with the run (slurm_task.end_replacements)
        3. verdict (slurm_task.run_verdict, oobleck_hpc/records/runs.py: 0 only if the run finished):
           0 -> done (the submitit result); 75 -> `scontrol
           requeue` (same job id comes back and resumes from its checkpoint); else the batch
           script exits with it (sacct: FAILED with that code; `wait_result` reads the record)

Why these flags (measured on Slurm 22.05, see issue 6 and tests/test_slurm_*.py):
- `--no-kill`: without it Slurm ends the whole job when one node fails; with it the job stays
  RUNNING, the controller drops the dead node and the batch script is not signalled.
- `srun --no-kill --kill-on-bad-exit=0` for the agents: a multi-node step otherwise has its
  surviving tasks killed when a node is declared DOWN or one task exits non-zero.
- MPI only in step 1: Slurm's PMIx plugin kills a step whose MPI task dies without finalizing.
- `--requeue`: lets `scontrol requeue` (the agents' exit 75: checkpoint on disk, guarantee
  exceeded or pre-timeout signal) bring the same job id back; SLURM_RESTART_COUNT tells the runs
  apart. Losing the batch node does NOT end a --no-kill job (measured): the agents elsewhere go on
  and the last one to exit records the verdict and requeues the job; its next run only publishes
  the recorded outcome (slurm_task.finish_without_driver): COMPLETED, with submitit's result.
- `--nodes=N` (cluster.nodes + cluster.spares: the discovery makes the last ones spares), not
  MIN-MAX: with `--nodes=2-4 --ntasks-per-node=1` Slurm 22.05 started every job on 2 nodes of
  an idle 4-node cluster (measured). MIN = `min_nodes`, (f + 1) * n0, bounds the discovery step
  instead: nodes that cannot run a step are left out (spares first) while at least MIN remain. A requeued job would ask for N again and wait for a DOWN node: one
  that resumes after a node loss asks for the nodes left instead, when at least MIN are
  (slurm_task.requeue: `scontrol update JobId=J NumNodes=K NumTasks=K`, taken only once the job
  is PENDING, by a detached helper).
- `--signal=USR2@90` (slurm.signal / slurm.signal_delay_s): sent to every agent before the time
  limit so that they checkpoint and ask to be requeued (exit 75); not to the batch script.
- submitit's SlurmExecutor is chosen explicitly: once slurm-wlm is installed `srun` is on PATH
  and AutoExecutor picks Slurm even when no controller runs; `submit()` asks `scontrol ping`
  first. The callable runs once, in the batch script (`use_srun=False`), and starts the steps
  itself, so `job.result()` is the driver's `LaunchResult`.

After a node loss the current nodes come from the controller (`scontrol show job`), never from the
stale SLURM_JOB_NODELIST (oobleck_hpc.bootstrap.environment.current_job_nodes).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import submitit

from oobleck_hpc.bootstrap.environment import current_job_nodes
from oobleck_hpc.config import JobConfig, SlurmConfig
from oobleck_hpc.errors import OobleckError
from oobleck_hpc.files import write_json
from oobleck_hpc.fleet.config import FleetConfig
from oobleck_hpc.launch.slurm_driver import FleetDriver, JoinDriver, LaunchResult, SlurmDriver
from oobleck_hpc.launch.slurm_task import REPLACEMENTS_DIR, job_fields
from oobleck_hpc.records import runs

DEFAULT_AGENT_COMMAND = "{python} -m oobleck_hpc.control.agent --job {job} --run-dir {run_dir}"
"""The per-node command (the elastic agent). Override per job with `slurm.agent_command`."""


class SlurmUnavailable(OobleckError):
    """No Slurm controller answers (`scontrol ping`)."""


def agent_argv(template: str | None, *, python: str, job_file: str | Path,
               run_dir: str | Path) -> list[str]:
    """The per-node command as an argv list, from a template with {python} {job} {run_dir}
    {roster} (the discovery's RUN_DIR/roster.json)."""
    template = template or DEFAULT_AGENT_COMMAND
    text = template.format(python=shlex.quote(python), job=shlex.quote(str(job_file)),
                           run_dir=shlex.quote(str(run_dir)),
                           roster=shlex.quote(str(Path(run_dir) / "roster.json")))
    return shlex.split(text)


def run_dir_of_job(job_id: str) -> Path:
    """The run directory of a job submitted by `submit` or slurm/train.sbatch: they name it in
    the job's comment (`oobleck:RUN_DIR`)."""
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                         timeout=60)
    match = re.search(r"(?:^|\s)Comment=oobleck:(\S+)", out.stdout)
    if out.returncode != 0 or match is None:
        raise OobleckError(f"job {job_id} is not a running oobleck_hpc job "
                           f"({(out.stdout + out.stderr).strip()[:200] or 'no such job'}). Fix: "
                           "give its run directory instead, or the id of a job started by "
                           "`oobleck-hpc submit` or slurm/train.sbatch")
    return Path(match.group(1))


def time_left_min(job_id: str) -> int | None:
    """Minutes job `job_id` has left (squeue %L: [D-]HH:MM:SS, MM:SS), None if unknown."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%L"], capture_output=True,
                         text=True, timeout=60).stdout.strip()
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", out)
    if match is None:
        return None  # UNLIMITED, NOT_SET, INVALID or no such job
    days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
    return days * 1440 + hours * 60 + minutes + (seconds > 0)


def submit_replacement(job: JobConfig, run_dir: Path, count: int, reason: str,
                       python: str | None = None) -> str:
    """Submit a replacement job of `count` nodes for the job running in `run_dir` (its job id
    from the run's discovery): the same sbatch parameters as `submit` (partition, account,
    QOS, constraints and other extra flags), not requeued, for the time the job has left, on
    none of the nodes the job and its earlier replacements hold. Its agents join the running
    job (`JoinDriver`); it ends with the job (`end_replacements`).
    Records RUN_DIR/replacements/ID.json and a `replacement_submitted` event; returns its id."""
    from oobleck_hpc.bootstrap.discovery import Discovery
    from oobleck_hpc.records.events import EventLog

    require_controller()
    python, run_dir = python or sys.executable, run_dir.absolute()
    main = Discovery.load(run_dir).job_id
    state = job_fields(main).get("JobState", "")
    if state != "RUNNING":
        raise OobleckError(f"job {main} of {run_dir} is {state or 'not known to Slurm'}: only "
                           "a running job grows")
    params = sbatch_parameters(job)
    params.update(job_name=f"{job.name}-replacement", nodes=count,
                  time=time_left_min(main) or job.slurm.time_min)
    extra = params["additional_parameters"]
    extra.pop("requeue")
    # Not on a node the job (or an earlier replacement) already runs on: where nodes are shared
    # (seen on the local cluster) Slurm would place it there, a second agent on the same node.
    taken = set(current_job_nodes(main))
    for record in (run_dir / REPLACEMENTS_DIR).glob("*.json"):
        try:
            taken.update(current_job_nodes(record.stem))
        except subprocess.CalledProcessError:
            pass  # ended and forgotten by the controller
    if extra.get("exclude"):
        taken.update(str(extra["exclude"]).split(","))
    extra.update({"no-requeue": True, "comment": f"oobleck-replacement:{run_dir}"},
                 **({"exclude": ",".join(sorted(taken))} if taken else {}))
    (run_dir / REPLACEMENTS_DIR).mkdir(exist_ok=True)  # before: nothing may fail after sbatch
    executor = _DriverExecutor(folder=run_dir / "submitit", python=shlex.quote(python))
    executor.update_parameters(**params)
    agent = agent_argv(job.slurm.agent_command, python=python,
                       job_file=Path(job.source).absolute(), run_dir=run_dir)
    submitted = executor.submit(JoinDriver(run_dir=str(run_dir), agent=agent,
                                           group_access=job.group_access))
    write_json(run_dir / REPLACEMENTS_DIR / f"{submitted.job_id}.json",
               {"job_id": submitted.job_id, "nodes": count, "for_job": main, "reason": reason,
                "time": time.time()})
    EventLog(run_dir / "events.jsonl", source="grow").emit(
        "replacement_submitted", job_id=submitted.job_id, nodes=count, for_job=main,
        reason=reason)
    return submitted.job_id


def require_controller() -> None:
    """Raise SlurmUnavailable unless a Slurm controller answers."""
    try:
        out = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise SlurmUnavailable(f"cannot run 'scontrol ping' ({e}); Slurm client tools are "
                               "missing. Fix: run on a Slurm login node, or start the local "
                               "cluster: slurm/dev-cluster.sh up && eval \"$(slurm/dev-cluster.sh env)\"") from e
    if out.returncode != 0 or "UP" not in out.stdout:
        raise SlurmUnavailable(f"no Slurm controller answers 'scontrol ping' "
                               f"({(out.stdout + out.stderr).strip() or 'no output'}; SLURM_CONF="
                               f"{os.environ.get('SLURM_CONF', '<unset>')}). Fix: run on a Slurm "
                               "login node, or start the local cluster: slurm/dev-cluster.sh up "
                               "&& eval \"$(slurm/dev-cluster.sh env)\"")


class _DriverExecutor(submitit.SlurmExecutor):
    """SlurmExecutor whose callable runs once, in the batch script (use_srun=False), whatever the
    node count: the driver starts the per-node steps itself, so the job has one task, one result."""

    def _num_tasks(self) -> int:
        return 1


def min_nodes(job: JobConfig) -> int:
    """The fewest nodes the job's plan accepts: (f + 1) * n0 (n0 from the planner's node
    specification of the job's profile). The discovery step leaves out nodes that cannot run
    a step as long as this many remain; below it the job is requeued. Raises the planner's
    or the profile's error (exit 2) when the job has no plan at all."""
    from oobleck_hpc.planning import cost
    from oobleck_hpc.planning.spec import node_specification
    from oobleck_hpc.profiling import resolve_profile

    profile = cost.job_profile(job, resolve_profile(job))
    spec = node_specification(profile, job.cluster.nodes, job.fault_tolerance.f)
    return (job.fault_tolerance.f + 1) * spec.n0


def members(job: JobConfig) -> int:
    """Generation 0's node count for the discovery step: `cluster.nodes` when the job has
    spares (the allocation is nodes + spares, the last ones wait), else 0 (every node of the
    allocation is a member, as many as the batch script asked for)."""
    return job.cluster.nodes if job.cluster.spares else 0


def sbatch_parameters(job: JobConfig) -> dict:
    """The submitit parameters of a job (also what `oobleck-hpc submit --dry-run` prints)."""
    s = job.slurm
    return _parameters(s, job.name, job.cluster.nodes + job.cluster.spares, {
        "requeue": True,
        "signal": f"{s.signal.upper().removeprefix('SIG')}@{s.signal_delay_s}",
        "comment": f"oobleck:{job.resolved_run_dir.absolute()}",  # `grow JOB_ID` finds it
    }) | {"signal_delay_s": s.signal_delay_s}


def fleet_sbatch_parameters(fleet: FleetConfig, run_dir: Path) -> dict:
    """The submitit parameters of a fleet's allocation (`fleet submit`): pool.nodes nodes,
    --no-kill (a dead node leaves the allocation, the jobs on the others train on), not
    requeued, the pre-timeout signal to the batch script only (submitit's; the jobs are not
    stopped early: each checkpoints as its own checkpoint section says)."""
    s = fleet.slurm
    return _parameters(s, fleet.name, fleet.pool.nodes, {
        "signal": f"B:{s.signal.upper().removeprefix('SIG')}@{s.signal_delay_s}",
        "comment": f"oobleck-fleet:{run_dir}"})


def _parameters(s: SlurmConfig, name: str, nodes: int, own: dict) -> dict:
    params: dict = {
        "job_name": name,
        "nodes": nodes,
        "time": s.time_min,
        "use_srun": False,
        "stderr_to_stdout": True,
        "additional_parameters": {
            "no-kill": True,
            "ntasks-per-node": 1,
            **own,
            **{k.replace("_", "-"): v for k, v in s.extra.items()},
        },
    }
    if s.partition:
        params["partition"] = s.partition
    if s.account:
        params["account"] = s.account
    if s.gpus_per_node:
        params["gpus_per_node"] = s.gpus_per_node
    if s.setup:
        params["setup"] = list(s.setup)
    return params


def submit(job: JobConfig, *, python: str | None = None) -> submitit.Job:
    """Submit `job` to Slurm; returns the submitit Job (`.job_id`, `.result()` -> LaunchResult).

    The job file the agents read is written to RUN_DIR/job.yaml (run_dir made absolute, so the
    agents find it from any working directory); submitit's files go to RUN_DIR/submitit.
    """
    require_controller()
    python = python or sys.executable
    run_dir = runs.make_run_dir(job.resolved_run_dir.absolute(), job.group_access)
    job_file = runs.write_job(run_dir, job, "submit")
    fewest = job_min_nodes(job)
    executor = _DriverExecutor(folder=run_dir / "submitit", python=shlex.quote(python))
    executor.update_parameters(**sbatch_parameters(job))
    driver = SlurmDriver(job_file=str(job_file), run_dir=str(run_dir),
                         agent=agent_argv(job.slurm.agent_command, python=python,
                                          job_file=job_file, run_dir=run_dir),
                         mpi=job.slurm.mpi, python=python, min_nodes=fewest,
                         members=members(job), group_access=job.group_access)
    return executor.submit(driver)


def submit_fleet(fleet: FleetConfig, run_dir: Path, *, python: str | None = None) -> submitit.Job:
    """Submit a fleet as one allocation (`fleet submit`): its batch script runs the fleet's
    manager, `fleet run FLEET --slurm` (`FleetDriver`); its files go to RUN_DIR/submitit."""
    require_controller()
    python = python or sys.executable
    executor = _DriverExecutor(folder=run_dir / "submitit", python=shlex.quote(python))
    executor.update_parameters(**fleet_sbatch_parameters(fleet, run_dir))
    return executor.submit(FleetDriver(str(Path(fleet.source).absolute()), str(run_dir), python))


def job_min_nodes(job: JobConfig) -> int:
    """`min_nodes` for the training agent; a job with its own `slurm.agent_command` (and maybe
    no model or profile) asks for all cluster.nodes."""
    return job.cluster.nodes if job.slurm.agent_command else min_nodes(job)


def wait_result(submitted: submitit.Job, run_dir: str | Path) -> LaunchResult:
    """The run's result once the job ended: submitit's, or, when the job ended without one (a
    non-zero verdict, or a job ended by hand), the latest RUN_DIR/launch-JOB-rK.json. Raises
    OobleckError (no traceback of submitit's) when neither exists."""
    try:
        return submitted.result()
    except (submitit.core.utils.UncompletedJobError, submitit.core.utils.FailedJobError) as e:
        records = sorted(Path(run_dir).glob(f"launch-{submitted.job_id}-r*.json"),
                         key=lambda p: int(p.stem.rpartition("-r")[2]))
        if not records:
            raise OobleckError(f"job {submitted.job_id} ended ({submitted.state}) without a "
                               f"result and without {run_dir}/launch-{submitted.job_id}-r*.json; "
                               f"see {run_dir}/submitit and {run_dir}/logs "
                               f"({str(e).splitlines()[0]})") from None
        return LaunchResult.from_record(json.loads(records[-1].read_text()),
                                        str(Path(run_dir) / "logs"))
