"""The worker's side of the agent <-> worker link: how a training process talks to its node agent.

The agent (`python -m oobleck_hpc.control.agent`) starts one worker process per GPU and hands each an
inherited socket (a socketpair; its fd in OOBLECK_AGENT_FD). Messages use the control plane's
framing (wire.py). Environment of a worker:

    OOBLECK_AGENT_FD      fd of the worker's end of the link
    OOBLECK_NODE          this node's name (roster name)
    OOBLECK_NODE_INDEX    this node's index in the roster (the job's initial node order)
    OOBLECK_LOCAL_RANK    0 .. OOBLECK_LOCAL_WORLD - 1 (the GPU index on the node)
    OOBLECK_LOCAL_WORLD   workers on this node
    OOBLECK_RUN_DIR       the run directory (events.jsonl lives there)

Agent -> worker:
    {"type": "membership", gen, nodes, lost, store_node, store_host, store_port}
        a decided generation. Generation 0 (the roster) is sent at start; later ones after each
        agreement. Every worker of every surviving node receives the same decision.
    {"type": "round", gen, suspects, joins_only}
        a membership round has opened (some node is suspected, or -- `suspects` empty -- a
        retry in place after a failure that lost no node; `joins_only`: a round that only adds
        nodes, opened at a step boundary: recovery/rounds.py, `admit`): abort in-flight communication now
        (NCCL: abort the communicators; gloo: the short collective timeout) and wait for the
        next "membership". A generation with empty `lost` has the same nodes on a fresh store:
        rebuild the groups on it and replay the step.
    {"type": "exchange_done", gen, key, values} / {"type": "exchange_failed", gen, key, reason}
    {"type": "drain", force}
        this node is asked to drain (control/drain.py): leave at a step boundary.
    {"type": "fenced", reason, exit_code}
        stop at once; the agent kills what is left after its grace period. `exit_code` (also
        `Fenced.exit_code`): 3 the peers excluded this node; 75 no quorum or no agreement --
        this node cannot prove it is in the majority: fall back to the last checkpoint and
        exit 75 so that the job is requeued; 2 a peer rejected the job's input.

Worker -> agent:
    {"type": "report", kind, detail, suspects, gen}
        a failure seen in-band, as a value (e.g. a gloo RuntimeError in a collective), in
        generation `gen`. `suspects` names the nodes the worker knows to be at fault (e.g. the
        peer of a failed p2p, mapped rank -> node through the plan); they are suspected at
        once. Without suspects, the agent probes every peer agent and suspects those that do
        not answer within probe_s; if all answer, it opens a retry round (same nodes, fresh
        store). A report of a generation older than the agent's is ignored (already replaced).
        Kind "stall" (recovery/stall.py: a wait inside a step far longer than usual, the wait
        goes on) is only a question: the agent pings `suspects` (every peer when none) and
        suspects those silent after stall_probe_s; if all answer, nothing happens.
    {"type": "exchange", gen, key, value}
        an all-gather among the current generation's nodes over the control plane (e.g. to
        confirm every survivor computed the same plan digest). The agent waits for all its
        local workers' values, then gathers one entry per node; the result maps
        node -> [value of local rank 0, 1, ...].
    {"type": "done", code, reason}
        this worker is about to exit on purpose with `code`: 0 it completed the job's last step,
        75 checkpoint fallback / requeue, 2 bad input (`reason`: the error, shown on the
        launcher's console; the agent stops the whole job with 2). An exit WITHOUT a preceding
        "done" or "leave" is a crash -- except exit code 2, which always means bad input.
    {"type": "leave", drained, bye}
        this worker leaves the job early, on purpose, while the others go on (it then exits 0):
        its node leaves and the other nodes recover without it, as from any loss. `drained`:
        its node's drain was accepted (the agent waits for all its workers, then BYE, exit 0;
        without `bye`, it waits instead for the round the survivors open: membership.py, 4e).
    {"type": "drain_out", nodes}
        a commit vote decided that `nodes` leave after its step (recovery/planned.py): the
        agent suspects them at once (membership.py, 4e).

A crashed worker (exit without "done", or killed by a signal) once the job trains makes its node
step out (control/agent.py): the others go on without it, and the node's workers are restarted
with OOBLECK_REJOIN_AFTER_GEN and OOBLECK_FIRST_NODES; they join like a spare when a round adds
the node again and receive their layers from replicas (driver.py, `join`). Before the first
committed step, or at a local rank's third crash, the node fails instead: the agent tells its
peers (FAILED), kills its other workers and exits; the survivors re-plan without it.

A worker's life with this link (the shape train.py / the reconfigure driver follows):

    client = AgentClient.from_env(on_notice=abort_collectives_on_round)
    m = client.wait_membership(timeout=300)                    # generation 0 (the roster)
    store = open_store(m.store_host, m.store_port, client.hosts_store(m), ...,
                       secret=secret, generation=m.gen)      # recovery/rendezvous.py
    plan = plan_job(job, profile, list(m.nodes)); build groups on it
    loop over steps:
        a step returns a failure value -> client.report_failure("comm_error", str(err), suspects)
        m = client.wait_membership(after_gen=m.gen, timeout=...)   # the agreed survivors
        destroy the old groups; new store per `m`; new plan from the planner's reconfiguration
        client.exchange(f"plan-{m.gen}", plan.digest(), timeout)   # all equal, or stop
        Superseded (another failure meanwhile) -> back to wait_membership
        Fenced -> exit with Fenced.exit_code at once (75: after the checkpoint fallback; the
                  agent kills what is left after its grace period)
    client.done(code); exit(code)           # or, leaving early on purpose: client.leave(); exit(0)

If the agent itself vanishes (the link reaches end of file), the worker exits at once with code
3 (an orphaned worker must not keep talking to the survivors' process groups); pass
`exit_on_agent_loss=False` to get a `Fenced` error from the next call instead.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from oobleck_hpc.control.membership import Fenced, Superseded
from oobleck_hpc.control.wire import ConnectionClosed, recv_msg, send_msg
from oobleck_hpc.errors import EXIT_UNRECOVERABLE


@dataclass(frozen=True)
class Membership:
    """A decided generation as a worker sees it."""

    gen: int
    nodes: tuple[str, ...]
    """The generation's nodes in roster order; the same tuple on every survivor."""
    lost: tuple[str, ...]
    """Nodes of the previous generation that are gone."""
    store_node: str
    store_host: str
    store_port: int
    """The rendezvous store of this generation: hosted by a worker of `store_node` (local rank
    0 by convention) on store_host:store_port. Fresh for every generation."""
    joined: tuple[str, ...] = ()
    """Nodes new in this generation (spares swapped in: membership.py, step 7)."""

    @property
    def store_addr(self) -> str:
        """'host:port' (the format of OOBLECK_STORE)."""
        return f"{self.store_host}:{self.store_port}"

    @classmethod
    def from_msg(cls, m: dict[str, Any]) -> Membership:
        return cls(m["gen"], tuple(m["nodes"]), tuple(m["lost"]), m["store_node"],
                   m["store_host"], m["store_port"], tuple(m.get("joined", ())))


class AgentClient:
    """A worker's link to its node agent (see module docstring). Thread-safe.

        client = AgentClient.from_env()
        m = client.wait_membership(timeout=60)          # generation 0
        ... train; on a collective error:
        client.report_failure("comm_error", str(err))
        m = client.wait_membership(after_gen=m.gen, timeout=30)
        digests = client.exchange("plan", plan.digest, timeout=10)
    """

    def __init__(self, sock: socket.socket, node: str, local_rank: int, local_world: int,
                 on_notice: Callable[[str, dict[str, Any]], None] | None = None,
                 exit_on_agent_loss: bool = True):
        self.node, self.local_rank, self.local_world = node, local_rank, local_world
        self._sock = sock
        self._on_notice = on_notice
        self._exit_on_agent_loss = exit_on_agent_loss
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._membership: Membership | None = None
        self._round: dict[str, Any] | None = None
        self._fenced: str | None = None
        self._fenced_code = EXIT_UNRECOVERABLE
        self._working_gen = 0
        """The generation wait_membership last returned: the one this worker works in."""
        self._said_waiting = False
        self._said_training = False
        self._exchanges: dict[tuple[int, str], dict[str, Any]] = {}
        self.drain_request: bool | None = None
        """This node was asked to drain (control/drain.py): None no, else whether forced. The
        driver puts it on its commit-vote ballot."""
        self._reader = threading.Thread(target=self._read_loop, name="agent-link", daemon=True)
        self._reader.start()

    @classmethod
    def from_env(cls, on_notice: Callable[[str, dict[str, Any]], None] | None = None,
                 exit_on_agent_loss: bool = True) -> AgentClient:
        """The link of a worker started by `python -m oobleck_hpc.control.agent`."""
        try:
            fd = int(os.environ["OOBLECK_AGENT_FD"])
            node = os.environ["OOBLECK_NODE"]
            local_rank = int(os.environ["OOBLECK_LOCAL_RANK"])
            local_world = int(os.environ["OOBLECK_LOCAL_WORLD"])
        except (KeyError, ValueError) as e:
            raise RuntimeError("this process was not started by an oobleck_hpc agent "
                               f"(environment variable {e} missing or bad); start it through "
                               "`python -m oobleck_hpc.control.agent`") from e
        return cls(socket.socket(fileno=fd), node, local_rank, local_world, on_notice,
                   exit_on_agent_loss)

    def set_notice_handler(self, on_notice: Callable[[str, dict[str, Any]], None] | None) -> None:
        """Call `on_notice(kind, message)` for every message from the agent from now on, on
        the agent link's thread (a round opening, a decided membership; "agent_lost" when the
        link breaks), in place of the one given at construction: the worker's driver, built
        after the link (train.py), aborts its generation's collectives on a round."""
        self._on_notice = on_notice

    # ------------------------------------------------------------------ worker -> agent

    def report_failure(self, kind: str, detail: str = "", suspects: Sequence[str] = (),
                       gen: int | None = None, threshold_s: float | None = None) -> None:
        """Report an in-band failure (as a value; this call does not raise or wait). `gen`: the
        generation the failed work ran in -- default: the last one `wait_membership` returned
        (not the latest received: a newer one may have arrived because of this very failure,
        and a report under it would ask for a needless retry round). `threshold_s`: a stall's
        threshold (the agent's probe waits at least as long: control/stall_probe.py)."""
        if gen is None:
            with self._cond:
                gen = self._working_gen
        msg = {"type": "report", "kind": kind, "detail": detail, "suspects": list(suspects),
               "gen": gen}
        if threshold_s is not None:
            msg["threshold_s"] = threshold_s
        self._send(msg)

    def done(self, code: int = 0, reason: str = "") -> None:
        """Announce an intended exit with `code` (call right before exiting): 0 only once the
        job's last step is done. `reason`: why, for codes other than 0 (e.g. the bad input)."""
        self._send({"type": "done", "code": code, "reason": reason})

    def started(self) -> None:
        """Say that every rank of this start built its engine (recovery/driver.py,
        `_start_together`): the agents' start lease ends (control/topology.py)."""
        self._send({"type": "started"})

    def training(self) -> None:
        """Say (once) that this worker committed a step: the job trains, and nodes that ask to
        join may be added from now on (a joiner takes the members' committed state)."""
        if not self._said_training:
            self._said_training = True
            self._send({"type": "training"})

    def slow(self, factor: float) -> None:
        """Ask the agent to slow this node's workers `factor` times from now on (the `slow`
        fault, control/faults.py)."""
        self._send({"type": "slow", "factor": factor})

    def leave(self, drained: bool = False, bye: bool = True) -> None:
        """Announce that this worker leaves the job early and on purpose (call right before
        exiting 0): its node is then lost to the others, who recover without it. Not for the
        job's end: that is `done(0)`. `drained`: its node's drain was accepted at a step
        boundary (control/drain.py); the agent lets the node go once all its workers said so,
        with a BYE or (`bye` False) once the survivors decided without it."""
        self._send({"type": "leave", "drained": drained, "bye": bye})

    def drain_out(self, nodes: Sequence[str]) -> None:
        """The commit vote this rank just completed drained `nodes` (membership.py, 4e)."""
        self._send({"type": "drain_out", "nodes": list(nodes)})

    def exchange(self, key: str, value: Any, timeout: float, gen: int | None = None,
                 on_sent: Callable[[], None] | None = None) -> dict[str, list[Any]]:
        """All-gather `value` (JSON-serialisable) among the current generation's nodes.
        Returns node -> [value of each local rank]. Raises Superseded if a membership round
        opened first (redo it after the next membership), Fenced, or TimeoutError. `gen`: the
        generation the value was computed for; Superseded at once if a newer one is known
        (else the exchange would run under the newer generation with a stale value).
        `on_sent`: called once this rank's value is on its way (fault injection)."""
        m = self.membership
        current = m.gen if m is not None else 0
        if gen is not None and gen != current:
            raise Superseded(f"exchange {key!r} for generation {gen}: generation {current} "
                             "was decided meanwhile")
        gen = current
        self._send({"type": "exchange", "gen": gen, "key": key, "value": value})
        if on_sent is not None:
            on_sent()
        deadline = time.monotonic() + timeout
        with self._cond:
            while (gen, key) not in self._exchanges:
                self._raise_if_fenced()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"exchange {key!r} of generation {gen}: no result within "
                                       f"{timeout} s")
                self._cond.wait(left)
            result = self._exchanges.pop((gen, key))
        if result["type"] == "exchange_failed":
            raise Superseded(f"exchange {key!r} of generation {gen}: {result['reason']}")
        return result["values"]

    # ------------------------------------------------------------------ agent -> worker

    @property
    def membership(self) -> Membership | None:
        """The latest decided generation received (None before generation 0 arrives)."""
        with self._cond:
            return self._membership

    @property
    def round_open(self) -> dict[str, Any] | None:
        """The open membership round ({gen, suspects}) if one was announced and not yet decided."""
        with self._cond:
            return self._round

    @property
    def fenced(self) -> str | None:
        with self._cond:
            return self._fenced

    @property
    def fenced_code(self) -> int:
        """How a fenced node ends (see `Fenced`): 3, 75 (requeue) or 2 (bad input)."""
        with self._cond:
            return self._fenced_code

    def wait_membership(self, after_gen: int = -1, timeout: float | None = None) -> Membership:
        """Block until a generation newer than `after_gen` is decided; return it. Raises Fenced
        if this node was excluded, TimeoutError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._said_waiting:  # this worker is ready (a spare's agent then asks to join)
            self._said_waiting = True
            self._send({"type": "waiting"})
        with self._cond:
            while self._membership is None or self._membership.gen <= after_gen:
                self._raise_if_fenced()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"node {self.node}: no membership newer than generation "
                                       f"{after_gen} within {timeout} s")
                self._cond.wait(left)
            self._working_gen = self._membership.gen
            return self._membership

    def hosts_store(self, m: Membership) -> bool:
        """Whether this worker hosts generation `m`'s store (local rank 0 of m.store_node):
        it creates the store on m.store_host:m.store_port (rendezvous.open_store); the others
        connect."""
        return m.store_node == self.node and self.local_rank == 0

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    # ------------------------------------------------------------------ internals

    def _raise_if_fenced(self) -> None:
        if self._fenced is not None:
            raise Fenced(f"node {self.node}: {self._fenced}", self._fenced_code)

    def _send(self, msg: dict[str, Any]) -> None:
        with self._send_lock:
            try:
                send_msg(self._sock, {**msg, "local_rank": self.local_rank})
            except OSError as e:
                raise Fenced(f"node {self.node}: the agent link is gone ({e})") from e

    def _read_loop(self) -> None:
        while True:
            try:
                msg = recv_msg(self._sock)
            except (ConnectionClosed, OSError, ValueError):
                with self._cond:
                    if self._fenced is None:
                        self._fenced = "the node agent exited"
                    self._cond.notify_all()
                if self._on_notice is not None:
                    self._on_notice("agent_lost", {})
                if self._exit_on_agent_loss:
                    os._exit(EXIT_UNRECOVERABLE)
                return
            kind = str(msg.get("type"))
            with self._cond:
                if kind == "membership":
                    m = Membership.from_msg(msg)
                    if self._membership is None or m.gen > self._membership.gen:
                        self._membership = m
                    if self._round is not None and self._round["gen"] <= m.gen:
                        self._round = None
                elif kind == "round":
                    if self._membership is None or msg["gen"] > self._membership.gen:
                        self._round = {"gen": msg["gen"], "suspects": msg["suspects"],
                                       "joins_only": bool(msg.get("joins_only"))}
                elif kind == "fenced":
                    self._fenced = msg["reason"]
                    self._fenced_code = int(msg.get("exit_code", EXIT_UNRECOVERABLE))
                elif kind in ("exchange_done", "exchange_failed"):
                    self._exchanges[(msg["gen"], msg["key"])] = msg
                elif kind == "drain":
                    self.drain_request = bool(msg.get("force"))
                self._cond.notify_all()
            if self._on_notice is not None:
                self._on_notice(kind, msg)
