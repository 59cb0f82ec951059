"""The reconfigure driver: a worker's training steps, recovering in place when nodes are lost.

    driver = ElasticDriver(job, model, profile, dataset, device, client, events, faults)
    plan, comm = driver.start()          # generation 0: plan, store, groups
    driver.build_engine(state, layers)   # fresh, or from a checkpoint
    while driver.engine.state.step < steps:
        result = driver.step()           # a committed step (recovers in place on failures)

`step()` runs `engine.step()`; a failed step (a value, never an exception: engine.py) or a round
opened by the agents turns into `recover()`:

1. Report: `client.report_failure("comm_error", detail, suspects)` -- suspects = the node of the
   failing transfer's peer when known (the agent suspects it at once), else none (the agent
   probes every peer). Then destroy every process group of this generation at once: peers still
   blocked in a collective with this rank see their sockets close and fail within milliseconds
   instead of waiting for the collective timeout (gloo); with NCCL the communicators are aborted
   when the agent announces a round (`_on_notice`).
2. Agreement: `client.wait_membership(after_gen)` returns the generation the agents decided (see
   elastic/membership.py); lost = base plan's nodes missing from it.
3. Plan: `reconfigure(base_plan, lost, templates, profile, f)` -- pure, so every survivor computes
   the same plan; GuaranteeExceeded propagates to the caller (checkpoint fallback). Survivors
   confirm with `client.exchange` of (base plan digest, new plan digest, step, cursor): any
   difference is a hard error (never continue with a wrong model).
4. Groups: the generation's store (hosted by local rank 0 of `m.store_node`), `Comm.init` with the
   generation number (a fresh key prefix), `PlanGroups.build`.
5. Transfer: a new Engine on the new plan at the same TrainState, the rank's kept layers copied
   from its base engine, the rest received from surviving replicas (elastic/transfer.py,
   weights + AdamW state).
6. Replay: the interrupted step was never committed anywhere (see below), so the new engine runs
   it again: same cursor, the same global microbatches re-split over the new pipelines
   (GlobalSampler indexes samples by global microbatch, whatever the plan), the same global
   batch size. Nothing is skipped or repeated.

Base engine. The engine whose plan committed the last step is the BASE: the authority for
layers, optimizer state and TrainState. A new engine becomes the base only when it commits its
first step; until then every failure -- during agreement, the regroup, the transfer or the
replayed step -- starts a new round from the same base, which every survivor agrees on (all
committed the same steps). The old base's layers are freed at that first commit. So a failure
during reconfiguration supersedes the round with no partial state anywhere.

Commit consistency. A step commits on a rank once its final global all-reduce succeeded; a round
announced by the agents aborts a step only before that point (forward, backward, gradient sync),
never in the optimizer phase. Ranks therefore disagree on the step only if a peer died INSIDE the
final all-reduce after some ranks finished it; the (digest, step, cursor) exchange detects that
and raises RecoveryError (the checkpoint fallback) rather than continuing on mixed states.

Events (run_dir/events.jsonl, source node/local_rank): step_failed (every rank that saw it: phase,
peer, error), membership_agreed, plan_chosen, groups_rebuilt, state_transferred (bytes), and
recovered (first committed step after the recovery, with the phase times); the new rank 0 also
prints one short line per transition.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from oobleck_hpc.elastic.events import EventLog
from oobleck_hpc.elastic.membership import Superseded
from oobleck_hpc.errors import OobleckError


class RecoveryError(OobleckError):
    """Survivors disagree on the state to resume from: in-place recovery cannot continue."""

    exit_code = 75  # as GuaranteeExceeded: fall back to the last checkpoint


class RoundOpened(Exception):
    """Raised from the engine's on_phase hook when the agents opened a membership round."""


@dataclass
class Recovery:
    """One completed in-place recovery, as this worker saw it."""

    step: int
    lost: tuple[str, ...]
    generation: int
    plan: str
    t_failed: float
    t_recovered: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    rounds: int = 1
    bytes_moved: int = 0

    @property
    def seconds(self) -> float:
        return self.t_recovered - self.t_failed


class ElasticDriver:
    """One worker's training, recovering in place (see module docstring)."""

    def __init__(self, job, model, profile, dataset, device: torch.device, client, events: EventLog,
                 faults=None, store_timeout_s: float = 300.0):
        self.job, self.model, self.profile, self.dataset = job, model, profile, dataset
        self.device, self.client, self.events, self.faults = device, client, events, faults
        self.node, self.local_rank = client.node, client.local_rank
        ft = job.fault_tolerance
        self.timeout_s = ft.collective_timeout_s
        # Survivors may still be blocked in an old collective for up to the collective timeout
        # when a new generation is decided; the rendezvous waits longer than that.
        self.rendezvous_s = 2 * ft.collective_timeout_s + ft.lease_s + 5.0
        self.agree_s = 4 * ft.lease_s + 2 * ft.collective_timeout_s + 30.0
        self.store_timeout_s = store_timeout_s
        self.gen = -1
        self.plan = None
        self.templates = None
        self.comm = None
        self.store = None
        self.engine = None
        self.base = None
        """The engine of the last committed step (module docstring); None while it is `engine`."""
        self.base_plan = None
        self.recoveries: list[Recovery] = []
        self._pending: Recovery | None = None

    # ------------------------------------------------------------------ generation 0

    def start(self):
        """Generation 0: wait for the roster membership, plan, rendezvous and build the groups.
        Returns (plan, comm); then `build_engine` (a checkpoint restore goes in between)."""
        from oobleck_hpc.planning import plan_job

        m = self.client.wait_membership(timeout=self.store_timeout_s)
        self.gen = m.gen
        _, self.templates, plan = plan_job(self.job, self.profile, list(m.nodes))
        self.comm, self._groups = self._regroup(m, plan, self.store_timeout_s)
        self.plan = plan
        return plan, self.comm

    def build_engine(self, state=None, layer_states=None):
        """The generation-0 engine (from a checkpoint's state and layers when given)."""
        from oobleck_hpc.engine import Engine

        self.engine = Engine(self.job, self.model, self.plan, self.comm, self._groups,
                             self.dataset, self.device, state=state, layer_states=layer_states,
                             on_phase=self._on_phase, abort=self._round_opened)
        return self.engine

    @property
    def rank(self) -> int:
        return self.comm.rank

    # ------------------------------------------------------------------ steps

    def step(self):
        """One committed step; failures are recovered in place (raises GuaranteeExceeded,
        RecoveryError, Fenced when that is impossible)."""
        while True:
            try:
                result = self.engine.step()
            except RoundOpened as e:
                result = None
                why, peer = str(e), None
                phase = "round"
            if result is not None and result.ok:
                self._committed()
                return result
            if result is not None:
                why, phase = repr(result.error), result.phase
                # Name the peer only when its connection broke (its process died). An aborted
                # wait or a timeout says nothing about the peer: it may itself be waiting on
                # the failed node, and a false suspicion would fence a healthy node.
                peer = result.peer if _peer_died(result.error) else None
            self.recover(self.engine.state.step, phase, why, peer)

    def _committed(self) -> None:
        if self.base is not None:  # first commit on a new plan: it becomes the base
            self.base.close()
            self.base, self.base_plan = None, None
        r = self._pending
        if r is not None:
            self._pending = None
            r.t_recovered = time.time()
            r.phases["first_step"] = r.t_recovered - r.t_failed - sum(r.phases.values())
            self.recoveries.append(r)
            if self.rank == 0:
                self.events.emit("recovered", step=r.step, generation=r.generation, lost=r.lost,
                                 seconds=round(r.seconds, 4), rounds=r.rounds, plan=r.plan,
                                 phases={k: round(v, 4) for k, v in r.phases.items()},
                                 bytes_moved=r.bytes_moved)
                print(f"recovered: lost {', '.join(r.lost) or 'nothing'} at step {r.step}; first "
                      f"step committed on plan {r.plan} (generation {r.generation}) "
                      f"{r.seconds:.2f} s after the failure was seen", flush=True)

    def _round_opened(self) -> bool:
        """The agents opened a membership round (or decided one) past this generation."""
        r = self.client.round_open
        m = self.client.membership
        return (r is not None and r["gen"] > self.gen) or (m is not None and m.gen > self.gen)

    def _on_phase(self, phase: str, step: int) -> None:
        if self.faults is not None:
            self.faults(phase, step)
        if phase != "optimizer" and self._round_opened():
            # past the final all-reduce a step always commits (module docstring)
            r = self.client.round_open
            raise RoundOpened(f"membership round opened (suspects: "
                              f"{r['suspects'] if r else 'decided'})")

    # ------------------------------------------------------------------ recovery

    def recover(self, step: int, phase: str, why: str, peer: int | None) -> None:
        from oobleck_hpc.engine import Engine
        from oobleck_hpc.planning.reconfigure import reconfigure, transfer_plan
        from oobleck_hpc.planning.cost import job_profile
        from oobleck_hpc.elastic import transfer

        t_failed = time.time()
        suspects = []
        if peer is not None and self.plan is not None and 0 <= peer < self.plan.world_size:
            suspects = [self.plan.ranks[peer].node]
        suspects = [s for s in suspects if s != self.node]
        self.events.emit("step_failed", step=step, phase=phase, peer=peer, suspects=suspects,
                         error=why[:300], generation=self.gen)
        self.client.report_failure("comm_error", f"step {step} {phase}: {why[:200]}", suspects)
        if self.faults is not None:
            self.faults.on_failed_step(step)
        if self.base is None:  # the current engine was the base
            self.base, self.base_plan = self.engine, self.plan
        elif self.engine is not self.base:
            self.engine.close()
        self.engine = None
        self._teardown()
        rec = self._pending or Recovery(step, (), self.gen, "", t_failed)
        if self._pending is not None:
            rec.rounds += 1
        self._pending = rec
        while True:
            t0 = time.time()
            m = self.client.wait_membership(after_gen=self.gen, timeout=self.agree_s)
            self.gen = m.gen
            lost = tuple(n for n in self.base_plan.nodes if n not in m.nodes)
            t1 = time.time()
            rec.phases["agree"] = rec.phases.get("agree", 0.0) + (t1 - t0)
            # The same (core-scaled) profile the templates were built from (planning.plan_job).
            new_plan = reconfigure(self.base_plan, lost, self.templates,
                                   job_profile(self.job, self.profile), self.job.fault_tolerance.f)
            new_plan = replace(new_plan, generation=m.gen)
            new_rank = new_plan.rank_of(self.node, self.local_rank)
            state = self.base.state
            t2 = time.time()
            rec.phases["plan"] = rec.phases.get("plan", 0.0) + (t2 - t1)
            if new_rank == 0:
                self.events.emit("membership_agreed", generation=m.gen, nodes=list(m.nodes),
                                 lost=list(lost), store=m.store_addr)
                self.events.emit("plan_chosen", generation=m.gen, plan=new_plan.digest(),
                                 pipelines=[p.template.num_nodes for p in new_plan.pipelines],
                                 microbatches=[p.microbatches for p in new_plan.pipelines],
                                 plan_seconds=round(t2 - t1, 4))
                print(f"agreed: generation {m.gen}, lost {', '.join(lost)}; new plan "
                      f"{new_plan.digest()}: pipelines of "
                      f"{[p.template.num_nodes for p in new_plan.pipelines]} nodes", flush=True)
            try:
                mine = [self.base_plan.digest(), new_plan.digest(), state.step, state.cursor]
                values = self.client.exchange(f"recover-{m.gen}", mine, timeout=self.agree_s,
                                              gen=m.gen)
                other = [v for per_node in values.values() for v in per_node if v != mine]
                if other:
                    raise RecoveryError(
                        f"survivors disagree on the recovery of generation {m.gen}: this rank "
                        f"has (base plan, new plan, step, cursor) = {mine}, another {other[0]}; "
                        "falling back to the last checkpoint")
                if self.faults is not None:
                    self.faults("reconfiguration", state.step)
                if self._round_opened():  # the exchange may have completed here only
                    raise Superseded(f"generation {m.gen} superseded before regrouping")
                t3 = time.time()
                comm, groups = self._regroup(m, new_plan, self.rendezvous_s)
                t4 = time.time()
                rec.phases["regroup"] = rec.phases.get("regroup", 0.0) + (t4 - t3)
                if new_rank == 0:
                    self.events.emit("groups_rebuilt", generation=m.gen, world=comm.world_size,
                                     groups=len(groups.groups), seconds=round(t4 - t3, 4))
                kept = {layer: self.base.layer_state(layer)
                        for layer in range(new_plan.ranks[new_rank].layer_start,
                                           new_plan.ranks[new_rank].layer_end)
                        if layer in self.base.layers}
                engine = Engine(self.job, self.model, new_plan, comm, groups, self.dataset,
                                self.device, state=replace(state), layer_states=kept,
                                on_phase=self._on_phase, abort=self._round_opened)
                moves = transfer_plan(self.base_plan, new_plan, self.profile)
                stats = transfer.execute(moves, new_rank, self.base, engine, comm.timeout)
                t5 = time.time()
                rec.phases["transfer"] = rec.phases.get("transfer", 0.0) + (t5 - t4)
                rec.bytes_moved = sum(t.nbytes for t in moves)
                self.events.emit("state_transferred", generation=m.gen, rank=new_rank,
                                 sent_bytes=stats.sent_bytes, received_bytes=stats.received_bytes,
                                 layers_in=stats.received_layers, layers_out=stats.sent_layers,
                                 seconds=round(stats.seconds, 4))
            except Superseded:
                self._teardown()
                continue
            except (RuntimeError, TimeoutError, ValueError) as e:
                if isinstance(e, RecoveryError):
                    raise
                # A failure during reconfiguration: report it and start a new round from the
                # same base (module docstring).
                self.events.emit("reconfiguration_failed", generation=m.gen, error=repr(e)[:300])
                self.client.report_failure("comm_error", f"reconfiguration of generation "
                                           f"{m.gen}: {e!r}"[:300])
                self._teardown()
                rec.rounds += 1
                continue
            rec.lost = tuple(sorted(set(rec.lost) | set(lost)))
            rec.generation, rec.plan = m.gen, new_plan.digest()
            self.plan, self.engine = new_plan, engine
            return

    # ------------------------------------------------------------------ groups

    def _regroup(self, m, plan, timeout_s: float):
        """Rendezvous on generation `m.gen`'s store and build the plan's groups.

        Every rank first waits, up to `timeout_s`, until all ranks of the plan reached the store
        (Superseded as soon as a newer round opens). torch bounds a process group's rendezvous by
        the collective timeout, short on purpose; without this wait, ranks arriving seconds apart
        time out: at generation 0 those still importing torch on a loaded machine, later a
        survivor still stuck for a collective timeout in the previous, failed rendezvous while
        the others already started the next one (each then gives up on the other). A rank that
        died instead never arrives; its loss opens a newer round, which ends the wait at once.
        """
        from oobleck_hpc.engine import Comm, PlanGroups, default_backend

        rank = plan.rank_of(self.node, self.local_rank)
        host = self.client.hosts_store(m)
        if not host:
            # TCPStore's client backs off up to a second between connection attempts; the host
            # is starting right now, so poll its port cheaply first.
            _wait_port(m.store_host, m.store_port, timeout_s, self._round_opened)
        old = self.store
        self.store = _open_store(m.store_host, m.store_port, host, timeout_s, self._round_opened)
        del old
        _wait_arrivals(self.store, f"oobleck/gen{m.gen}/arrived", plan.world_size, timeout_s,
                       self._round_opened)
        comm = Comm.init(self.store, rank, plan.world_size, m.gen,
                         default_backend(self.device.type), self.timeout_s)
        self.comm = comm
        try:
            groups = PlanGroups.build(plan, comm)
        except BaseException:
            self._teardown()
            raise
        return comm, groups

    def _teardown(self, clean: bool = False) -> None:
        """Drop this generation's groups: after a failure without waiting for the collectives
        still in flight (Comm.abandon), at the end of the run cleanly (Comm.destroy)."""
        if self.comm is not None:
            try:
                if clean:
                    self.comm.destroy()
                else:
                    self.comm.abandon()
            except Exception as e:  # a broken group still goes away
                print(f"[{self.node}/{self.local_rank}] destroying generation {self.gen}: {e!r}",
                      file=sys.stderr, flush=True)
            self.comm = None

    def on_notice(self, kind: str, msg: dict[str, Any]) -> None:
        """AgentClient callback: with NCCL, abort the communicators as soon as a round opens
        (an NCCL collective does not time out promptly by itself); gloo relies on the short
        collective timeout and on failed peers destroying their groups."""
        if kind == "round" and self.comm is not None and self.comm.backend == "nccl":
            abort = getattr(torch.distributed.distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                try:
                    abort()
                except Exception:
                    pass

    def close(self) -> None:
        for e in (self.engine, self.base):
            if e is not None:
                e.close()
        self._teardown(clean=True)
        self.store = None


def _wait_arrivals(store, key: str, world_size: int, timeout_s: float, abort=None) -> None:
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while (arrived := store.add(key, 0)) < world_size:
        if abort is not None and abort():
            raise Superseded(f"a newer membership round opened while {arrived} of {world_size} "
                             f"ranks had reached the store")
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {arrived} of {world_size} ranks reached the store "
                               f"within {timeout_s:.0f} s")
        time.sleep(0.02)


def _open_store(host: str, port: int, is_master: bool, timeout_s: float, abort=None):
    """Generation store: the host creates it; a client connects on a helper thread while this
    one polls abort() and gives up (Superseded) as soon as a newer round opens. torch retries a
    client's connection until the store's timeout and cannot be interrupted: a store host that
    dies between _wait_port and the connection held a survivor for that long while the others
    had agreed on the next round (seen in CI, a second node lost during a recovery)."""
    import torch.distributed as dist

    from oobleck_hpc.engine.groups import run_abortable

    def make():
        return dist.TCPStore(host, port, is_master=is_master, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))

    if is_master or abort is None:
        return make()

    def stop() -> BaseException | None:
        if abort():
            return Superseded(f"a newer membership round opened while connecting to the store "
                              f"{host}:{port}")
        return None

    return run_abortable(make, stop, 0.02, "store-connect")


def _wait_port(host: str, port: int, timeout_s: float, abort=None) -> None:
    """Until host:port accepts connections; Superseded as soon as abort() (a newer round: the
    host may have moved on and will never open this store)."""
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if abort is not None and abort():
            raise Superseded(f"a newer membership round opened while waiting for the store "
                             f"{host}:{port}")
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.005)


def _peer_died(error: BaseException | None) -> bool:
    text = str(error)
    return any(m in text for m in ("Connection closed by peer", "Connection reset by peer",
                                   "Broken pipe"))


def describe_recoveries(recoveries: list[Recovery]) -> str:
    return "; ".join(f"lost {', '.join(r.lost)} at step {r.step}: recovered in {r.seconds:.2f} s"
                     for r in recoveries)


__all__ = ["ElasticDriver", "Recovery", "RecoveryError", "RoundOpened", "describe_recoveries"]
_ = os
