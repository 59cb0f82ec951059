"""A node's worker processes as its agent (agent.py) supervises them: start one per local rank
with the environment the worker's bootstrap reads, watch each one, send it messages, kill what
is left when the node stops.

Watching costs two threads per worker: one blocked in wait() (an exit is seen at once) and one
reading its link to the agent. Both only queue what they see on the agent's inbox --
("worker_msg", worker, msg) and ("worker_exit", worker, code) -- what it means (relay it, restart
the worker, stop the node) is the agent's decision, taken on its one thread.

Worker environment (what `oobleck_hpc.bootstrap.detect()` reads, source 'local'): OOBLECK_NODE,
OOBLECK_NODES (generation 0: the roster), OOBLECK_LOCAL_RANK, OOBLECK_NODE_ADDR, and as `extra`:
OOBLECK_JOB (with --job), OOBLECK_RUN_DIR, OOBLECK_STORE (generation 0's store host:port, to be
hosted by local rank 0 of the first roster node), OOBLECK_AGENT_FD, OOBLECK_LOCAL_WORLD,
OOBLECK_NODE_INDEX (see oobleck_hpc/control/client.py for the link itself); a spare's workers
get OOBLECK_SPARE, the workers of a node that rejoins after a crash OOBLECK_REJOIN_AFTER_GEN and
OOBLECK_FIRST_NODES too.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from oobleck_hpc.control.agent_options import AgentOptions
from oobleck_hpc.control.membership import Decision
from oobleck_hpc.control.wire import ConnectionClosed, recv_msg, send_msg
from oobleck_hpc.errors import OobleckError

if TYPE_CHECKING:
    from oobleck_hpc.records.events import EventLog

START_NICE = -10
"""The CPU priority of a node whose workers start while the job trains (a node back after a
crash, a grown node: AgentOptions.boost_start), until they train (`set_priority`). Where it
shares the cores with the members (one machine) its start then takes seconds, not half a
minute of a small share (a worker needs about 3 CPU seconds to be ready: torch, the model,
AdamW's first construction). Only root may raise a priority: elsewhere they start as usual."""

AGENT_RT_PRIORITY = 1
"""The agent's real-time priority (SCHED_RR; 1, the lowest: `raise_agent_priority`)."""

Inbox = queue.SimpleQueue[tuple[str, Any, Any]]
"""The agent's queue of (what, a, b): everything its one thread acts on."""


@dataclass
class Worker:
    local_rank: int
    proc: subprocess.Popen[bytes]
    sock: socket.socket
    lock: threading.Lock = field(default_factory=threading.Lock)
    done_code: int | None = None
    """The code the worker announced ("done"; 0 for "leave"), None until then."""
    reason: str = ""
    leaving: bool = False
    """It said "leave": it leaves the job early, the others go on."""
    drained: bool = False
    """It said "leave" after its node's drain was accepted (control/drain.py)."""
    waiting: bool = False
    """It waits for a membership (ready to train): a spare asks to join once all are."""
    exit_code: int | None = None
    link_read: threading.Event = field(default_factory=threading.Event)
    """Set once the worker's link reached its end: everything it sent is in the inbox."""


def worker_env(opts: AgentOptions, d0: Decision, joined: bool, lr: int,
               first: tuple[str, ...], rejoin_after: int | None) -> dict[str, str]:
    """Local rank `lr`'s environment (module docstring), less OOBLECK_AGENT_FD (`start_worker`): `d0`
    the membership the node starts in, `joined` False for a spare, `first` generation 0's nodes
    (the templates' size), `rejoin_after` the generation a restarted node stepped out of."""
    env = dict(os.environ)
    env.update(opts.extra_env)
    roster = opts.roster
    env.update({
        "OOBLECK_NODE": opts.node,
        "OOBLECK_NODES": ",".join(d0.nodes if joined else  # (a spare: after the view)
                                  tuple(n for n in d0.nodes if n != opts.node) + (opts.node,)),
        "OOBLECK_NODE_ADDR": roster.address(opts.node).host,
        "OOBLECK_NODE_INDEX": str(roster.names.index(opts.node)),
        "OOBLECK_LOCAL_RANK": str(lr),
        "OOBLECK_LOCAL_WORLD": str(opts.workers),
        "OOBLECK_RUN_DIR": str(opts.run_dir),
        "OOBLECK_STORE": f"{roster.address(d0.store_node).host}:{d0.store_port}",
    })
    if not joined:
        env["OOBLECK_SPARE"] = "1"  # OOBLECK_NODES: generation 0, then this spare
    if rejoin_after is not None:
        env["OOBLECK_REJOIN_AFTER_GEN"] = str(rejoin_after)
        env["OOBLECK_FIRST_NODES"] = ",".join(first)
    if opts.job is not None:
        env["OOBLECK_JOB"] = str(opts.job.resolve())
    return env


def start_worker(opts: AgentOptions, lr: int, env: dict[str, str], inbox: Inbox) -> Worker:
    """Start local rank `lr`'s worker with a link to the agent, and its two watching threads."""
    parent, child = socket.socketpair()
    try:
        with usual_policy_for_children():
            proc = subprocess.Popen(opts.command,
                                    env={**env, "OOBLECK_AGENT_FD": str(child.fileno())},
                                    pass_fds=(child.fileno(),))
    except OSError as e:
        raise OobleckError(f"agent {opts.node}: cannot start worker {opts.command!r}: {e}") from e
    finally:
        child.close()
    w = Worker(lr, proc, parent)
    threading.Thread(target=_watch_exit, args=(w, inbox), daemon=True,
                     name=f"agent-wait-{lr}").start()
    threading.Thread(target=_watch_link, args=(w, inbox), daemon=True,
                     name=f"agent-link-{lr}").start()
    return w


def set_priority(nice: int, workers: list[Worker]) -> bool:
    """This node's CPU priority (START_NICE, then 0 again). With the kernel's autogroups -- a
    scheduling group per session, and the local launcher starts every agent in its own -- a
    process's nice only ranks it within its group, so the node's group takes it (the agent's
    share rises with its workers': its heartbeats are never behind them); else each thread of
    each worker. False when not allowed (not root) or not possible."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            autogroups = f.read().strip() == "1"
    except OSError:
        autogroups = False
    try:
        if autogroups:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(nice))
            return True
        for w in workers:
            for tid in os.listdir(f"/proc/{w.proc.pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        return True
    except OSError:  # (PermissionError: not root; a worker that exited meanwhile)
        return False


def raise_agent_priority() -> bool:
    """Run this agent's threads -- this one and those it starts from now on -- at the lowest
    real-time priority (SCHED_RR, AGENT_RT_PRIORITY); its workers and other children run as
    usual (`usual_policy_for_children`). False where not allowed (not root, no RLIMIT_RTPRIO).

    Why: the agent answers its peers' heartbeats and a stall probe's pings, and it shares a
    scheduling group with its busy workers (one autogroup per session: the node's process
    group). When the cores are oversubscribed the group waits for its turn as a whole: a
    thread sleeping 20 ms in a session with two spinning processes, on this 2-core machine
    already loaded, woke up to 0.23 s late (118 times more than 0.05 s late in 90 s; 102
    with the spinners at nice 5; never at SCHED_RR). An agent that late misses a probe's
    deadline, and its healthy node is evicted (bench/recovery.py crash_under_hog: an agent
    silent for 1.06 s while a restarted node's workers started was fenced). An agent uses
    little CPU: it waits on sockets."""
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(AGENT_RT_PRIORITY))
        return True
    except (OSError, AttributeError):  # (EPERM; no such call on this platform)
        return False


@contextlib.contextmanager
def usual_policy_for_children() -> Iterator[None]:
    """Processes this thread starts inside the block run at the usual policy (the kernel's
    SCHED_RESET_ON_FORK), not at the agent's real-time one (`raise_agent_priority`)."""
    try:
        policy = os.sched_getscheduler(0)
    except (OSError, AttributeError):
        policy = -1
    if policy != os.SCHED_RR:
        yield
        return
    param = os.sched_getparam(0)
    os.sched_setscheduler(0, os.SCHED_RR | os.SCHED_RESET_ON_FORK, param)
    try:
        yield
    finally:
        os.sched_setscheduler(0, os.SCHED_RR, param)


def process_state(pid: int) -> str:
    """The process state letter from /proc (R, S, T, Z, ...); '' if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def kill_stopped(workers: list[Worker], events: EventLog, by: str) -> None:
    """A peer that waits on this node pinged its agent (a stall probe, control/stall_probe.py),
    which answers. A worker of this node that is stopped (SIGSTOP, a debugger's stop) would
    hold the job until its collective timeout, then every retry round: it is killed, and its
    exit is a crash like any other (the node steps out and rejoins: agent.py)."""
    for w in workers:
        if w.exit_code is None and process_state(w.proc.pid) in ("T", "t"):
            events.emit("worker_stopped", local_rank=w.local_rank, pid=w.proc.pid, pinged_by=by)
            w.proc.kill()


def _watch_exit(w: Worker, inbox: Inbox) -> None:
    code = w.proc.wait()
    # What the worker sent before it exited (its "done") comes first: its end of the link
    # closes with it, so the reader reaches the end at once. Without this wait the exit
    # could overtake the "done" just before it ("exited without 'done'": a finished node
    # taken for a crashed one; seen once in a CI run of test_engine_run).
    w.link_read.wait(timeout=5.0)
    inbox.put(("worker_exit", w, code))


def _watch_link(w: Worker, inbox: Inbox) -> None:
    try:
        while True:
            try:
                msg = recv_msg(w.sock)
            except (ConnectionClosed, OSError, ValueError):
                return
            inbox.put(("worker_msg", w, msg))
    finally:
        w.link_read.set()


def tell(w: Worker, msg: dict[str, Any]) -> None:
    """Send `msg` to a worker that has not exited (one that is exiting misses it: its exit is
    the agent's next news about it)."""
    if w.exit_code is not None:
        return
    with w.lock:
        try:
            send_msg(w.sock, msg)
        except OSError:
            pass  # the worker is exiting; its exit reaches the inbox (_watch_exit)


def kill_workers(workers: list[Worker], grace: float) -> None:
    """Give `workers` `grace` seconds in all to exit, kill those still running, reap them."""
    deadline = time.monotonic() + grace
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
    for w in workers:
        try:
            w.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def describe_exit(code: int) -> str:
    """A worker's exit status in words: "code 1", "signal SIGKILL"."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
