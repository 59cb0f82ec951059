"""The batch script's watch over a Slurm job's agents (`Supervisor`): it gives back nodes the
agents agreed away that the job still holds, and with `fault_tolerance.replace` asks for
replacement jobs (launch/slurm.py's `submit_replacement`, through `oobleck-hpc grow`). The
submitit driver (slurm_driver.py) runs one beside its agents step; slurm/train.sbatch runs
`python -m oobleck_hpc.launch.supervise` (below)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

from oobleck_hpc.bootstrap.environment import detect, expand_hostlist
from oobleck_hpc.launch.slurm_task import end_replacements, job_fields, roster_names, slurmd_alive

logger = logging.getLogger(__name__)


class Supervisor(threading.Thread):
    """The batch script's watch over the agents' agreements (their `agreement_reached` events),
    while the agents run. Lives in the batch script: a job that lost its batch host does
    neither of these any more.

    - Gives back the nodes the agents agreed away that Slurm still counts as the job's (its
      processes froze while its slurmd lives: Slurm never marks such a node, the job would hold
      it for the rest of the run, and the agents step would wait for its stopped task forever):
      kills what the job still runs there (the agent and worker pids of its `agent_started`
      event and their task's process group, through `srun --overlap` on that node) and
      shrinks the allocation without it (`scontrol update JobId=J NodeList=...`); a
      `nodes_released` event says so. A node whose slurmd is gone is left to Slurm, which
      drops it; the batch host is never released.
    - `fault_tolerance.replace`: a generation with fewer members than cluster.nodes, counting
      replacements asked for and not yet arrived, gets replacement nodes (`oobleck-hpc grow
      RUN_DIR --nodes K`, in a subprocess with this job's SLURM_* variables but SLURM_CONF
      removed: a job submitted from inside a job must not inherit them)."""

    def __init__(self, job_file: Path, run_dir: Path, job_id: str, roster: list[str],
                 since: float, python: str):
        super().__init__(name="supervisor", daemon=True)
        from oobleck_hpc.config import load_job

        job = load_job(job_file)
        self.replace, self.size = job.fault_tolerance.replace, job.cluster.nodes
        self.job_file, self.run_dir, self.job_id = job_file, run_dir, job_id
        self.roster, self.since, self.python = set(roster), since, python
        self.stop = threading.Event()

    def run(self) -> None:
        from oobleck_hpc.records.story import Tail

        events, seen, pids = Tail(self.run_dir / "events.jsonl"), set(), {}
        asked = arrived = 0
        while not self.stop.wait(0.5):
            for e in events.read():
                if e["t"] < self.since:
                    continue
                if e.get("kind") == "agent_started":
                    pids[e["source"]] = [e["pid"], *e.get("worker_pids", [])]
                if e.get("kind") != "agreement_reached" or e["gen"] in seen:
                    continue
                seen.add(e["gen"])
                arrived += sum(n not in self.roster for n in e["joined"])
                want = self.size - len(e["nodes"]) - (asked - arrived)
                try:  # a Slurm command that fails or hangs must not end the watch
                    if e["lost"]:
                        self._give_back([n for n in e["lost"] if n in self.roster], pids)
                    if self.replace and e["lost"] and want > 0 and self._replacement(e, want):
                        asked += want
                except (OSError, subprocess.SubprocessError) as err:
                    logger.warning("oobleck: generation %s: %s", e["gen"], err)

    def _give_back(self, lost: list[str], pids: dict[str, list[int]]) -> None:
        from oobleck_hpc.records.events import EventLog

        fields = job_fields(self.job_id)
        current = expand_hostlist(fields.get("NodeList", ""))
        held = [n for n in lost if n in current and n != fields.get("BatchHost")
                and slurmd_alive(n)]
        if not held:
            return
        for node in held:
            mine = " ".join(str(p) for p in pids.get(node, []))
            # Our own processes only (a pid reused meanwhile is left alone), with their task's
            # process group (slurm_task's wrapper leads it: a hang stops it too, and the step
            # waits for it). A node whose slurmd is frozen takes the connection and never
            # answers: bounded.
            kill = (f'for p in {mine}; do grep -qs oobleck_hpc /proc/$p/cmdline || continue; '
                    'g=$(cut -d" " -f5 /proc/$p/stat); if grep -qs oobleck_hpc /proc/$g/cmdline; '
                    'then kill -9 -- -$g; else kill -9 $p; fi; done; true')
            try:
                subprocess.run(["srun", f"--jobid={self.job_id}", "--overlap", "--nodes=1",
                                "--ntasks=1", f"--nodelist={node}", "sh", "-c", kill],
                               capture_output=True, timeout=20)
            except subprocess.TimeoutExpired:
                pass
        keep = [n for n in current if n not in held]
        # (in RUN_DIR: scontrol writes slurm_job_<id>_resize.{sh,csh} into its cwd)
        out = subprocess.run(["scontrol", "update", f"JobId={self.job_id}",
                              f"NodeList={','.join(keep)}"], capture_output=True, text=True,
                             timeout=60, cwd=self.run_dir)
        EventLog(self.run_dir / "events.jsonl", source="driver").emit(
            "nodes_released", nodes=held, ok=out.returncode == 0,
            detail=(out.stdout + out.stderr).strip()[:300])
        logger.log(logging.INFO if out.returncode == 0 else logging.WARNING,
                   "oobleck: gave back %s (agreed away, still allocated): %s", held,
                   "done" if out.returncode == 0 else (out.stdout + out.stderr).strip())

    def _replacement(self, e: dict, want: int) -> bool:
        env = {k: v for k, v in os.environ.items() if k == "SLURM_CONF"
               or not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        out = subprocess.run(
            [self.python, "-m", "oobleck_hpc", "grow", str(self.run_dir), "--nodes", str(want),
             "--job", str(self.job_file), "--reason",
             f"generation {e['gen']} lost {', '.join(e['lost'])}"],
            env=env, capture_output=True, text=True, timeout=120)
        logger.log(logging.INFO if out.returncode == 0 else logging.WARNING,
                   "oobleck: replacement for generation %s: %s", e["gen"],
                   (out.stdout + out.stderr).strip())
        return out.returncode == 0


def main(argv: list[str] | None = None) -> int:
    """`python -m oobleck_hpc.launch.supervise --job JOB --run-dir DIR --since T`: the
    Supervisor of slurm/train.sbatch, beside its agents step (the submitit driver runs its own).
    SIGTERM (the batch script, once the agents step ended) ends the run's replacements and this
    process."""
    import argparse
    import signal

    from oobleck_hpc.diagnostics import configure

    p = argparse.ArgumentParser(prog="python -m oobleck_hpc.launch.supervise",
                                description="give back nodes agreed away; submit replacements")
    p.add_argument("--job", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--since", type=float, required=True, help="the agents step's start (Unix time)")
    a = p.parse_args(argv)
    configure("INFO")  # (OOBLECK_LOG_LEVEL, from the CLI, else INFO)
    run_dir = Path(a.run_dir)
    supervisor = Supervisor(Path(a.job), run_dir, detect().job_id, roster_names(run_dir),
                             a.since, sys.executable)
    signal.signal(signal.SIGTERM, lambda *_: supervisor.stop.set())
    supervisor.start()
    while supervisor.is_alive():
        supervisor.join(0.5)
    end_replacements(run_dir, "the job's run ended")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
