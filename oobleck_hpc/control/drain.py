"""Graceful drain: a node leaves the job at a step boundary, on notice, with nothing replayed.

    oobleck-hpc drain RUN_DIR|JOB_ID NODE... [--force]     # request_drain()
    scontrol update nodename=NODE state=drain reason=...  # under Slurm (slurm_draining())
    kill -USR1 AGENT_PID                                  # a notice to one node: forced

The path of a drain:

1. The request. `oobleck-hpc drain` writes RUN_DIR/drain/NODE.json (atomically: who asked,
   when, `force`); under Slurm the node's agent also asks slurmctld every
   `fault_tolerance.drain_poll_s` whether its node's state reads DRAIN (an administrator's
   `scontrol update ... state=drain`). The `drain` fault kind (control/faults.py) writes the same
   file from inside a worker. SIGUSR1 to a node's agent (a site's signal to one node's step:
   under Slurm `scontrol listpids JOB` on the node lists its processes) is a forced request
   of that node: the notice says it goes away. Requests belong to one run (records/runs.py moves
   RUN_DIR/drain to the run's history with its other records); the job removes a request it
   answered (`consume_request`). A request file counts only when the job's user owns it
   (runs.read_own): another user's (RUN_DIR is 0700, so only where its mode was loosened by
   hand), a link or a FIFO is ignored, with a `request_ignored` event that says why.
2. The notice. The node's agent (`DrainWatch`, a thread of control/agent.py) sees the request once and
   tells its workers (`{"type": "drain", "force": ...}`, control/client.py).
3. The decision, at a step boundary, with no round trip of its own. Each worker of the node
   puts the request on its ballot in the next commit vote (recovery/driver.py), which every rank
   of the job takes part in anyway; once the vote completed, every rank knows the same set of
   leaving nodes and computes the same verdict (`verdict()`, pure): the plan without them if
   the others keep the agents' quorum and still hold a full copy of every layer
   (`reconfigure`, the same call a loss makes), else a refusal that names what it would break.
4. The leave. The leaving nodes' workers say "leave" (drained) and exit 0 right after the
   commit. The survivors' workers tell their agents at once, which open the round that removes
   the leaving nodes with nothing sent before it (control/membership.py, 4e: no exchange, no
   BYE); a leaving node's agent exits 0 once that round decided without it (`NodeDrain`). A
   drain of the view's first node (the agents' coordinator) goes the old way: one exchange,
   so that every member holds the vote's result, then its BYE opens the round. The survivors
   run the usual recovery rounds (agree, replan, regroup, transfer) from the step just
   committed: nothing is prepared, so nothing is replayed.
5. A refused drain (the survivors could not hold every layer) is an event (`drain_refused`,
   with the reason) and the node stays. With `--force` the job instead stops at that step
   boundary with a checkpoint of it (every rank saves, exit 75, as on a stop signal): the
   requeued job starts without the node (Slurm allocates no drained node; the local requeue
   restarts on the nodes that did not ask to drain).
"""

from __future__ import annotations

import getpass
import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from oobleck_hpc.control.workers import set_priority, usual_policy_for_children
from oobleck_hpc.errors import EXIT_OK
from oobleck_hpc.records import runs
from oobleck_hpc.files import write_json

if TYPE_CHECKING:
    from oobleck_hpc.control.plane import ControlPlane
    from oobleck_hpc.control.workers import Worker
    from oobleck_hpc.records.events import EventLog

DRAIN_DIR = "drain"
POLL_S = 0.1
"""How often a local job's agent looks for its request file (one stat of a missing file)."""
SHARED_POLL_S = 1.0
"""The same under Slurm, where RUN_DIR is on a shared file system: a thousand nodes then make
a thousand metadata lookups a second, not ten thousand."""


def request_path(run_dir: str | Path, node: str) -> Path:
    return Path(run_dir) / DRAIN_DIR / f"{node}.json"


def request_drain(run_dir: str | Path, nodes: Sequence[str], force: bool = False,
                  by: str = "", known: Sequence[str] = ()) -> list[Path]:
    """Ask `nodes` of the job in `run_dir` to drain (step 1). `known`: the job's node names
    (the roster); a node outside them is a ValueError that lists them."""
    unknown = [n for n in nodes if known and n not in known]
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not a node of the job in {run_dir} (its nodes: "
                         f"{', '.join(known)})")
    paths = []
    for node in nodes:
        path = request_path(run_dir, node)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"node": node, "force": force, "by": by or getpass.getuser(),
                          "t": time.time()})
        paths.append(path)
    return paths


def consume_request(run_dir: str | Path, node: str) -> None:
    """The job answered `node`'s request (it left, or the drain was refused): remove it, so
    that a requeued job -- whose local nodes reuse the names -- does not take it for a new one;
    asking again means a new request."""
    request_path(run_dir, node).unlink(missing_ok=True)


def slurm_draining(node: str, timeout_s: float = 10.0) -> bool:
    """Whether slurmctld shows `node` as draining or drained (`scontrol show node`; an error
    counts as no)."""
    try:
        with usual_policy_for_children():
            out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True,
                                 text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    for field_ in out.split():
        if field_.startswith("State="):
            return "DRAIN" in field_.split("=", 1)[1].split("+")
    return False


@dataclass
class DrainWatch:
    """An agent's watch for a drain request of its node (step 2): `on_request(force, by)` is
    called once, from this thread, when RUN_DIR/drain/NODE.json appears (or, with `slurm_poll_s`,
    when slurmctld shows the node draining); a later request with --force is passed on too.
    A request file the job's user does not own is not read: `on_ignored(path, reason)` is
    called once for it (step 1)."""

    run_dir: Path
    node: str
    on_request: Callable[[bool, str], None]
    slurm_poll_s: float = 0.0
    """0: do not ask slurmctld (a local job)."""
    file_poll_s: float = POLL_S
    on_ignored: Callable[[Path, str], None] = lambda path, reason: None

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._ignored: set[tuple] = set()
        """The foreign request files reported (runs.ForeignFile.key): each one once."""
        self._told: bool | None = None
        """The `force` of the request file passed on (None: none, or it was consumed since)."""
        self._told_slurm = False

    def start(self) -> DrainWatch:
        threading.Thread(target=self._run, name="agent-drain-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        path = request_path(self.run_dir, self.node)
        next_slurm = time.monotonic() + self.slurm_poll_s
        while not self._stop.wait(self.file_poll_s):
            if path.exists():
                try:
                    req = json.loads(runs.read_own(path))
                except runs.ForeignFile as e:
                    if e.key not in self._ignored:
                        self._ignored.add(e.key)
                        self.on_ignored(path, e.reason)
                    continue
                except (OSError, ValueError):
                    continue  # replaced between the check and the read: read it next time
                force = bool(req.get("force"))
                if self._told is None or (force and not self._told):  # (forced covers plain)
                    self._told = force
                    self.on_request(force, str(req.get("by", "")))
            else:
                self._told = None  # consumed (consume_request): a new one is a new request
            if self.slurm_poll_s and time.monotonic() >= next_slurm:
                next_slurm = time.monotonic() + self.slurm_poll_s
                if not self._told_slurm and slurm_draining(self.node):
                    self._told_slurm = True
                    self.on_request(False, "slurm (scontrol: state DRAIN)")


LEAVING_NICE = 19
"""The CPU priority of a node that leaves on a drain decided by the vote (control/membership.py,
4e) from its first worker's LEAVE on (`NodeDrain.leaving`): on a machine its nodes share (the
local default), its workers' exit and its agent's wait for the decision take no CPU from the
survivors, who reconfigure meanwhile. (Not on the coordinator's drain: its BYE opens the round.)"""


class NodeDrain:
    """A node agent's part in its drain (control/agent.py): it watches for the request (step 1:
    `watch`, whose requests go to `post` as ("drain", force, by)) and lets the node go once all
    its workers left (step 4: `left`) -- with a BYE, or, when the survivors open the round that
    removes it (control/membership.py, 4e), once they decided without it; if they did not
    within `lease_s` ("drain_late" posted: `late`), with a BYE after all."""

    def __init__(self, cp: ControlPlane, events: EventLog, post: Callable[[tuple], None],
                 lease_s: float):
        self.cp, self.events, self.post, self.lease_s = cp, events, post, lease_s
        self.deadline: threading.Timer | None = None
        """Set once the node waits for the survivors' decision (4e)."""
        self.yielded = False
        """Whether its priority went down to LEAVING_NICE."""

    def watch(self, run_dir: Path, node: str, slurm_poll_s: float) -> DrainWatch:
        return DrainWatch(run_dir, node, lambda force, by: self.post(("drain", force, by)),
                          slurm_poll_s=slurm_poll_s,
                          file_poll_s=SHARED_POLL_S if os.environ.get("SLURM_JOB_ID") else POLL_S,
                          on_ignored=lambda path, why: self.events.emit(
                              "request_ignored", request="drain", path=str(path),
                              reason=why)).start()

    def out_of_vote(self, nodes: object) -> None:
        """A worker says its commit vote drained `nodes` (4e): the survivors suspect them."""
        if isinstance(nodes, list) and all(isinstance(n, str) for n in nodes):
            self.cp.drain_out(nodes)

    def leaving(self, workers: list[Worker], bye: bool) -> bool:
        """A worker left on its node's drain; True once all did: the node goes (`left`). One
        that the survivors' round removes (4e) yields the CPU from its first worker on."""
        if not bye and not self.yielded:
            self.yielded = True
            set_priority(LEAVING_NICE, workers)
        if not all(w.drained for w in workers):
            return False
        self.left(bye)
        return True

    def left(self, bye: bool) -> None:
        """Every worker of the node left on its drain (step 4)."""
        if bye:  # BYE now: the peers reconfigure at once
            self.cp.leave("early", EXIT_OK, "drained")
            return
        self.cp.leave("drained", EXIT_OK)  # the survivors' round removes it (4e)
        self.deadline = threading.Timer(self.lease_s, self.post, [("drain_late", None, None)])
        self.deadline.daemon = True
        self.deadline.start()

    def late(self) -> None:
        if not self.cp.fenced:
            self.cp.leave("early", EXIT_OK, "drained (no decision without it within lease_s)")

    def out(self, workers: Sequence[Worker]) -> bool:
        """Whether the drained node may exit 0 now: every worker exited and (4e) its peers
        decided without it, or it said BYE (either way its control plane is done)."""
        if any(w.exit_code is None for w in workers):
            return False
        if self.deadline is not None:
            if not self.cp.fenced:
                return False
            self.deadline.cancel()
        return True


@dataclass(frozen=True)
class Verdict:
    """What every rank concludes from a commit vote that carried drain requests (step 3)."""

    leaving: tuple[str, ...]
    plan: object | None
    """The plan without the leaving nodes (None: refused)."""
    reason: str = ""
    """Why refused: the guarantee the drain would break."""
    force: bool = False

    @property
    def accepted(self) -> bool:
        return self.plan is not None


def verdict(plan, leaving: Sequence[str], force: bool, templates, profile, f: int,
            view: Sequence[str]) -> Verdict:
    """The plan without `leaving` (the same pure reconfiguration a loss of those nodes makes), or
    the refusal when the rest of `view` (the decided membership) would not keep the agents'
    majority quorum (control/decision.py: their round would fence them all), or would not hold
    every layer, or would be too few for a plan."""
    from oobleck_hpc.control.decision import has_quorum
    from oobleck_hpc.errors import GuaranteeExceeded
    from oobleck_hpc.planning.reconfigure import reconfigure

    leaving = tuple(sorted(leaving))
    rest = [n for n in view if n not in leaving]
    if not has_quorum(view, rest, "majority"):
        return Verdict(leaving, None, f"{len(rest)} of the {len(view)} nodes would be left, "
                       f"not the agents' quorum (more than half, or half with {view[0]})", force)
    try:
        new_plan = reconfigure(plan, leaving, templates, profile, f)
    except GuaranteeExceeded as e:
        return Verdict(leaving, None, str(e), force)
    return Verdict(leaving, new_plan, "", force)
