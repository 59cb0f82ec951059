"""The per-node agent: `python -m oobleck_hpc.control.agent --node NAME --roster FILE -- WORKER COMMAND...`

One agent runs on every node of a job (local launcher: one process per pretend node; Slurm: one
srun step per node). It

1. listens on its roster port and joins the control plane (control/plane.py: heartbeats,
   leases, membership agreement with the other agents -- control/membership.py);
2. starts the node's workers (one per GPU: `--workers K` copies of WORKER COMMAND, each with an
   inherited link to the agent and the environment described in control/client.py);
3. watches them (control/workers.py): a worker's exit is seen at once (one thread blocked in
   wait() per worker);
4. relays what workers report (in-band communication errors; stalls -- a wait inside a step far
   longer than usual, recovery/stall.py: the peers waited on are pinged with a short deadline,
   control/stall_probe.py; "started": every rank of the start is built, so the start's longer
   lease ends; "training": a step committed, so spares and grown nodes
   may join from now on) to the control plane, and what the control plane
   decides (a new generation: survivors, store address; an open round; fencing)
   to the workers;
5. exits when its work is over (exit codes: oobleck_hpc/errors.py):
   - every worker said "done" and exited: tell the peers (BYE "finished" for 0 -- the last step
     is done -- and 75 -- all stop for a requeue; BYE "early" otherwise) and exit with the
     largest code;
   - a worker said "leave" (it leaves the job early, e.g. the `exit` fault): the node leaves
     now -- BYE "early", so that its peers recover without it at once -- the other workers
     are told to stop (`fenced`) and killed after `--kill-grace-s`; exit 3 (this node is lost
     to the job: it did not finish);
   - every worker said "leave" after its node's drain was accepted (control/drain.py: a request
     file in RUN_DIR/drain/, which this agent watches, or under Slurm the node's DRAIN state,
     asked every --drain-poll-s): BYE "early" at once, so the peers reconfigure without waiting
     for the workers' exit; exit 0 once they exited;
   - a worker rejected the job's input ("done" 2, or any exit with code 2): BYE "abort" -- every
     peer stops too, with 2 -- stop the other workers, exit 2;
   - a worker crashed (exit without "done") once the job trains: the node steps out at once
     (`withdraw`, membership.py 4d: the others go on without it, as after a loss, instead of
     waiting seconds for a new process to import torch and join), its workers are killed and
     restarted, and once all of them are ready it asks to join again: a round adds it at the
     next step boundary and its workers receive their layers from replicas (recovery/join.py).
     At most MAX_WORKER_CRASHES - 1 times per local rank; its next crash, or one before the
     first committed step, fails the NODE -- tell the peers (FAILED, so their event logs say
     why), kill the node's other workers, exit 3;
   - this node was fenced: tell the workers (`fenced` with the exit code), give them
     `--kill-grace-s` to exit, kill what is left, exit 3 when the peers excluded it, 75 when it
     cannot prove it is in the majority (no quorum, no agreement: the job must fall back to
     its checkpoint and be requeued), 2 when a peer aborted the job for bad input.
   SIGTERM, SIGINT and SIGUSR2 (Slurm's pre-timeout signal) are forwarded to the workers; what
   they do then decides the exit as above, except that a worker killed by the signal passed on
   (one still starting, before its handler is in place) was stopped, not crashed: it counts as
   a worker done with 75 (the node leaves for a requeue; nothing to save before it trained).
   SIGUSR1 is a notice to this node alone (a site's signal to one node's step before its
   maintenance or preemption): a forced drain of the node (control/drain.py) -- it leaves at
   the next step boundary if the others can absorb it, else the job stops there with a
   checkpoint and is requeued without it.

The workers' processes -- their environment, the threads that watch them, killing them -- are
control/workers.py's; this module decides what their messages and exits mean. The run's secret,
which every control-plane connection proves (control/auth.py), is read from $OOBLECK_SECRET_FILE
(inherited by the workers), else RUN_DIR/secret: an agent without it exits 2.

Under Slurm the launcher runs `python -m oobleck_hpc.control.agent --job JOB --run-dir RUN_DIR`: the node
name then defaults to $SLURMD_NODENAME (else the short host name), the roster to
RUN_DIR/roster.json (written by the discovery step), and the worker command to
`python -m oobleck_hpc.train`. A replacement job's agents (launch/slurm.py) add `--join`: the
node adds itself to the running job's roster file and joins like a spare.

Every transition goes to `<run_dir>/events.jsonl` (events.py) and a short line on stderr.
"""

from __future__ import annotations

import errno
import os
import queue
import signal
import sys
import threading
from typing import Any

from oobleck_hpc.control.agent_options import AgentOptions, parse_args  # (re-exported: its command line)
from oobleck_hpc.diagnostics import configure
from oobleck_hpc.control.auth import run_secret
from oobleck_hpc.control.plane import ControlPlane
from oobleck_hpc.control.drain import NodeDrain
from oobleck_hpc.records.events import EventLog
from oobleck_hpc.control.faults import DutyCycle
from oobleck_hpc.control.membership import Decision
from oobleck_hpc.control.stall_probe import reported_threshold
from oobleck_hpc.control.workers import (START_NICE, Inbox, Worker, describe_exit, kill_stopped,
                                         kill_workers, raise_agent_priority, set_priority,
                                         start_worker, tell, worker_env)
from oobleck_hpc.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_REQUEUE, EXIT_UNRECOVERABLE, OobleckError

RESTART_BOOST_AFTER_S = 1.0
"""How long after a crash the restarted workers get their higher priority (`_restart_node`)."""
MAX_WORKER_CRASHES = 3
"""A local rank's worker that crashes this many times takes its node out of the job (the first
crashes step the node out and restart its workers)."""
EXIT_NODE_LOST = EXIT_UNRECOVERABLE
"""Exit code of an agent whose node failed, left early or was excluded (the job goes on
without it)."""


class Agent:
    """One node's agent (see module docstring). `run()` returns the process exit code."""

    def __init__(self, opts: AgentOptions):
        self.opts = opts
        self.events = EventLog(opts.run_dir / "events.jsonl", source=opts.node)
        self.inbox: Inbox = queue.SimpleQueue()
        self.cp = ControlPlane(opts.node, opts.roster, secret=run_secret(opts.run_dir),
                               heartbeat_s=opts.heartbeat_s, lease_s=opts.lease_s,
                               probe_s=opts.probe_s, agreement_timeout_s=opts.agreement_timeout_s,
                               startup_s=opts.startup_s, quorum=opts.quorum,  # type: ignore[arg-type]
                               open_to_joins=False, joins_at_boundary=True, events=self.events,
                               on_note=lambda kind, fields: self.inbox.put(("note", kind, fields)))
        self.workers: list[Worker] = []
        self._exchange_parts: dict[tuple[int, str], dict[int, Any]] = {}
        self._trains = False
        """A worker committed a step: a crashed worker can rejoin (take the members' state)."""
        self._slow: DutyCycle | None = None
        self._first = self.cp.decided.nodes
        """Generation 0's nodes (the job's templates are built for their count)."""
        self._boosted = False
        """This node's workers start at START_NICE (workers.py) until one trains."""
        self._trains_again = True
        """False from a restart (`_restart_node`) until a new worker trains."""
        self._crashes: dict[int, int] = {}
        """Crashes of each local rank's worker (MAX_WORKER_CRASHES)."""
        self._stop_signal: int | None = None
        """The stop signal this agent passed on to its workers, once it did."""
        self.drain = NodeDrain(self.cp, self.events, self.inbox.put, opts.lease_s)

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> int:
        realtime = raise_agent_priority()  # (before it starts a thread: they inherit it)
        self.cp.bind()
        for lr in range(self.opts.workers):
            self._spawn_worker(lr)
        if self.opts.boost_start:  # (AgentOptions.boost_start says why)
            self._boosted = set_priority(START_NICE, self.workers)
        self.cp.start()
        self.events.emit("agent_started", pid=os.getpid(), workers=self.opts.workers,
                         port=self.cp.addr.port, worker_pids=[w.proc.pid for w in self.workers],
                         realtime=realtime)
        if self.cp.core.joined:  # a spare's workers wait until a round swaps it in
            self._tell_membership(self.cp.decided)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, self._forward_signal)
        watch = self.drain.watch(self.opts.run_dir, self.opts.node, self.opts.drain_poll_s)
        try:
            return self._loop()
        finally:
            watch.stop()
            if self._slow is not None:
                self._slow.stop()
            kill_workers(self.workers, grace=0.0)
            self.cp.flush(timeout=1.0)
            self.cp.close()
            self.events.close()

    def _loop(self) -> int:
        while True:
            what, a, b = self.inbox.get()
            if what == "worker_msg":
                if a is self.workers[a.local_rank]:  # (not a restarted worker's last words)
                    self._on_worker_msg(a, b)
            elif what == "worker_exit":
                if a is not self.workers[a.local_rank]:
                    continue  # a worker killed when its node stepped out (_restart_node)
                code = self._on_worker_exit(a, b)
                if code is not None:
                    return code
            elif what == "signal":
                self._on_signal(a)
            elif what == "boost":  # (_restart_node)
                if a is self.workers[0] and not self._trains_again:
                    self._boosted = set_priority(START_NICE, self.workers)
            elif what == "drain":
                self.events.emit("drain_requested", node=self.opts.node, force=a, by=b)
                self._broadcast({"type": "drain", "force": a})
            elif what == "drain_late":  # (NodeDrain.left)
                self.drain.late()
                code = self._drained_exit()
                if code is not None:
                    return code
            elif what == "note":
                code = self._on_note(a, b)
                if code is not None:
                    return code

    # ------------------------------------------------------------------ workers

    def _spawn_worker(self, lr: int, rejoin_after: int | None = None) -> None:
        """Start local rank `lr`'s worker; `rejoin_after`: it replaces one of a node that
        stepped out of that generation (`_restart_node`), and joins the job when a round adds
        the node again (recovery/join.py)."""
        env = worker_env(self.opts, self.cp.decided, self.cp.core.joined, lr, self._first,
                         rejoin_after)
        w = start_worker(self.opts, lr, env, self.inbox)
        if rejoin_after is None:
            self.workers.append(w)
        else:
            self.workers[lr] = w

    def _broadcast(self, msg: dict[str, Any]) -> None:
        for w in self.workers:
            tell(w, msg)

    def _on_worker_msg(self, w: Worker, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "report":
            suspects = [s for s in msg.get("suspects", []) if s != self.opts.node]
            what = msg.get("kind")
            self.events.emit("worker_report", local_rank=w.local_rank, what=what,
                             detail=msg.get("detail", ""), suspects=suspects)
            why = f"worker {self.opts.node}/{w.local_rank} reported {what}"
            if what == "stall":  # (one that waits on its own node only: nobody to ping)
                if suspects or not msg.get("suspects"):
                    self.cp.stalls.probe(suspects, why, int(msg.get("gen", 0)),
                                         reported_threshold(msg.get("threshold_s")))
            elif suspects:
                for node in suspects:
                    self.cp.check(node, why, gen=msg.get("gen"))
            else:
                self.cp.probe(why, gen=msg.get("gen"))
        elif kind == "waiting":
            w.waiting = True
            if not self.cp.core.joined and all(x.waiting for x in self.workers):
                # Its workers are ready: swap it in when needed (a spare), or now (a node that
                # stepped out after a crash: the view lacks it).
                self.cp.request_join("rejoin" if self._crashes else
                                     "grown" if self.opts.boost_start else "spare")
        elif kind == "started":  # past the start: the leases are lease_s (topology.py)
            self.cp.started()
        elif kind == "training":  # a step committed: nodes may join now (membership.py, 7)
            self._trains = self._trains_again = True
            if self._boosted:  # it trains: no more than the members' share from now on
                self._boosted = not set_priority(0, self.workers)
            self.cp.open_joins()
        elif kind == "done":
            w.done_code, w.reason = int(msg.get("code", 0)), str(msg.get("reason", ""))
        elif kind == "slow":  # the slow fault (control/faults.py)
            if self._slow is None:
                self.events.emit("node_slowed", node=self.opts.node, factor=msg["factor"])
                self._slow = DutyCycle(lambda: [x.proc.pid for x in self.workers
                                                if x.proc.poll() is None], msg["factor"]).start()
        elif kind in ("leave", "drain_out"):
            self._on_leave(w, msg)
        elif kind == "exchange":
            gen, key = msg["gen"], msg["key"]
            if gen != self.cp.decided.gen or self.cp.core.proposal is not None or self.cp.fenced:
                tell(w, {"type": "exchange_failed", "gen": gen, "key": key,
                               "reason": f"membership moved on (generation {self.cp.decided.gen}"
                                         f"{', round open' if self.cp.core.proposal else ''})"})
                return
            parts = self._exchange_parts.setdefault((gen, key), {})
            parts[w.local_rank] = msg["value"]
            if len(parts) == len(self.workers):
                del self._exchange_parts[(gen, key)]  # from here on the core owns it
                # With its generation: the core may have moved on since the check above
                # (its reader threads do not wait for this loop).
                self.cp.exchange(key, {str(lr): v for lr, v in parts.items()}, gen)

    def _on_leave(self, w: Worker, msg: dict[str, Any]) -> None:
        """`w` leaves the job early (LEAVE: drained, or not), or tells of nodes that a commit
        vote drained (DRAIN_OUT: suspected at once, membership.py 4e)."""
        if msg["type"] == "drain_out":
            self.drain.out_of_vote(msg.get("nodes"))
        elif not msg.get("drained"):
            w.done_code, w.leaving = EXIT_OK, True
        else:
            w.done_code, w.drained = EXIT_OK, True
            if self.drain.leaving(self.workers, bye=msg.get("bye") is not False):
                self.events.emit("node_drained", node=self.opts.node)

    def _on_worker_exit(self, w: Worker, code: int) -> int | None:
        w.exit_code = code
        if w.drained:
            self.events.emit("worker_exited", local_rank=w.local_rank, code=code, drained=True)
            return self._drained_exit()
        if self.cp.fenced:
            # already going down -- or out after a drain (4e), its other workers gone now
            return self._drained_exit() if self.cp.core.draining else None
        if w.done_code is None and code == EXIT_BAD_INPUT:  # exit 2 is bad input, "done" or not
            w.done_code = EXIT_BAD_INPUT
            w.reason = (f"worker {w.local_rank} (pid {w.proc.pid}) exited with code 2 (bad "
                        "input) before it could say why; its error is in this agent's log")
        if w.done_code == EXIT_BAD_INPUT:
            reason = w.reason or f"worker {w.local_rank} reported bad input"
            self.events.emit("worker_exited", local_rank=w.local_rank, code=code, reason=reason)
            return self._stop_node("abort", EXIT_BAD_INPUT, reason)
        if w.leaving:
            self.events.emit("worker_exited", local_rank=w.local_rank, code=code, leaving=True)
            return self._stop_node("early", EXIT_NODE_LOST, f"worker {w.local_rank} left the "
                                   "job early")
        stopped = (w.done_code is None and self._stop_signal is not None
                   and code == -self._stop_signal)
        if stopped:  # not crashed (module docstring)
            w.done_code = EXIT_REQUEUE
            w.reason = (f"worker {w.local_rank} (pid {w.proc.pid}) was stopped by "
                        f"{describe_exit(code)} before it could save")
        if w.done_code is not None:
            # `done` next to `code`: a worker that crashed while leaving after its work (a
            # signal, or another code than it announced) is reported (the console warns).
            self.events.emit("worker_exited", local_rank=w.local_rank, code=code,
                             done=w.done_code, pid=w.proc.pid, stopped=stopped)
            if all(x.exit_code is not None for x in self.workers):
                codes = [x.done_code if x.done_code is not None else x.exit_code
                         for x in self.workers]
                code = max(int(c) for c in codes)  # type: ignore[arg-type]
                how = "finished" if code in (EXIT_OK, EXIT_REQUEUE) else "early"
                self.cp.leave(how, code, "; ".join(x.reason for x in self.workers if x.reason))
                self.events.emit("agent_finished", codes=codes, how=how)
                return code
            if w.done_code == EXIT_REQUEUE:
                self._stop_siblings(w)
            return None
        how = f"worker {w.local_rank} (pid {w.proc.pid}) exited with {describe_exit(code)} without 'done'"
        crashes = self._crashes[w.local_rank] = self._crashes.get(w.local_rank, 0) + 1
        if self._trains and crashes < MAX_WORKER_CRASHES:
            self._restart_node(w, code, how, crashes)
            return None
        if crashes > 1:
            how += f" (its crash {crashes}: the node rejoins after at most {MAX_WORKER_CRASHES - 1})"
        elif not self._trains:
            how += " (before the first committed step: no state to rejoin with)"
        self.events.emit("worker_failed", local_rank=w.local_rank, code=code, detail=how,
                         crashes=crashes)
        self.cp.fail_self(how)
        return None  # the 'fenced' note that fail_self produced ends the loop

    def _restart_node(self, w: Worker, code: int, how: str, crashes: int) -> None:
        """`w` crashed once the job trains: the node steps out at once (module docstring), its
        other workers -- in a generation it no longer belongs to -- are killed, and all of them
        start again as the node's joining workers; they say "waiting" when ready, and then the
        node asks to join (`_on_worker_msg`)."""
        gen = self.cp.decided.gen
        self.cp.withdraw(how)
        for x in self.workers:
            if x.exit_code is None:
                x.proc.kill()  # (its exit is reaped by its watcher and ignored: _loop)
        self._exchange_parts.clear()
        for lr in range(self.opts.workers):
            self._spawn_worker(lr, rejoin_after=gen)
        # The members train meanwhile: the new workers start at a higher priority -- once the
        # members' own recovery without this node is over (RESTART_BOOST_AFTER_S), which the
        # boosted start would slow down (chaos seed 2820: crash recoveries 0.5-1.1 s, not 0.3).
        self._trains_again = False
        timer = threading.Timer(RESTART_BOOST_AFTER_S, self.inbox.put,
                                [("boost", self.workers[0], None)])
        timer.daemon = True
        timer.start()
        self.events.emit("worker_restarting", local_rank=w.local_rank, code=code, detail=how,
                         crashes=crashes, restarts=MAX_WORKER_CRASHES - 1, after_gen=gen,
                         pid=self.workers[w.local_rank].proc.pid)

    def _drained_exit(self) -> int | None:
        """A drained node exits 0 once it is out (control/drain.py, `NodeDrain.out`)."""
        if not self.drain.out(self.workers):
            return None
        self.events.emit("agent_exit", code=EXIT_OK, reason="drained", how="early")
        return EXIT_OK

    def _stop_siblings(self, w: Worker) -> None:
        """`w` stopped for a requeue (its checkpoint fallback, which each rank decides from its
        own failed rounds, or a stop signal) while other workers of this node still run: the
        node can no longer take part in the job -- an exchange needs every local worker, so the
        others' would wait out their timeouts round after round (a chaos trial did, until its
        wall bound). They stop for the requeue too: each falls back at its next wait, after any
        checkpoint it is writing; the node then leaves like any node whose workers are done."""
        for x in self.workers:
            if x.exit_code is None and x.done_code is None:
                x.done_code, x.reason = EXIT_REQUEUE, (f"node {self.opts.node}: worker "
                                                       f"{w.local_rank} stopped for a requeue "
                                                       f"({w.reason or 'exit 75'})")
                tell(x, {"type": "fenced", "exit_code": EXIT_REQUEUE, "reason": x.reason})

    def _stop_node(self, how: str, code: int, reason: str) -> int:
        """This node stops on purpose while others may go on: tell the peers (BYE `how`), tell
        the node's other workers to stop, kill them after the grace period; returns `code`."""
        self.cp.leave(how, code, reason)  # type: ignore[arg-type]
        self._broadcast({"type": "fenced", "reason": f"node {self.opts.node} stops: {reason}",
                         "exit_code": code})
        kill_workers(self.workers, grace=self.opts.kill_grace_s)
        self.events.emit("agent_exit", code=code, reason=reason, how=how)
        return code

    def _forward_signal(self, signum: int, _frame: Any) -> None:
        # Runs between two bytecodes of the main thread: only a reentrant queue put is safe here.
        self.inbox.put(("drain", True, "SIGUSR1") if signum == signal.SIGUSR1
                       else ("signal", signum, None))

    def _on_signal(self, signum: int) -> None:
        self.events.emit("signal", signal=signal.Signals(signum).name)
        self._stop_signal = signum
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signum)

    # ------------------------------------------------------------------ control plane

    def _on_note(self, kind: str, fields: dict[str, Any]) -> int | None:
        if kind == "pinged":
            if self._slow is None:  # (the slow fault stops and continues them on purpose)
                kill_stopped(self.workers, self.events, fields["node"])
        elif kind == "decided":
            self._exchange_parts.clear()
            self._tell_membership(Decision.from_msg(fields))
        elif kind == "round_started":
            self._broadcast({"type": "round", "gen": fields["gen"],
                             "suspects": fields["suspects"],
                             "joins_only": fields["joins_only"]})
            # Exchanges still collecting local values never reached the control plane: fail
            # them here (those that did are failed by the core).
            for (gen, key) in list(self._exchange_parts):
                self._broadcast({"type": "exchange_failed", "gen": gen, "key": key,
                                 "reason": "membership round open"})
            self._exchange_parts.clear()
        elif kind == "exchange_done":
            values: dict[str, list[Any]] = {}
            for node, per_rank in fields["values"].items():
                values[node] = [per_rank[k] for k in sorted(per_rank, key=int)]
            self._exchange_parts.pop((fields["gen"], fields["key"]), None)
            self._broadcast({"type": "exchange_done", "gen": fields["gen"], "key": fields["key"],
                             "values": values})
        elif kind == "exchange_failed":
            self._exchange_parts.pop((fields["gen"], fields["key"]), None)
            self._broadcast({"type": "exchange_failed", "gen": fields["gen"], "key": fields["key"],
                             "reason": fields["reason"]})
        elif kind == "drained_out":  # (membership.py, 4e)
            self.events.emit("drained_out", node=self.opts.node, gen=fields["gen"],
                             how=fields["how"])
            return self._drained_exit()
        elif kind == "fenced":
            code = int(fields["code"])
            self._broadcast({"type": "fenced", "reason": fields["reason"], "exit_code": code})
            crashed = any(w.exit_code is not None and w.done_code is None for w in self.workers)
            kill_workers(self.workers, grace=0.0 if crashed else self.opts.kill_grace_s)
            self.events.emit("agent_exit", code=code, reason=fields["reason"])
            return code
        return None

    def _tell_membership(self, d: Decision, workers: list[Worker] | None = None) -> None:
        msg = {"type": "membership", **d.to_msg(), "store_host": self.cp.store_host(d.store_node)}
        for w in self.workers if workers is None else workers:
            tell(w, msg)


# ---------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    configure("INFO", fmt="%(asctime)s %(message)s")  # (OOBLECK_LOG_LEVEL, from the CLI)
    try:
        opts = parse_args(argv)
        return Agent(opts).run()
    except OobleckError as e:
        print(f"oobleck_hpc.control.agent: error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # a busy port is this node's passing trouble: requeue; else bad input
        print(f"oobleck_hpc.control.agent: error: {e}", file=sys.stderr)
        return EXIT_REQUEUE if e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL) else EXIT_BAD_INPUT


if __name__ == "__main__":
    raise SystemExit(main())
