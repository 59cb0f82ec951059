"""The run as a user reads it: one line per event that matters, made from the run's events.

    story = Story()
    tail = Tail(run_dir / "events.jsonl")
    for event in tail.read():          # call again for what was appended since
        for line in story.feed(event):
            print(line)

The console of `oobleck-hpc run` and `oobleck-hpc submit --wait`, and the timeline of
`oobleck-hpc report`, are this one rendering of RUN_DIR/events.jsonl (written by every agent and
worker: records/events.py), so a recovery is told once, with one time, wherever it is read:

    starting 5 nodes x 2 workers on this machine: each worker imports torch, then they meet and plan (...)
    plan 89fdabc9 on 5 nodes x 2 GPUs: 4 pipelines of [2, 1, 1, 1] nodes, 4 microbatches, predicted step 66.3 ms
    fault injected: kill node3 during step 20 (backward)
    fault seen: node3 lost (connection lost, seen by node4)
    agreed: generation 1 on 4 nodes, without node3
    recovered: step 20 replayed on plan cb35acec (pipelines of [1, 1, 1, 1] nodes) 0.24 s after the fault; 3.44 MB of layer state moved
    checkpoint: step 12 written (2.4 MB, 0.05 s)
    fell back: layer 3 has no replica left (...); the job resumes from step 8
    requeued: attempt 1 on 3 nodes (alive: node0, node2, node4): ...
    done: 60 steps of gpt-tiny; loss 5.5882 -> 3.3789; 89.8 samples/s over the 5.3 s of the training loop (...); 1 recovery

The recovery time is the user's: from the first sign of the failure -- the injected fault or the
`kill-node` (the moment of the kill), else the first survivor that noticed it -- to the first
step committed on the new plan (the `recovered` event). Pure: no I/O but `Tail`'s reads.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from oobleck_hpc.records import events as ev

SIGNS = (ev.FAULT_INJECTED, ev.NODE_KILLED, ev.FAILURE_DETECTED, ev.STEP_FAILED)
"""Events that mark the start of a failure (the earliest one times the recovery)."""
KILLED = {"SIGKILL": "killed", "SIGSTOP": "hung", "SIGTERM": "asked to stop"}
"""What `oobleck-hpc kill-node --signal` did to a node (its agent and workers), by signal:
SIGKILL a crash, SIGSTOP a hang (frozen, not dead: the others exclude it once their workers'
waits on it stall and its agent does not answer a ping, recovery/stall.py, or once its lease
expires), SIGTERM a stop request."""


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 template', '2 templates' (`many` for irregular plurals)."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def mb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.2f} MB"


@dataclass
class Story:
    """Turns events into console lines (module docstring). Feed the events of one run in file
    order; events that repeat across agents and ranks (a failure seen by every survivor, the
    same agreement reached by each) give one line."""

    first_sign: float | None = None
    """Time of the first sign of the failure being recovered from (None: no failure open)."""
    grown: float | None = None
    """Time nodes were last added by `grow` (a recovery that loses nothing is timed from it)."""
    said: set = field(default_factory=set)
    plans: dict[tuple[int, int], dict] = field(default_factory=dict)
    """(attempt, generation) -> its plan_chosen event."""
    recoveries: int = 0
    requeues: int = 0
    steps: int = 0
    """The run's steps (its `run_started` event; 0: not seen)."""
    began: dict[int, float] = field(default_factory=dict)
    """attempt -> the time of its first event (its start, when fed from the beginning)."""

    def feed(self, e: dict[str, Any]) -> list[str]:
        kind, attempt = e.get("kind", ""), e.get("attempt", 0)
        if "t" in e and (attempt not in self.began or e["t"] < self.began[attempt]):
            self.began[attempt] = e["t"]
        if kind in SIGNS:
            t = e.get("t", 0.0)
            self.first_sign = t if self.first_sign is None else min(self.first_sign, t)
        render = _RENDER.get(kind)
        if render is None:
            return []
        key = kind, attempt, _once_key(e)
        if key in self.said:
            return []
        self.said.add(key)
        line = render(self, e)
        return [line] if line else []

    # One method per event kind the user cares about; `_once_key` says what makes it new.

    def _plan_chosen(self, e: dict) -> str:
        self.plans[e.get("attempt", 0), e.get("generation", 0)] = e
        if e.get("generation", 0) > 0 and not e.get("start"):
            return ""  # told by the recovery it belongs to (a start on survivors: told here)
        text = (f"plan {e['plan'][:8]} on {plural(e.get('nodes', 0), 'node')} x "
                f"{plural(e.get('gpus_per_node', 1), 'GPU')}: "
                f"{plural(len(e['pipelines']), 'pipeline')} of {e['pipelines']} nodes, "
                f"{plural(sum(e.get('microbatches', [])), 'microbatch', 'microbatches')}")
        if e.get("predicted_step_ms"):
            text += f", predicted step {e['predicted_step_ms']:.1f} ms"
        if e.get("note"):
            text += f" ({e['note']})"
        return "\n".join([text] + [f"  {x}" for x in e.get("layout", [])])

    def _run_started(self, e: dict) -> str:
        # Said at once: the plan comes only after every worker imported torch and the agents
        # met (seconds; tens of them where many workers share a few cores).
        self.steps = e.get("steps", 0)
        nodes = plural(e.get("nodes", 0), "node")
        if e.get("launch") == "slurm-steps":  # (a job of a Slurm fleet: launch/slurm_steps.py)
            return (f"starting on {', '.join(e.get('on_nodes', []))} of this Slurm allocation, "
                    "one step per node: each agent starts its workers; each imports torch, then "
                    "they meet and plan (the plan is the next line)")
        if e.get("launch") == "slurm":
            where = f"{nodes} of Slurm job {e['job_id']}" if e.get("job_id") else nodes
            return (f"starting on {where}: one agent per node starts its workers; each imports "
                    "torch, then they meet and plan (the plan is the next line)")
        return (f"starting {nodes} x {plural(e.get('gpus_per_node', 1), 'worker')} on this "
                "machine: each worker imports torch, then they meet and plan (the plan is the "
                "next line; longer where many workers share few cores)")

    def _restored(self, e: dict) -> str:
        return (f"restored: step {e['step']} from {e.get('path', 'the checkpoint')} in "
                f"{e.get('seconds', 0):.2f} s")

    def _fault_injected(self, e: dict) -> str:
        return f"fault injected: {e['fault']} {e['node']} during step {e['step']} ({e['phase']})"

    def _node_killed(self, e: dict) -> str:
        sig = "SIG" + str(e.get("signal", "KILL")).removeprefix("SIG")
        return f"node {KILLED.get(sig, 'signalled')}: {e['node']} ({sig} from kill-node)"

    def _nodes_added(self, e: dict) -> str:
        self.grown = e["t"]
        return f"grow: {', '.join(e['nodes'])} started; joining"

    def _replacement_submitted(self, e: dict) -> str:
        self.grown = e["t"]
        return (f"replacement: Slurm job {e['job_id']} submitted for "
                f"{plural(e['nodes'], 'node')} ({e.get('reason', '')}); its agents join once it "
                "starts")

    def _replacements_ended(self, e: dict) -> str:
        return f"replacements ended with the run: {', '.join(e['job_ids'])} cancelled"

    def _nodes_released(self, e: dict) -> str:
        if not e.get("ok"):
            return f"could not give back {', '.join(e['nodes'])}: {e.get('detail', '')}"
        return (f"gave back {', '.join(e['nodes'])}: agreed away but still allocated, now "
                "released from the job")

    def _worker_restarting(self, e: dict) -> str:
        return (f"worker crashed: {e['source']}/{e['local_rank']} ({e.get('detail', '')}); "
                f"the node steps out, the job goes on without it, and its workers restart "
                f"(its crash {e.get('crashes', 1)}; one more than {e.get('restarts', 2)} takes "
                "the node out for good): it rejoins once they are ready")

    def _worker_stopped(self, e: dict) -> str:
        return (f"worker stopped: {e['source']}/{e['local_rank']} (pid {e['pid']}) was stopped "
                f"while {e['pinged_by']} waited on it; killed, it is restarted as after a crash")

    def _worker_rejoined(self, e: dict) -> str:
        return (f"worker rejoined: {e['source']} in generation {e['generation']}, its layers "
                f"from replicas ({mb(e.get('received_bytes') or 0)}), "
                f"{e.get('seconds', 0):.2f} s after the agreement")

    def _drain_requested(self, e: dict) -> str:
        return (f"drain asked: {e['node']} (by {e.get('by') or '?'}"
                + (", forced" if e.get("force") else "") + "); it leaves at a step boundary")

    def _request_ignored(self, e: dict) -> str:
        return (f"{e.get('request', '?')} request ignored: {e.get('path', '?')} "
                f"{e.get('reason', '')}")

    def _drain_agreed(self, e: dict) -> str:
        self.first_sign = e["t"]  # the job trained with the node until here
        verb = "leaves" if len(e["nodes"]) == 1 else "leave"
        return f"drain: {', '.join(e['nodes'])} {verb} after step {e['step']}"

    def _drain_refused(self, e: dict) -> str:
        return (f"drain of {', '.join(e['nodes'])} refused after step {e['step']}: "
                f"{e.get('reason', '')}" + ("; forced: the job stops with a checkpoint and is "
                                            "requeued without them" if e.get("force") else
                                            "; they stay (--force: stop with a checkpoint and "
                                            "requeue without them)"))

    def _failure_detected(self, e: dict) -> str:
        how = str(e.get("how", "")).replace("_", " ")
        if "drained" in how:  # (a BYE "early ... drained", or membership.py 4e's DRAINED)
            return ""  # told by the drain's lines
        return f"fault seen: {e['node']} lost ({how}, seen by {e.get('source', '?')})"

    def _agreement_reached(self, e: dict) -> str:
        lost, joined = e.get("lost") or [], e.get("joined") or []
        change = ([f"without {', '.join(lost)}"] if lost else []) + \
            ([f"{', '.join(joined)} {'swapped in' if lost else 'joined'}"] if joined else [])
        return (f"agreed: generation {e['gen']} on {plural(len(e.get('nodes', [])), 'node')}, "
                + (", ".join(change) or "no node lost (the step is retried)"))

    def _recovered(self, e: dict) -> str:
        self.recoveries += 1
        lost = e.get("lost") or []
        since = "the fault"
        if not lost and e.get("joined") and self.grown is not None:
            # a grow's round aborts the step in flight: its step_failed events are not the cause
            t0, since = self.grown, "the grow"
        elif self.first_sign is not None:
            t0 = self.first_sign
        else:
            t0 = e["t"] - e.get("seconds", 0.0)
        self.first_sign = self.grown = None
        plan = self.plans.get((e.get("attempt", 0), e.get("generation", 0)), {})
        shape = f" (pipelines of {plan['pipelines']} nodes)" if plan.get("pipelines") else ""
        if e.get("drained"):
            since = "the step boundary"
            what = (f"{', '.join(e['drained'])} drained; step {e['step']} is the first without "
                    "(nothing replayed)")
        elif self.steps and e["step"] > self.steps:  # lost after the last step's commit
            what = f"lost {', '.join(lost) or 'no node'} after the last step; the end agreed"
        elif lost or e.get("joined"):
            what = ", ".join(([f"lost {', '.join(lost)}"] if lost else []) +
                             [f"{n} {'swapped in' if lost else 'joined'}"
                              for n in e.get("joined") or []])
            what += f"; step {e['step']} replayed"
        else:
            what = f"step {e['step']} retried in place"
        moved = e.get("bytes_moved", 0)
        return (f"recovered: {what} on plan {str(e.get('plan', ''))[:8]}{shape} "
                f"{e['t'] - t0:.2f} s after {since}"
                + (f"; {mb(moved)} of layer state moved" if moved else "")
                + (f" ({e['rounds']} rounds)" if e.get("rounds", 1) > 1 else ""))

    def _worker_exited(self, e: dict) -> str:
        if e.get("done") is None or e.get("code") == e.get("done") or e.get("stopped"):
            return ""
        code = e.get("code")
        how = f"code {code}"
        if isinstance(code, int) and code < 0:
            try:
                how = signal.Signals(-code).name
            except ValueError:
                how = f"signal {-code}"
        return (f"warning: worker {e.get('local_rank')} of {e.get('source', '?')} (pid "
                f"{e.get('pid')}) finished its work ({e['done']}) but exited with {how}; see "
                "its node's log")

    def _fenced(self, e: dict) -> str:
        if e.get("code") == 0:  # a spare, or a node still rejoining: the job ended without it
            return f"{e.get('source', '?')} ends with the job ({e.get('reason', '')})"
        return f"fenced: {e.get('source', '?')} stops ({e.get('reason', '')})"

    def _checkpoint_saved(self, e: dict) -> str:
        return (f"checkpoint: step {e['step']} written ({mb(e.get('bytes', 0))}, "
                f"{e.get('seconds', 0):.2f} s in the background)")

    def _stopping(self, e: dict) -> str:
        return f"stopping for a requeue after step {e['step']}: {e.get('reason', '')}"

    def _fallback(self, e: dict) -> str:
        self.first_sign = None
        step = e.get("resume_from")
        return (f"fell back: {e.get('reason', '')}; the job resumes from "
                + (f"step {step}" if step else "the start (no checkpoint yet)"))

    def _requeued(self, e: dict) -> str:
        self.requeues += 1
        alive = e.get("alive") or []
        return (f"requeued: attempt {e['next_attempt']} on {plural(e['nodes'], 'node')}"
                + (f" (alive: {', '.join(alive)})" if alive else "")
                + f": {e.get('reason', 'exit 75')}")

    def _run_finished(self, e: dict) -> str:
        # samples_per_s (oobleck_hpc/train.py): the samples rank 0 committed in this attempt
        # over wall_s, its training loop -- from the start of its first step (that step's
        # warm-up included) to the final parameters written; the start-up before it is not.
        attempt = e.get("attempt", 0)
        loop = f"attempt {attempt}'s training loop" if attempt else "the training loop"
        wall = e.get("wall_s", 0.0)
        startup = ""
        if attempt in self.began and "t" in e:
            before = e["t"] - wall - self.began[attempt]
            startup = f", the {before:.1f} s of start-up before it not"
        extra = [plural(self.recoveries, "recovery", "recoveries")] if self.recoveries else []
        if self.requeues:
            extra.append(plural(self.requeues, "requeue"))
        return (f"done: {e['steps']} steps of {e.get('model', 'the model')}; loss "
                f"{e.get('first_loss', float('nan')):.4f} -> "
                f"{e.get('last_loss', float('nan')):.4f}; {e.get('samples_per_s', 0):.1f} "
                f"samples/s over the {wall:.1f} s of {loop} (its first step's warm-up "
                f"included{startup}; `oobleck-hpc report` counts the whole run)"
                + "".join(f"; {x}" for x in extra))

    def _run_ended(self, e: dict) -> str:
        """The launcher's verdict (oobleck_hpc/records/runs.py), told when the run did not finish (a
        finished run's `done:` line says it)."""
        if e.get("finished"):
            return ""
        return (f"{e.get('outcome', 'not finished')} (exit {e.get('code')}: "
                f"{e.get('reason', '')})")


_RENDER: dict[str, Callable[[Story, dict], str]] = {
    ev.PLAN_CHOSEN: Story._plan_chosen,
    ev.RUN_STARTED: Story._run_started,
    ev.RESTORED: Story._restored,
    ev.FAULT_INJECTED: Story._fault_injected,
    ev.NODE_KILLED: Story._node_killed,
    ev.NODES_ADDED: Story._nodes_added,
    ev.REPLACEMENT_SUBMITTED: Story._replacement_submitted,
    ev.REPLACEMENTS_ENDED: Story._replacements_ended,
    ev.NODES_RELEASED: Story._nodes_released,
    ev.WORKER_RESTARTING: Story._worker_restarting,
    ev.WORKER_STOPPED: Story._worker_stopped,
    ev.WORKER_REJOINED: Story._worker_rejoined,
    ev.DRAIN_REQUESTED: Story._drain_requested,
    ev.REQUEST_IGNORED: Story._request_ignored,
    ev.DRAIN_AGREED: Story._drain_agreed,
    ev.DRAIN_REFUSED: Story._drain_refused,
    ev.FAILURE_DETECTED: Story._failure_detected,
    ev.AGREEMENT_REACHED: Story._agreement_reached,
    ev.RECOVERED: Story._recovered,
    ev.WORKER_EXITED: Story._worker_exited,
    ev.FENCED: Story._fenced,
    ev.CHECKPOINT_SAVED: Story._checkpoint_saved,
    ev.STOPPING: Story._stopping,
    ev.FALLBACK: Story._fallback,
    ev.REQUEUED: Story._requeued,
    ev.RUN_FINISHED: Story._run_finished,
    ev.RUN_ENDED: Story._run_ended,
}
"""The kinds the console tells, each with its line ("": nothing new to say)."""


def _once_key(e: dict) -> Any:
    """What makes an event new for the story: the same failure seen by many survivors, the same
    agreement reached by every agent, the same fallback on every rank are one line."""
    kind = e.get("kind")
    if kind == ev.FAILURE_DETECTED:
        return e.get("gen"), e.get("node")
    if kind == ev.AGREEMENT_REACHED:
        return e.get("gen")
    if kind in (ev.PLAN_CHOSEN, ev.RECOVERED):
        return e.get("generation")
    if kind in (ev.DRAIN_AGREED, ev.DRAIN_REFUSED):
        return e.get("step"), tuple(e.get("nodes", ()))
    if kind == ev.CHECKPOINT_SAVED:
        return e.get("step")
    if kind == ev.FENCED:
        return e.get("source"), e.get("gen")
    if kind in (ev.FALLBACK, ev.STOPPING, ev.RUN_FINISHED, ev.RESTORED):
        return None
    return e.get("t"), e.get("source")


class Tail:
    """The complete JSON lines appended to a file since the last `read()` (a line still being
    written is left for the next read; a file that does not exist yet reads as nothing)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.offset = 0

    def read(self) -> Iterator[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        for line in data[:end].split(b"\n")[:-1]:
            self.offset += len(line) + 1  # (per line: a reader that stops knows where it was)
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a torn line of a writer killed mid-write
            yield event


def tell(events: list[dict[str, Any]]) -> list[str]:
    """The whole story of a list of events (one run, file order)."""
    story = Story()
    return [line for e in events for line in story.feed(e)]
