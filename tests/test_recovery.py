"""In-place recovery end to end: real node agents, real workers (gloo, CPU), faults from the job file.

Each case is one local job (`LocalRun`: one agent per pretend node, 2 workers each) carrying its
faults; training must continue on the survivors, and the losses of every step and the final
parameters must equal ONE failure-free single-process reference of the same job (computed once
per session, `engine.Reference`), within 1e-5 relative. The model is built in float64 in the
workers (`model.dtype: float64`) and in the reference: in fp32 AdamW turns rounding noise of
near-zero gradients into visible parameter differences (tests/test_engine.py), in fp64 any
error in the replayed step, the re-split batch or the copied optimizer state shows at once.

Cases: one node killed in each window of the transactional step, and one lost in the last
step's vote; f = 2 nodes killed at once; the node that hosts the store and coordinates
generation 0 (node0) killed, while strangers knock on every store (issue 28); a node killed while the survivors reconfigure; a node hung (SIGSTOP)
in a step, and before a recovery's rendezvous; a node killed on the tiny Llama
example (examples/llama-tiny-local.yaml: a Hugging Face model, tied embeddings); growth: a spare swapped in by a loss's recovery, a second loss, and a node grown
back by `oobleck-hpc grow` (one long run). Exceeding the guarantee raises the typed error at once (a unit test of the driver:
with gpt-tiny's n0 = 1 no local job can lose every replica and keep a quorum). Every job runs
under a hard timeout and its processes are killed by pid at the end.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from oobleck_hpc.config import job_from_dict
from oobleck_hpc.records.events import read_events
from helpers import past_start_retries, run_digest, start_retries

ROOT = Path(__file__).resolve().parents[1]
STEPS = 5
TOL = 1e-5
SECRET = bytes(range(32))


def job_dict(run_dir: Path, nodes: int = 5, f: int = 1, faults=(), spares: int = 0,
             steps: int = STEPS, lease_s: float = 3.0, straggler: str = "none",
             microbatches: int = 4, gpus: int = 2, microbatch_size: int = 2,
             model: dict | None = None, checkpoint_every: int = 0) -> dict:
    return {
        "name": "recovery-test",
        "model": model or {"name": "gpt-tiny", "seed": 0, "dtype": "float64"},
        "train": {"steps": steps, "microbatch_size": microbatch_size, "global_microbatches": microbatches,
                  "lr": 1e-3,
                  "warmup_steps": 2, "log_every": 1, "save_final_params": True},
        "cluster": {"launch": "local", "nodes": nodes, "gpus_per_node": gpus, "device": "cpu",
                    "spares": spares},
        "fault_tolerance": {"f": f, "collective_timeout_s": 10.0, "heartbeat_s": 0.5,
                            "lease_s": lease_s, "straggler": straggler,
                            "straggler_window_s": 0.0},
        # (no measured profile for 1 worker per node: the analytic one, as the Slurm tests do)
        "profile": {"library": str(ROOT / "profiles")} if gpus == 2 else
                   {"library": str(run_dir / "no-profiles"), "analytic": True, "device": "A40"},
        "run_dir": str(run_dir),
        "faults": list(faults),
        **({"checkpoint": {"dir": str(run_dir / "ckpt"), "every_steps": checkpoint_every}}
           if checkpoint_every else {}),
    }


@pytest.fixture(scope="module")
def reference():
    """The failure-free run: the same job in one process, fp64 (losses, final parameters)."""
    from oobleck_hpc.engine import reference_run

    return reference_run(job_from_dict(job_dict(Path("/nonexistent"))), STEPS)


def run_job(tmp_path: Path, during=None, **kw) -> tuple[int, list[dict], Path]:
    """Run the job; `during(run_dir, stop)`: what a thread does meanwhile (until `stop` is set:
    the run ended)."""
    import threading

    from oobleck_hpc.launch.local import LocalRun

    run_dir = tmp_path / "run"
    data = job_dict(run_dir, **kw)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    job = job_from_dict(data, str(path))
    metrics = run_dir / "metrics.jsonl"
    run = LocalRun(job, path, run_dir, metrics, kill_grace_s=10.0)
    stop = threading.Event()
    helper = threading.Thread(target=during, args=(run_dir, stop), daemon=True) if during else None
    if helper is not None:
        helper.start()
    try:
        code = run.run()
    except BaseException:  # pytest-timeout's, above all: say where the run stood
        print(run_digest(run_dir))
        raise
    finally:
        stop.set()
        if helper is not None:
            helper.join(timeout=30)
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return code, rows, run_dir


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-30))


def check_equal_to_reference(code: int, rows: list[dict], run_dir: Path, reference,
                             lost: set[str], last_on_new_plan: bool = True) -> list[dict]:
    ref_losses, ref_params = reference
    logs = run_dir / "logs"
    assert code == 0, f"job exit code {code} (logs: {logs})"
    assert [r["step"] for r in rows] == list(range(1, len(ref_losses) + 1)), rows
    np.testing.assert_allclose([r["loss"] for r in rows], ref_losses, rtol=TOL)
    for layer, params in ref_params.items():
        got = torch.load(run_dir / "final" / f"layer-{layer}.pt")
        for name, value in params.items():
            assert rel(got[name], value) <= TOL, f"layer {layer} {name}: {rel(got[name], value)}"
    events = read_events(run_dir / "events.jsonl")
    recovered = [e for e in events if e["kind"] == "recovered"]
    assert recovered, f"no recovery happened (events: {run_dir / 'events.jsonl'})"
    detected = [(e["source"], e["node"], e["how"], e.get("attempt"))
                for e in events if e["kind"] == "failure_detected"]
    probed = [(e["source"], e["silent"], e["timeout_s"], e["answered_s"])
              for e in events if e["kind"] == "stall_probed"]
    assert set(recovered[-1]["lost"]) == lost, \
        f"failures detected (source, node, how, attempt): {detected}; stall probes: {probed}"
    if last_on_new_plan:
        assert rows[-1]["generation"] >= 1
    return events


# gpt-tiny on 5 nodes, global batch 4: pipelines of [2, 1, 1, 1] nodes (node0+node1, node2,
# node3, node4); losing any node changes layouts, so layer state moves in every case.
# The windows of the transactional step: compute, inside the final all-reduce (some ranks may
# complete it), during the commit vote (some ranks may see it complete and commit), and after
# the metrics writer (node0: rank 0) applied the update but before it recorded the step.
PHASES = [("forward", 3, 2), ("backward", 1, 3), ("reduce", 2, 3), ("vote", 4, 4),
          ("commit", 0, 4)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("phase,node,step", PHASES, ids=[p[0] for p in PHASES])
def test_kill_one_node_in_each_phase(tmp_path, reference, phase, node, step):
    code, rows, run_dir = run_job(tmp_path, faults=[
        {"node": node, "step": step, "phase": phase, "kind": "kill"}])
    events = check_equal_to_reference(code, rows, run_dir, reference, {f"node{node}"})
    kinds = {e["kind"] for e in events}
    assert {"fault_injected", "step_failed", "membership_agreed", "plan_chosen",
            "groups_rebuilt", "state_transferred", "recovered"} <= kinds
    moved = sum(e["received_bytes"] for e in events if e["kind"] == "state_transferred")
    assert moved > 0, "no layer state was transferred"


# The tiny Llama example (issue 29): its own model section, in fp64; long enough that the
# survivors train for several leases (3 s) after the kill (its 60 steps, as the demo's job).
LLAMA_STEPS = 60
LLAMA = {**yaml.safe_load((ROOT / "examples/llama-tiny-local.yaml").read_text())["model"],
         "hf": str(ROOT / "examples/models/tiny-llama"), "dtype": "float64"}


@pytest.fixture(scope="module")
def llama_reference():
    pytest.importorskip("transformers")
    from oobleck_hpc.engine import reference_run

    data = job_dict(Path("/nonexistent"), model=LLAMA, steps=LLAMA_STEPS)
    return reference_run(job_from_dict(data), LLAMA_STEPS)


@pytest.mark.timeout(150, func_only=True)  # (the fp64 reference is built before it: 60 steps)
def test_kill_a_node_of_the_tiny_llama_example(tmp_path, llama_reference):
    """node3 of the example's [2, 1, 1, 1]-node plan killed in a backward pass: recovered in
    place, every loss and the final parameters (the tied embedding included) equal the
    failure-free fp64 reference."""
    code, rows, run_dir = run_job(tmp_path, model=LLAMA, steps=LLAMA_STEPS, faults=[
        {"node": 3, "step": 10, "phase": "backward", "kind": "kill"}])
    events = check_equal_to_reference(code, rows, run_dir, llama_reference, {"node3"})
    assert [e["pipelines"] for e in events if e["kind"] == "plan_chosen"][0] == [2, 1, 1, 1]
    worst = max(rel(torch.load(run_dir / "final" / f"layer-{layer}.pt")[name], value)
                for layer, params in llama_reference[1].items() for name, value in params.items())
    recovered = [e for e in events if e["kind"] == "recovered"][-1]
    print(f"tiny Llama, kill node3: recovered in {recovered['seconds']} s, final parameters "
          f"within {worst:.1e} of the reference")


# Growth: a node that joins must be up (torch imported) before it trains -- a spare before it
# asks to join, a grown node while the members wait in the round that adds it -- which takes
# seconds while the members train 10-20 steps a second here. So this run is long (it ends
# ~5x the time a join takes after its last growth here), and its faults come from the test at
# the moment it needs them, never from a step number.
LONG_STEPS = 600


@pytest.mark.timeout(600)
def test_a_spare_swapped_in_then_a_loss_then_a_node_grown_back(tmp_path):
    """cluster.spares: 1 -- 5 nodes and node5 idle, which asks to join once its workers are up;
    the members keep it waiting (the job has all its nodes).
    1. node2 is killed: the loss's own round swaps node5 in (generation 1), node5 receives all
       of its layers (weights and AdamW state) and the step is replayed on 5 nodes.
    2. node3 is killed: no spare left, the job goes on on 4 nodes (generation 2). Two losses
       over the run with f = 1, never more than f at once: no fallback.
    3. `oobleck-hpc grow RUN_DIR --nodes 1` (from another process, as a user would) starts
       node6, which was in no roster the members started with: they learn its address from
       its first message, and a round that loses nobody adds it at a step boundary
       (generation 3): the step in flight commits, none is replayed.
    The run ends on 5 nodes equal to the failure-free fp64 reference."""
    import subprocess
    import sys

    from oobleck_hpc.engine import reference_run
    from oobleck_hpc.launch.local import kill_node
    from oobleck_hpc.records.story import Tail

    said: list[str] = []

    def act(run_dir: Path, stop) -> None:
        events: list[dict] = []
        tail = Tail(run_dir / "events.jsonl")  # each poll parses only what was appended

        def seen(done) -> bool:  # poll the run's events until done(events), or the run ends
            while not stop.wait(0.05):
                events.extend(tail.read())
                if done(events):
                    return True
            return False

        def recovered(node: str):  # (by the node lost: a retry round may precede, helpers.py)
            return lambda evs: any(e["kind"] == "recovered" and node in e["lost"] for e in evs)

        metrics = run_dir / "metrics.jsonl"
        if not seen(lambda evs: len({e["source"] for e in evs if e["kind"] == "join_request"})
                    == 5 and metrics.exists() and metrics.read_text().count("\n") >= 2):
            return  # every member heard the spare, and training is under way
        kill_node(run_dir, "node2")
        if not seen(recovered("node2")):
            return
        kill_node(run_dir, "node3")
        if seen(recovered("node3")):
            out = subprocess.run([sys.executable, "-m", "oobleck_hpc", "grow", str(run_dir),
                                  "--nodes", "1"], capture_output=True, text=True, timeout=60)
            said.append(out.stdout + out.stderr)

    # A lease of 10 s rides out a stall of the machine: seen on the 2-core VM at the grow, the
    # busiest moment of the suite (10 training workers, 2 more importing torch), a step took
    # 4.7 s instead of 0.08 and agents went unscheduled for over 3 s; with a 3 s lease three
    # healthy members were excluded and the job fell back. Crashes are still seen at once
    # (the connection drops), so the test checks the same recoveries.
    code, rows, run_dir = run_job(tmp_path, spares=1, steps=LONG_STEPS, during=act, lease_s=10.0)
    if not said:  # the run ended before the two recoveries: say how, not just that
        raise AssertionError(f"no grow: exit {code}; " + "; ".join(
            f"{e['source']} {e['kind']} {e.get('gen', e.get('generation', ''))}"
            for e in read_events(run_dir / "events.jsonl") if e["kind"] in (
                "agreement_reached", "recovered", "fallback", "fenced", "run_finished")))
    assert "started node6" in said[0], said
    reference = reference_run(job_from_dict(job_dict(Path("/nonexistent"), steps=LONG_STEPS)),
                              LONG_STEPS)
    events = check_equal_to_reference(code, rows, run_dir, reference, set())
    retried = {e["generation"] for e in start_retries(events) if e["kind"] == "recovered"}
    agreed = {e["gen"]: (e["lost"], e["joined"]) for e in events
              if e["kind"] == "agreement_reached" and e["gen"] not in retried}
    r = len(retried)  # generations 1..r: a loaded machine's start (helpers.py)
    assert agreed == {r + 1: (["node2"], ["node5"]), r + 2: (["node3"], []),
                      r + 3: ([], ["node6"])}, agreed
    # node6 joined at a step boundary (membership.py, 7b): the step its round followed
    # committed; only the next one may have failed at ranks that had begun it before they heard
    # of the round (seen under load: node4 opened the round at its boundary, node0 and node5
    # were in that step's backward), and it is the step the join starts from.
    (join,) = [e for e in events if e["kind"] == "recovered" and e["joined"] == ["node6"]]
    assert all(e["step"] == join["step"] for e in events
               if e["kind"] == "step_failed" and e["generation"] == r + 2), join
    assert not [e for e in events if e["kind"] == "fallback"]
    assert any(e["kind"] == "nodes_added" and e["nodes"] == ["node6"] for e in events)
    assert {e["source"] for e in events if e["kind"] == "peer_added"} == {
        "node0", "node1", "node4", "node5"}  # the members of generation 2 (node6: grown)
    assert {e["source"] for e in events if e["kind"] == "node_joined"} == {
        "node5/0", "node5/1", "node6/0", "node6/1"}
    for node in ("node5", "node6"):
        assert sum(e["received_bytes"] for e in events if e["kind"] == "state_transferred"
                   and e["source"].startswith(f"{node}/")) > 0, f"{node} received no layers"
    (finished,) = [e for e in events if e["kind"] == "run_finished"]
    assert finished["nodes"] == 5
    assert rows[-1]["generation"] == r + 3


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", ["kill", "crash"])
def test_a_failure_in_the_vote_of_the_last_step(tmp_path, reference, kind):
    """A node lost in the last step's vote: the ranks whose vote completed end the run, the
    others settle the step with them and roll it forward -- then there is nothing left to run
    (chaos seed 7007, trial 76: they ran a step past the last and waited on the others at the
    end; rounds without a loss followed for ever). Which ranks see the vote complete depends
    on timing; either way the run ends exact. A crashed worker there costs its node the same
    way (it steps out; the run ends before it could rejoin)."""
    code, rows, run_dir = run_job(tmp_path, faults=[
        {"node": 2, "step": STEPS, "phase": "vote", "kind": kind}])
    # the last step may be committed on the first plan (by the ranks whose vote completed)
    check_equal_to_reference(code, rows, run_dir, reference, {"node2"}, last_on_new_plan=False)


@pytest.mark.timeout(150)
def test_kill_two_nodes_at_once(tmp_path, reference):
    code, rows, run_dir = run_job(tmp_path, f=2, faults=[
        {"node": 1, "step": 3, "phase": "backward", "kind": "kill"},
        {"node": 3, "step": 3, "phase": "backward", "kind": "kill"}])
    check_equal_to_reference(code, rows, run_dir, reference, {"node1", "node3"})


class StoreStranger:
    """Strangers on the run's stores (issue 28, "store clients"): from the moment a generation's
    store is up (generation 0's port from the roster, later ones from the agents' agreement
    events) until the run ends, connections that speak the store's protocol sealed with another
    run's secret (a stale worker of an earlier run on a reused port), garbage, and torch's own
    client's first bytes. `refused`: generations whose store closed such a connection without
    an answer; `answered`: (generation, what was sent) the store answered -- none may be."""

    WRONG = bytes(range(32))

    def __init__(self):
        self.refused: set[int] = set()
        self.answered: list[tuple[int, bytes]] = []

    def payloads(self, gen: int) -> list[bytes]:
        from oobleck_hpc.control.auth import hello
        from oobleck_hpc.recovery.rendezvous import store_prefix
        from oobleck_hpc.control.wire import frame

        body, sealer, _ = hello(self.WRONG, "rank", store_prefix(self.WRONG, gen), "", 0)
        return [frame(sealer.seal(body)), b"\x00garbage" * 50, b"\x0f" + b"\0" * 7]

    def __call__(self, run_dir: Path, stop) -> None:
        import socket
        import time

        while not stop.is_set():
            targets = {}
            if (run_dir / "roster.json").exists():
                roster = json.loads((run_dir / "roster.json").read_text())
                targets[0] = f"127.0.0.1:{roster['store_port']}"
            if (run_dir / "events.jsonl").exists():
                targets.update({e["gen"]: e["store_addr"] for e in read_events(
                    run_dir / "events.jsonl") if e["kind"] == "agreement_reached"})
            for gen, addr in targets.items():
                host, port = addr.rsplit(":", 1)
                for payload in self.payloads(gen):
                    try:
                        with socket.create_connection((host, int(port)), timeout=3.0) as sock:
                            sock.sendall(payload)
                            if sock.recv(1 << 16):
                                self.answered.append((gen, payload[:40]))
                            else:
                                self.refused.add(gen)
                    except OSError:
                        pass  # not up yet, or gone already
            time.sleep(0.02)


@pytest.mark.timeout(150)
def test_kill_store_host_and_coordinator(tmp_path, reference):
    """node0 hosts generation 0's store and is the first node of the roster (rank 0).
    Strangers on the stores meanwhile (`StoreStranger`) get no answer: a store serves the run's
    own ranks only (recovery/store.py)."""
    stranger = StoreStranger()
    code, rows, run_dir = run_job(tmp_path, during=stranger, faults=[
        {"node": 0, "step": 3, "phase": "forward", "kind": "kill"}])
    events = check_equal_to_reference(code, rows, run_dir, reference, {"node0"})
    agreed = [e for e in events if e["kind"] == "membership_agreed"]
    assert agreed and not agreed[-1]["store"].endswith(":0")
    assert stranger.answered == []
    # Generation 0's store is up from the start; a later one is reached only when the
    # stranger's poll of the events wins against the run's own rendezvous and its 2 last steps
    # (1 run in 6 here it did not): required is generation 0's.
    assert 0 in stranger.refused, stranger.refused


@pytest.mark.timeout(150)
def test_kill_during_reconfiguration(tmp_path, reference):
    code, rows, run_dir = run_job(tmp_path, f=2, faults=[
        {"node": 1, "step": 3, "phase": "forward", "kind": "kill"},
        {"node": 3, "step": 3, "phase": "reconfiguration", "kind": "kill"}])
    events = check_equal_to_reference(code, rows, run_dir, reference, {"node1", "node3"})
    assert any(e["kind"] == "fault_injected" and e["phase"] == "reconfiguration" for e in events)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("node, where", [(3, "the rendezvous"), (0, "the store's connect")])
def test_a_node_hung_before_the_rendezvous_is_found_by_the_ranks_that_wait_for_it(
        tmp_path, reference, node, where):
    """Issue 31: node1 is killed, and node3 hangs (SIGSTOP) after the survivors agreed, right
    before their rendezvous: no round is open, no collective runs. The ranks waiting in the
    rendezvous name node3 once they waited a stall's threshold (recovery/stall.py, `watched`),
    its agent does not answer their agents' pings, and it is lost well before its 3 s lease
    would expire (chaos seed 5202, trial 33: 3.45 s). The same for node0, the host of the
    generation's store, whom the others wait for to connect to it (chaos seed 5205, trial 24:
    3.31 s)."""
    code, rows, run_dir = run_job(tmp_path, f=2, faults=[
        {"node": 1, "step": 3, "phase": "forward", "kind": "kill"},
        {"node": node, "step": 3, "phase": "reconfiguration", "kind": "hang"}])
    hung_node = f"node{node}"
    events = check_equal_to_reference(code, rows, run_dir, reference, {"node1", hung_node})
    stores = {e["store_node"] for e in events if e["kind"] == "agreement_reached"
              and e["lost"] == ["node1"]}
    assert (hung_node in stores) == (node == 0), stores
    # (the node's other worker may say so too, once the run's end resumes it to kill it)
    hung = min(e["t"] for e in events if e["kind"] == "fault_injected" and e["fault"] == "hang")
    removed = min(e["t"] for e in events if e["kind"] == "agreement_reached"
                  and hung_node in e["lost"])
    late = [e for e in events if e["kind"] == "worker_report" and where in e["detail"]]
    assert late and all(hung_node in e["suspects"] for e in late), late
    how = {e["how"] for e in events if e["kind"] == "failure_detected" and e["node"] == hung_node}
    assert all("stall_probe_unanswered" in h for h in how), how
    probe_s = min(e["timeout_s"] for e in events if e["kind"] == "stall_probed"
                  and hung_node in e["silent"] and not e["unconfirmed"])
    print(f"\n[figures] hang before {where} -> node removed after {removed - hung:.3f} s, "
          f"the probe's deadline {probe_s:.2f} s")
    assert removed - hung < min(probe_s + 1.45, 3.0), (removed - hung, probe_s)


@pytest.mark.timeout(150)
def test_a_drained_node_leaves_at_a_step_boundary_with_nothing_replayed(tmp_path, reference):
    """Issue 15: node3 is asked to drain during step 2's forward (the `drain` fault writes the
    request `oobleck-hpc drain` writes). It finishes the step, every rank learns the drain from
    a commit vote, node3 leaves right after that commit and its agent exits 0; the others
    reconfigure from the committed step: no step fails, none is rolled forward or replayed."""
    code, rows, run_dir = run_job(tmp_path, faults=[
        {"node": 3, "step": 2, "phase": "forward", "kind": "drain"}])
    events = check_equal_to_reference(code, rows, run_dir, reference, {"node3"})
    failed = [e for e in past_start_retries(events)  # (a loaded machine's start: helpers.py)
              if e["kind"] in ("step_failed", "rolled_forward")]
    assert not failed, failed
    agreed = [e for e in events if e["kind"] == "drain_agreed"]
    assert len({(e["step"], tuple(e["nodes"])) for e in agreed}) == 1, agreed  # every teller
    assert agreed[0]["nodes"] == ["node3"], agreed
    recovered = [e for e in events if e["kind"] == "recovered"]
    assert recovered[-1]["drained"] == ["node3"]
    assert recovered[-1]["step"] == agreed[0]["step"] + 1  # the next step: nothing replayed
    exits = [e for e in events if e["kind"] == "agent_exit" and e["source"] == "node3"]
    assert exits and exits[-1]["code"] == 0, exits
    assert len({r["step"] for r in rows}) == len(rows)


CRASH_STEPS = 300
"""Long enough for a crashed node's new workers to start (import torch, build, plan) and rejoin
while 8 processes train on 2 cores: 9-20 s, i.e. 100-200 of this job's ~0.1 s steps. (It once
slowed node0 4x with the `slow` fault instead, to leave the new processes CPU time; under a
CI run's load that fault's stops stretched steps to 2-10 s, collectives timed out, and 40 steps
outlasted the test's timeout.)"""
CRASH_LEASE_S = 10.0
"""The crash tests' lease: a crashed or stopped worker is found by its agent and the stall probe,
never by a lease, and a 3 s lease evicted a healthy node at the start of one (node4 of 5 silent
to both its observers for 3.03 s while ten workers built their engines, the test run alone on
the 2-core machine; control/topology.py, `Detector.paused`, now excuses an observer's own
pause, the likely cause). With a longer lease such a start costs nothing
(test_a_spare_swapped_in...: the same)."""


@pytest.fixture(scope="module")
def crash_reference():
    """The failure-free run of the crash tests' CRASH_STEPS (as `reference`): built once for both,
    outside their timeouts (12 s alone on 2 cores; beside another job's ten workers it took
    over 200 s, and it ran inside the test's 240 s)."""
    from oobleck_hpc.engine import reference_run

    return reference_run(job_from_dict(job_dict(Path("/nonexistent"), steps=CRASH_STEPS)),
                         CRASH_STEPS)


@pytest.mark.timeout(240, func_only=True)  # (crash_reference is built before it)
def test_a_crashed_worker_steps_its_node_out_at_once_and_the_node_rejoins(tmp_path,
                                                                          crash_reference):
    """Issue 31: one worker of node2 is SIGKILLed in step 3's backward while node2's agent and
    other worker live. node2 steps out at once -- the others recover without it, as after a
    kill, instead of waiting for a new process -- its workers restart, and it rejoins at a
    later step boundary, receiving its layers from replicas. The run ends exact on all 5
    nodes; the third crash of a worker still takes its node out (test_elastic_control.py)."""
    code, rows, run_dir = run_job(tmp_path, steps=CRASH_STEPS, lease_s=CRASH_LEASE_S, faults=[
        {"node": 2, "step": 3, "phase": "backward", "kind": "crash"}], checkpoint_every=25)
    events = check_equal_to_reference(code, rows, run_dir, crash_reference, set())
    kinds = [e["kind"] for e in events]
    assert "worker_failed" not in kinds and "node_failed" not in kinds, kinds
    (crash,) = [e for e in events if e["kind"] == "worker_restarting"]
    past = past_start_retries(events)  # (a loaded machine's start: helpers.py)
    recovered = [e for e in past if e["kind"] == "recovered"]
    assert [(e["lost"], e["joined"]) for e in recovered] == [(["node2"], []), ([], ["node2"])]
    out, back = recovered
    assert out["step"] == 3 and back["step"] > 4, recovered
    # It rejoined at a step boundary (membership.py, 7b): the step whose vote completed
    # committed, and only the next one, begun by some ranks and kept by none, is redone
    # (rounds.py, `admit`). A rank in that step may see it fail (a peer that heard of the round
    # first tore its groups down: seen once in CI) before its own notice arrives; the round
    # explains the error (plane.py, `probe`). The crash's round failed step 3 everywhere, and
    # step 2's commit vote at a rank that had not yet received its result (seen in CI: node4,
    # while the others had begun step 3; `reconcile` commits it, as the vote completed). No
    # other step failed.
    failed = [e for e in past if e["kind"] == "step_failed"]
    by_crash = [e for e in failed if e["generation"] < out["generation"]]
    assert all(e["step"] == 3 or (e["step"] == 2 and e["phase"] == "vote")
               for e in by_crash), (by_crash, out)
    assert all(e["step"] == back["step"] and e["generation"] < back["generation"]
               for e in failed if e not in by_crash), (failed, recovered)
    rejoined = {e["source"] for e in events if e["kind"] == "worker_rejoined"}
    assert rejoined == {"node2/0", "node2/1"}, rejoined
    # The rejoined workers write their part of the checkpoints under their ranks in the new plan
    # (Resume._save): checkpoints after the rejoin are published.
    saved = [e["step"] for e in events if e["kind"] == "checkpoint_saved"]
    assert saved and saved[-1] > back["step"], (saved, back["step"])
    assert [e for e in events if e["kind"] == "plan_chosen"][-1]["nodes"] == 5
    print(f"\n[figures] crash -> first committed step {out['t'] - crash['t']:.3f} s "
          f"({out['seconds']:.3f} s from the failure), node back in the plan "
          f"{back['t'] - crash['t']:.1f} s after the crash")


@pytest.mark.timeout(240, func_only=True)  # (crash_reference is built before it)
def test_a_stopped_worker_is_killed_when_a_peer_waits_on_it_and_its_node_rejoins(tmp_path,
                                                                                 crash_reference):
    """Issue 31: one worker of node2 is stopped (SIGSTOP) mid-run while its agent runs on. Its
    peers' waits stall and their agents ping node2 (recovery/stall.py), whose agent answers --
    it is not hung -- and finds its worker stopped: it kills it (`worker_stopped`), and the
    node steps out and rejoins as after a crash. The run ends exact on all 5 nodes, long
    before the collective timeout and its retry rounds would have ended it."""
    import os
    import signal

    from oobleck_hpc.records.story import Tail

    stopped: list[float] = []

    def act(run_dir: Path, stop) -> None:
        tail, events = Tail(run_dir / "events.jsonl"), []
        metrics = run_dir / "metrics.jsonl"
        while not stop.wait(0.05):
            events.extend(tail.read())
            if metrics.exists() and metrics.read_text().count("\n") >= 5:
                pid = next(e["worker_pids"][1] for e in events
                           if e["kind"] == "agent_started" and e["source"] == "node2")
                stopped.append(time.time())
                os.kill(pid, signal.SIGSTOP)
                return

    code, rows, run_dir = run_job(tmp_path, steps=CRASH_STEPS, lease_s=CRASH_LEASE_S,
                                  during=act)
    assert stopped, "the run ended before step 5"
    events = check_equal_to_reference(code, rows, run_dir, crash_reference, set())
    (found,) = [e for e in events if e["kind"] == "worker_stopped"]
    assert (found["source"], found["local_rank"]) == ("node2", 1), found
    recovered = [e for e in past_start_retries(events) if e["kind"] == "recovered"]
    assert [(e["lost"], e["joined"]) for e in recovered] == [(["node2"], []), ([], ["node2"])]
    assert [e for e in events if e["kind"] == "plan_chosen"][-1]["nodes"] == 5
    print(f"\n[figures] stopped worker -> killed {found['t'] - stopped[0]:.3f} s, first step "
          f"without its node {recovered[0]['t'] - stopped[0]:.3f} s, node back in the plan "
          f"{recovered[1]['t'] - stopped[0]:.1f} s after the stop")


@pytest.mark.timeout(150)
def test_a_slowed_node_gets_fewer_microbatches_and_the_run_stays_exact(tmp_path):
    """Issue 15: 4 nodes x 1 worker (two 2-node pipelines, 8 microbatches); node1's worker is
    slowed 4x from step 8 (the slow fault: a stop/continue duty cycle), once every node's
    baseline is taken (steps 2-6). The vote's compute figures find it within a window of 5
    steps; `straggler: rebalance` re-splits the batch (node1's pipeline gets fewer
    microbatches), every rank switches to that plan after the same step with nothing moved,
    and the run ends equal to the fp64 reference. Microbatches of 16: the fault stops the worker
    every 20 ms (DutyCycle.PERIOD_S) for what it owes, so a rank's compute per step must be well
    over that for every step to be slowed alike -- with microbatches of 2 (~1 ms per
    computation) a stop landed in a computation or in a wait by chance, and the window's median
    stayed under the ratio for up to 4 steps more (found at step 15 once in 4 runs)."""
    from oobleck_hpc.engine import reference_run

    steps = 20
    extra = {"nodes": 4, "steps": steps, "microbatches": 8, "gpus": 1, "microbatch_size": 16}
    ref = reference_run(job_from_dict(job_dict(Path("/nonexistent"), **extra)), steps)
    code, rows, run_dir = run_job(tmp_path, straggler="rebalance", **extra, faults=[
        {"node": 1, "step": 8, "phase": "forward", "kind": "slow", "factor": 4.0}])
    assert code == 0, run_dir
    np.testing.assert_allclose([r["loss"] for r in rows], ref[0], rtol=TOL)
    for layer, params in ref[1].items():
        got = torch.load(run_dir / "final" / f"layer-{layer}.pt")
        for name, value in params.items():
            assert rel(got[name], value) <= TOL, f"layer {layer} {name}"
    events = read_events(run_dir / "events.jsonl")
    acted = [e for e in events if e["kind"] == "straggler" and e["source"] == "node0/0"
             and e["action"] == "rebalance"]
    assert acted and acted[0]["node"] == "node1" and 10 <= acted[0]["step"] <= 8 + 5, acted
    assert len({r["plan"] for r in rows}) >= 2, rows  # the split changed mid-run
    assert not [e for e in past_start_retries(events)  # (a loaded start: helpers.py)
                if e["kind"] in ("step_failed", "recovered")]


@pytest.mark.timeout(150)
def test_hang_node(tmp_path, reference):
    """A node stopped (SIGSTOP) in a step's forward pass is found in band (recovery/stall.py:
    its peers' waits stall, their agents' pings go unanswered) and removed well before its
    3 s lease would expire, with nobody else lost; the run ends exact. The probe's deadline
    is 0.375 s (this lease's eighth) on a machine that runs its agents on time and longer on
    one that has left them unscheduled lately (control/stall_probe.py, `deadline`: 0.92 s once
    in CI, after the start's imports); the removal is bounded by the deadline the probe used."""
    code, rows, run_dir = run_job(tmp_path, faults=[
        {"node": 2, "step": 3, "phase": "forward", "kind": "hang"}])
    events = check_equal_to_reference(code, rows, run_dir, reference, {"node2"})
    fault = min(e["t"] for e in events if e["kind"] == "fault_injected")
    removed = min(e["t"] for e in events if e["kind"] == "agreement_reached"
                  and "node2" in e["lost"])
    how = {e["how"] for e in events if e["kind"] == "failure_detected"}
    probe_s = min(e["timeout_s"] for e in events if e["kind"] == "stall_probed"
                  and "node2" in e["silent"] and not e["unconfirmed"])
    print(f"\n[figures] hang -> node removed after {removed - fault:.3f} s, the probe's "
          f"deadline {probe_s:.2f} s ({how})")
    assert removed - fault < min(probe_s + 1.15, 3.0), (removed - fault, probe_s, how)
    assert all("stall_probe_unanswered" in h for h in how), how
    # Every agent's start lease (3 x lease_s: control/topology.py) ended once the start's ranks
    # were built, before the fault at step 3: a hang from then on meets lease_s.
    ended = {e["source"]: e["t"] for e in events if e["kind"] == "start_lease_ended"}
    assert sorted(ended) == sorted(e["source"] for e in events if e["kind"] == "agent_started")
    assert max(ended.values()) < fault, (ended, fault)


@pytest.mark.timeout(30)
def test_guarantee_exceeded_raises_at_once():
    """Fewer than n0 survivors (no replica left): recover() raises GuaranteeExceeded before any
    communication (the training loop then falls back to the last checkpoint)."""
    import time

    from oobleck_hpc.control.client import Membership
    from oobleck_hpc.recovery.driver import ElasticDriver
    from oobleck_hpc.engine import TrainState
    from oobleck_hpc.errors import GuaranteeExceeded

    job, profile, templates, plan = planned_job()
    nodes = plan.nodes

    class FakeClient:
        node, local_rank = "node0", 0
        reports: list = []

        def report_failure(self, kind, detail="", suspects=(), gen=None):
            self.reports.append((kind, list(suspects)))

        def wait_membership(self, after_gen=-1, timeout=None):
            # the agreed survivors: fewer than n0 = 1 nodes keep no replica at all
            return Membership(1, (), tuple(nodes), "node0", "127.0.0.1", 1)

        def exchange(self, key, value, timeout, gen=None, on_sent=None):
            return {"node0": [value]}  # the survivors' reconciliation: all at the same step

    class FakeEngine:
        state = TrainState()
        prepared = None

        def close(self):
            pass

    driver = ElasticDriver(job, None, profile, None, torch.device("cpu"), FakeClient(),
                           events=_NullEvents(), secret=SECRET)
    s = driver.state
    s.plan, s.templates, s.gen, s.engine = plan, templates, 0, FakeEngine()
    t0 = time.monotonic()
    with pytest.raises(GuaranteeExceeded):
        driver.recover(3, "forward", "peer died", None)
    assert time.monotonic() - t0 < 5
    assert FakeClient.reports == [("comm_error", [])]


@pytest.mark.timeout(30)
def test_a_recovery_that_rolls_the_last_step_forward_runs_no_further_step():
    """The last step's vote completed on some ranks (they end the run) and not here: the
    recovery settles it among the survivors and rolls it forward. Nothing is left to run:
    step() returns the rolled step (chaos seed 7007, trial 76: it ran a step past the last,
    whose collectives waited on the ranks at the end; rounds without a loss followed for
    ever). Deterministic here; `test_crash_in_the_vote_of_the_last_step` runs the real race."""
    from oobleck_hpc.recovery.driver import ElasticDriver
    from oobleck_hpc.control.membership import Superseded
    from oobleck_hpc.engine import StepResult, TrainState
    from oobleck_hpc.profiling import resolve_profile

    job = job_from_dict(job_dict(Path("/nonexistent")))

    class FakeClient:
        node, local_rank = "node3", 0
        drain_request = None

        def exchange(self, key, value, timeout, gen=None, on_sent=None):
            raise Superseded(f"exchange {key!r}: membership round open")

    class FakeEngine:
        state = TrainState(step=STEPS - 1)

        def step(self, commit=False):
            assert self.state.step < STEPS, "a step past the last"
            return StepResult(step=self.state.step, ok=True)

    driver = ElasticDriver(job, None, resolve_profile(job), None, torch.device("cpu"),
                           FakeClient(), events=_NullEvents(), secret=SECRET)
    driver.state.engine, driver.state.gen = FakeEngine(), 0
    rolled = StepResult(step=STEPS - 1, ok=True, loss=1.0)

    def recover(step, phase, why, peer):  # the survivors settled it: rolled forward
        assert (step, phase) == (STEPS - 1, "vote")
        driver.state.engine.state = TrainState(step=STEPS)
        driver.state.rolled = [rolled]

    driver.recover = recover
    assert driver.step() == [rolled]


@pytest.mark.timeout(30)
def test_a_rolled_forward_step_is_not_told_as_replayed():
    """This rank's vote of step 19 did not complete, another's did (and that one went on to
    step 20, where its node died): the survivors commit 19 here (roll forward) and replay 20.
    The recovery is told as 'step 20 replayed' (the demo said 'step 19 replayed' when rank 0
    was the one behind)."""
    from types import SimpleNamespace

    from oobleck_hpc.recovery.driver import ElasticDriver
    from oobleck_hpc.recovery.rounds import Recovery, reconcile
    from oobleck_hpc.engine import StepResult, TrainState

    job = job_from_dict(job_dict(Path("/nonexistent")))
    plan = SimpleNamespace(digest=lambda: "p0", pipelines=(), generation=0, nodes=("node0",))

    class Held:  # the base engine, holding step 19 (index 18) prepared
        state = TrainState(step=18, cursor=18 * 8)
        sampler = SimpleNamespace(global_batch=8)

        def __init__(self):
            self.plan = plan

        def commit(self):
            self.state = TrainState(step=19, cursor=19 * 8)
            return StepResult(step=18, ok=True)

    class FakeClient:
        node, local_rank = "node0", 0

        def exchange(self, key, value, timeout, gen=None, on_sent=None):
            committed = {"base": "p0", "step": 19, "cursor": 19 * 8, "prepared": "",
                         "groups": [], "base_gen": 0, "template_nodes": 2}
            return {"node0": [value], "node1": [committed]}

    driver = ElasticDriver(job, None, None, None, torch.device("cpu"), FakeClient(),
                           events=_NullEvents(), secret=SECRET)
    held = Held()
    s = driver.state
    s.base, s.base_plan = held, plan
    s.pending = Recovery(19, (), 0, "", 0.0)  # failed in step 19's vote
    reconcile(s, 1, held)
    assert held.state.step == 19 and [r.step for r in s.rolled] == [18]
    assert s.pending.step == 20


@pytest.mark.timeout(30)
def test_generations_without_a_loss_end_in_the_fallback_even_after_a_reconfiguration():
    """A recovery's new plan whose first step keeps failing with no further loss: every round
    used to reconfigure from the base plan again (its lost node counted as new each time), for
    ever (chaos seed 7007, trial 76: 45 rounds in 5 minutes). Generations that lose no node
    count as retries, the same on every survivor (the agents decide `lost`); after MAX_RETRIES
    the checkpoint fallback takes over."""
    from dataclasses import replace

    from oobleck_hpc.control.client import Membership
    from oobleck_hpc.recovery.driver import ElasticDriver
    from oobleck_hpc.recovery.rounds import MAX_RETRIES, Recovery, RecoveryError, replan
    from oobleck_hpc.engine import TrainState
    from oobleck_hpc.planning.cost import job_profile
    from oobleck_hpc.planning.reconfigure import reconfigure

    job, profile, templates, base = planned_job()
    nodes = base.nodes

    class FakeClient:
        node, local_rank = "node3", 0

    class FakeEngine:
        state = TrainState(step=3)

    driver = ElasticDriver(job, None, profile, None, torch.device("cpu"), FakeClient(),
                           events=_NullEvents(), secret=SECRET)
    s = driver.state
    s.templates, s.base, s.base_plan = templates, FakeEngine(), base
    rec = Recovery(4, (), 0, "", 0.0)
    survivors = tuple(n for n in nodes if n != "node2")
    plan, lost = replan(s, Membership(1, survivors, ("node2",), "node0", "h", 1), rec, "")
    assert lost == ("node2",) and s.retries == 0
    assert plan == replace(reconfigure(base, ["node2"], templates, job_profile(job, profile),
                                       job.fault_tolerance.f), generation=1)
    s.plan = plan  # the recovery completed; its first step failed, nothing else lost
    for gen in range(2, 2 + MAX_RETRIES):
        replan(s, Membership(gen, survivors, (), "node0", "h", 1), rec, "timed out")
    with pytest.raises(RecoveryError, match="times in a row with no node lost"):
        replan(s, Membership(9, survivors, (), "node0", "h", 1), rec, "timed out")


def planned_job():
    """The test job on its 5 nodes without any process: (job, profile, templates, plan)."""
    from oobleck_hpc.planning import plan_job
    from oobleck_hpc.profiling import resolve_profile

    job = job_from_dict(job_dict(Path("/nonexistent")))
    profile = resolve_profile(job)
    _, templates, plan = plan_job(job, profile, [f"node{i}" for i in range(5)])
    return job, profile, templates, plan


class _NullEvents:
    def emit(self, kind, **fields):
        return {}


@pytest.mark.timeout(30)
def test_connecting_to_a_store_host_that_died_gives_way_to_a_newer_round():
    """A store host that dies between the agreement and the connection: a client retries the
    connection until the store timeout (300 s in a job); a newer round ends the wait at once."""
    import socket
    import threading
    import time

    from oobleck_hpc.recovery.rendezvous import open_store
    from oobleck_hpc.control.membership import Superseded

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)

    def reset_everyone() -> None:  # accepts, then closes: what a dying host's port does
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=reset_everyone, daemon=True).start()
    opened = time.monotonic() + 0.3
    t0 = time.monotonic()
    try:
        with pytest.raises(Superseded):
            open_store("127.0.0.1", server.getsockname()[1], False, 20.0,
                       abort=lambda: time.monotonic() > opened, secret=b"s" * 32, generation=1)
        assert time.monotonic() - t0 < 2.0
    finally:
        server.close()


@pytest.fixture
def world_with_a_silent_peer():
    """A 2-rank gloo world, rank 0 in this process (collective timeout 30 s, setup timeout
    120 s), whose rank 1, another process, is in the world but never takes part in anything:
    a survivor that left a failed start, or a peer stopped after the regroup."""
    import datetime
    import subprocess
    import sys

    import torch.distributed as dist

    from oobleck_hpc.engine import Comm

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    peer = subprocess.Popen([sys.executable, "-c", f"""
import datetime, time, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", {store.port}, is_master=False,
                      timeout=datetime.timedelta(seconds=30))
store.set("arrived", "1")  # (as regroup's wait_arrivals: every rank reached the store)
dist.init_process_group("gloo", store=dist.PrefixStore("oobleck/gen0/", store), rank=1,
                        world_size=2, timeout=datetime.timedelta(seconds=120))
time.sleep(120)
"""])
    comm = None
    try:
        store.wait(["arrived"])
        comm = Comm.init(store, 0, 2, 0, "gloo", timeout_s=30.0, init_timeout_s=120.0)
        yield comm
    finally:
        if comm is not None:
            comm.abandon()
        peer.kill()
        peer.wait()


@pytest.mark.timeout(60)
def test_the_restore_agreement_gives_way_to_a_newer_round(world_with_a_silent_peer):
    """A node lost during the restore (chaos seed 7007, trial 6: node0, the store host, left at
    the restore; the workers still building the groups failed and left the start, those
    already in the restore's all-reduce waited the regroup's timeout, 300 s, for peers that
    never came). The agreement is bounded by that timeout and ends as soon as the agents open
    the next round (`abort`: the driver's `round_opened`)."""
    import time

    from oobleck_hpc.engine.groups import Aborted

    comm = world_with_a_silent_peer
    assert comm.setup_timeout_s == 120.0
    t0 = time.monotonic()
    with pytest.raises(Aborted):
        comm.all_reduce_max([3.0], abort=lambda: time.monotonic() > t0 + 0.5,
                            timeout_s=comm.setup_timeout_s)
    assert time.monotonic() - t0 < 2.0


@pytest.mark.timeout(60)
def test_a_transfer_gives_way_to_a_newer_round(world_with_a_silent_peer):
    """Chaos seed 5199, trial 8: a peer that exited during the transfer held a survivor in
    its receive for gloo's whole collective timeout (5 s), while the next round's members
    waited for it. The transfer's wait ends as soon as the agents open the next round (as
    recovery/rounds.transfer waits: Comm.wait with `round_opened` as its abort)."""
    import time
    from types import SimpleNamespace

    import torch

    from oobleck_hpc.engine.groups import Aborted, Waiter
    from oobleck_hpc.planning.reconfigure import Transfer
    from oobleck_hpc.recovery.transfer import execute

    comm = world_with_a_silent_peer
    new = SimpleNamespace(state=SimpleNamespace(step=0), device=torch.device("cpu"),
                          layers={0: torch.nn.Linear(4, 4)}, optimizer=None)
    waiter = Waiter("transfer-wait")
    t0 = time.monotonic()
    try:
        with pytest.raises(Aborted):
            execute([Transfer(0, 1, 0, 80)], 0, None, new, lambda works: comm.wait(
                works, waiter, lambda: time.monotonic() > t0 + 0.5, sync=True))
    finally:
        waiter.close()
    assert 0.5 < time.monotonic() - t0 < 2.0


@pytest.mark.timeout(60)
def test_a_gloo_world_whose_rank_never_connects_fails_at_the_short_timeout():
    """Chaos seed 2837, trial 10: a rank that reached the regroup's store and then left (the
    exit fault) held a survivor in gloo's full-mesh connect for the regroup's 25 s, long
    after the round that dropped it. The world's connect is bounded by the collective timeout
    (the ranks have all arrived by then); the world keeps the long one afterwards (a start's
    agreement may wait on one rank's disk: `all_reduce_max`). Every group is created with a
    fifth of the collective timeout (chaos seed 5204, trial 19: gloo waits up to 5 times it for
    a peer that published its address and never connected, here 25 s), then gets it."""
    import datetime
    import time

    import torch
    import torch.distributed as dist

    from oobleck_hpc.engine import Comm

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    t0 = time.monotonic()
    with pytest.raises(Exception):
        Comm.init(store, 0, 2, 0, "gloo", timeout_s=1.0, init_timeout_s=40.0)
    assert time.monotonic() - t0 < 10.0
    if dist.is_initialized():
        dist.destroy_process_group()
    comm = Comm.init(dist.HashStore(), 0, 1, 1, "gloo", timeout_s=10.0, init_timeout_s=40.0)
    try:  # (the backend's options: the only place torch shows a gloo group's timeout)
        group = comm.new_group([0])
        cpu = torch.device("cpu")
        assert group._get_backend(cpu).options._timeout == datetime.timedelta(seconds=2)
        comm.ready()  # (the plan's groups: created with the connect's, then the collective's)
        assert group._get_backend(cpu).options._timeout == datetime.timedelta(seconds=10)
        world = dist.group.WORLD._get_backend(cpu)
        assert world.options._timeout == datetime.timedelta(seconds=40)
    finally:
        comm.destroy()


@pytest.mark.timeout(60)
def test_a_store_op_on_a_frozen_host_fails_once_a_round_opens():
    """A hung node hosting the generation's store: a survivor's store.add() waits for its reply
    up to the store's timeout (300 s in a job; torch's TCPStore for ever). When the agents open
    the next round, the driver shuts the connection down and the call fails at once (chaos
    trial: two workers stuck so for minutes while their peers looped on an exchange they never
    joined)."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time
    from types import SimpleNamespace

    from oobleck_hpc.recovery.generation import on_notice
    from oobleck_hpc.recovery.rendezvous import open_store
    from oobleck_hpc.control.wire import free_port

    port = free_port()
    host = subprocess.Popen([sys.executable, "-c", f"""
import time
from oobleck_hpc.recovery.rendezvous import open_store
store = open_store("127.0.0.1", {port}, True, 30.0, secret=b"s" * 32, generation=2)
print("up", flush=True)
time.sleep(120)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout.readline() == "up\n"
        store = open_store("127.0.0.1", port, False, 30.0, secret=b"s" * 32, generation=2)
        store.add("arrived", 1)
        os.kill(host.pid, signal.SIGSTOP)
        outcome = []

        def add() -> None:
            try:
                outcome.append(store.add("arrived", 0))
            except RuntimeError as e:
                outcome.append(e)

        waiter = threading.Thread(target=add, daemon=True)
        waiter.start()
        waiter.join(4.0)
        assert waiter.is_alive() and not outcome
        state = SimpleNamespace(store_at=(2, "127.0.0.1", port), comm=None)
        on_notice(state, "round", {"gen": 2, "suspects": {}})  # not newer
        waiter.join(0.5)
        assert waiter.is_alive()
        t0 = time.monotonic()
        on_notice(state, "round", {"gen": 3, "suspects": {}})
        # At once, not after the store's 30 s timeout: the bound leaves a loaded CI machine
        # room (this test failed once in a CI run whose message was lost: cause not known).
        waiter.join(10.0)
        assert not waiter.is_alive() and isinstance(outcome[0], RuntimeError), outcome
        assert time.monotonic() - t0 < 10.0
    finally:
        host.kill()
        host.wait()
