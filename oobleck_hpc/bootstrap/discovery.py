"""Rank discovery with mpi4py, in a short job step of its own.

Every node's task publishes (node name, address, free port, device count); an MPI allgather gives
every task the same list in the same order (MPI rank order = Slurm's node order of the step), rank
0 picks the port of the first rendezvous point (the generation-0 store, hosted by the first node)
and broadcasts it, and every task checks that all computed the same roster digest. Rank 0 writes

    RUN_DIR/roster.json      the elastic agents' input (oobleck_hpc.control.wire.Roster format)
    RUN_DIR/discovery.json   the full record: job id, restart count, device counts, digest

atomically (temporary file + rename), then every task calls MPI_Finalize and exits.

Why a separate step: the long-running agents must survive node deaths, and MPI gives no such
promise (Open MPI without ULFM aborts on a dead peer; ULFM survives process deaths, not node
deaths; Slurm's PMIx plugin has been seen ending a step whose MPI task died unfinalized). The
discovery step is over in ~2 s, before any agent starts; the agents are a second step that never
touches MPI (independent processes under `srun --no-kill --kill-on-bad-exit=0`), and agreement on
failures after that runs on the elastic control plane (plain TCP). See the package docstring for
what was measured.

The free ports are picked in the discovery step and bound by the agents a moment later. They lie
outside the kernel's ephemeral range (`wire.reserve_port`), so no bind-to-0 or outgoing connection
on the host, srun's own included, can take one in between; if another process picks the same port
by chance, that agent fails to bind and reports it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from oobleck_hpc.bootstrap.environment import NodeEnvironment, current_job_nodes, detect
from oobleck_hpc.control.wire import NodeAddress, Roster, reserve_port
from oobleck_hpc.files import write_json
from oobleck_hpc.polling import wait_until

ROSTER_FILE = "roster.json"
DISCOVERY_FILE = "discovery.json"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeRecord:
    """What one node publishes in discovery."""

    node: str
    address: str
    port: int
    device_count: int


@dataclass(frozen=True)
class Discovery:
    """The agreed result of discovery (the same object on every task)."""

    job_id: str
    restart_count: int
    records: tuple[NodeRecord, ...]
    store_port: int
    """Port of the first rendezvous point, on the first node's address."""
    controller_nodes: tuple[str, ...] = ()
    """The job's nodes as the controller saw them at discovery (empty outside Slurm)."""
    spares: int = 0
    """How many of the last records are spares (`cluster.spares`: outside generation 0)."""

    @property
    def roster(self) -> Roster:
        return Roster(tuple(NodeAddress(r.node, r.address, r.port) for r in self.records),
                      self.store_port, self.spares)

    @property
    def store(self) -> tuple[str, int]:
        return self.records[0].address, self.store_port

    @property
    def digest(self) -> str:
        """A checksum of what must be identical everywhere (records and rendezvous point)."""
        body = json.dumps([[asdict(r) for r in self.records], self.store_port, self.spares],
                          sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return {"job_id": self.job_id, "restart_count": self.restart_count,
                "records": [asdict(r) for r in self.records], "store_port": self.store_port,
                "controller_nodes": list(self.controller_nodes), "spares": self.spares,
                "digest": self.digest}

    @classmethod
    def load(cls, run_dir: str | Path) -> Discovery:
        data = json.loads((Path(run_dir) / DISCOVERY_FILE).read_text())
        return cls(job_id=data["job_id"], restart_count=data["restart_count"],
                   records=tuple(NodeRecord(**r) for r in data["records"]),
                   store_port=data["store_port"],
                   controller_nodes=tuple(data.get("controller_nodes", ())),
                   spares=data.get("spares", 0))

    def write(self, run_dir: str | Path) -> None:
        """Atomically write roster.json and discovery.json (a reader never sees half a file)."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.roster.write(run_dir / ROSTER_FILE)
        write_json(run_dir / DISCOVERY_FILE, self.to_dict())


def discover(run_dir: str | Path, env: NodeEnvironment | None = None,
             members: int = 0) -> Discovery:
    """Run in every task of an MPI launch with one task per node (`srun --mpi=pmix
    --ntasks-per-node=1 python -m oobleck_hpc.bootstrap discover`). Returns the agreed
    `Discovery` on every task; rank 0 has written it to `run_dir`. Finalizes MPI.
    `members` > 0 (a job with `cluster.spares`): generation 0 is the first `members` nodes and
    the others wait as spares; when the step runs on fewer nodes (some left out), the spares
    are the ones that go. 0: every node is a member."""
    from mpi4py import MPI  # only here: the agents never initialise MPI (module docstring)

    env = env or detect()
    comm = MPI.COMM_WORLD
    # Hold the picked ports bound until everyone has agreed: otherwise two tasks on one host (the
    # local cluster's fake nodes) could pick the same port.
    held = [reserve_port(env.address)]
    try:
        mine = NodeRecord(env.node, env.address, held[0].getsockname()[1], env.device_count)
        records = tuple(NodeRecord(**r) for r in comm.allgather(asdict(mine)))
        names = [r.node for r in records]
        if len(set(names)) != len(names):
            raise RuntimeError(f"discovery needs exactly one task per node, got nodes {names}; "
                               "launch it with --ntasks-per-node=1")
        endpoints = [(r.address, r.port) for r in records]
        if len(set(endpoints)) != len(endpoints):
            raise RuntimeError(f"two nodes published the same address and port: {endpoints}; "
                               "set OOBLECK_NODE_ADDR to each node's own address")
        if comm.rank == 0:
            held.append(reserve_port(env.address))
            store_port = held[-1].getsockname()[1]
            controller = tuple(current_job_nodes(env.job_id)) if env.source == "slurm" else ()
            head = (store_port, controller)
        else:
            head = None
        store_port, controller = comm.bcast(head, root=0)
        found = Discovery(env.job_id, env.restart_count, records, store_port, controller,
                          spares=max(0, len(records) - members) if members else 0)
        digests = comm.allgather(found.digest)
        if len(set(digests)) != 1:
            raise RuntimeError(f"discovery tasks disagree on the roster: digests {digests}")
        if comm.rank == 0:
            found.write(run_dir)
        comm.Barrier()  # nobody leaves before the files exist
        return found
    finally:
        for sock in held:
            sock.close()
        MPI.Finalize()


def wait_for_discovery(run_dir: str | Path, job_id: str, restart_count: int,
                       timeout_s: float = 60.0) -> Discovery:
    """Read the discovery of this job run (same job id and restart count), waiting for it."""

    def this_run() -> Discovery | None:
        try:
            found = Discovery.load(run_dir)
        except (OSError, ValueError, KeyError):  # not written yet, or being replaced
            return None
        return found if (found.job_id, found.restart_count) == (job_id, restart_count) else None

    return wait_until(this_run, timeout_s, f"the discovery of job {job_id} restart "
                      f"{restart_count} in {Path(run_dir) / DISCOVERY_FILE} (did the discovery "
                      "step run?)")


DISCOVERY_LOCK = "OOBLECK_DISCOVERY_LOCK"
"""The environment variable naming a file that the jobs of one allocation lock around their
discovery steps (a Slurm fleet sets it, launch/fleet_job.py; launch/slurm_steps.py locks it):
one such step at a time. Measured on the local cluster: of two discovery steps of one
allocation started 0.15 s apart, the second's PMIx plugin took the first's node list for its
own and its fence waited forever."""
ATTEMPT_S = 75.0
"""How long the first attempt of the discovery step may take; each next one twice as long as the
one before (75, 150, 300 s: a launch on many nodes that needs up to the 300 s a single attempt
once had still succeeds). It is over in ~2 s on the local cluster; `run_discovery_step` says
why it can hang."""


class TooFewNodes(RuntimeError):
    """Fewer nodes than the job accepts can run the discovery: requeue (exit 75) and wait for more."""


def run_discovery_step(run_dir: str | Path, nodes: list[str], *, python: str, mpi: str,
                       log: str | Path, min_nodes: int = 1, members: int = 0,
                       attempt_s: float = ATTEMPT_S, attempts: int = 3) -> list[str]:
    """Run the discovery step (`srun --mpi=MPI ... python -m oobleck_hpc.bootstrap discover`) on
    `nodes`; returns the nodes it ran on. When it fails, each node is tried alone with a trivial
    step (`srun -w NODE true`) and the ones that fail are left out of the next attempt: measured
    after a requeue, a node that was frozen and thawed can refuse the job's steps ("Job credential
    revoked") while its slurmd answers the controller. An attempt that runs past its bound
    (`attempt_s`, doubled at each attempt: ATTEMPT_S) is cancelled and tried again on the nodes
    that each run a step alone: measured on the local cluster, a step's PMIx fence can wait
    forever for a contribution that never comes (slurmd: "COLL_FENCE_RING ... wait contrib"),
    where the same step a moment later is over in ~2 s. Raises TooFewNodes when fewer than
    `min_nodes` remain, RuntimeError when the step fails (not by running late) on nodes that each
    run alone, or after `attempts` attempts.
    `members`: see `discover`."""
    nodes = list(nodes)
    for attempt in range(attempts):
        argv = ["srun", f"--mpi={mpi}", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}",
                "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}", "--kill-on-bad-exit=1",
                f"--output={log}", python, "-m", "oobleck_hpc.bootstrap", "discover",
                "--run-dir", str(run_dir), "--members", str(members)]
        bound = attempt_s * 2 ** attempt
        rc = _cancel_late(subprocess.Popen(argv, stdin=subprocess.DEVNULL), bound)
        if rc == 0:
            return nodes
        tries = {n: subprocess.Popen(["srun", "--nodes=1", "--ntasks=1", f"--nodelist={n}",
                                      "true"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL) for n in nodes}
        bad = [n for n, p in tries.items() if _wait(p, 60) != 0]
        late = f"ran past {bound:g} s" if rc is None else f"exited {rc}"
        logger.warning("discovery: attempt %d on %s %s; nodes that cannot run a step: %s",
                       attempt + 1, nodes, late, bad or "none")
        if not bad and rc is not None:
            raise RuntimeError(f"discovery step failed (exit {rc}) on nodes {nodes}, each of "
                               f"which runs a step alone; see {log}")
        nodes = [n for n in nodes if n not in bad]
        if len(nodes) < min_nodes:
            raise TooFewNodes(f"only {len(nodes)} nodes ({nodes}) can run the job's steps; it "
                              f"needs at least {min_nodes}")
    raise RuntimeError(f"discovery step failed {attempts} times; see {log}")


def _cancel_late(srun: subprocess.Popen, timeout_s: float) -> int | None:
    """srun's exit code, or None when it ran past `timeout_s`: then its step is cancelled
    (SIGTERM: srun signals its tasks and ends the step; SIGKILL after 10 s more)."""
    try:
        return srun.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        srun.terminate()
        _wait(srun, 10)
        return None


def _wait(proc: subprocess.Popen, timeout_s: float) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return -1
