"""Bootstrap and launch pieces that need no cluster: environment detection, hostlists, the
discovery record, the verdict over agents' exit codes, sbatch parameters and config errors.
(The same code against a real Slurm controller: tests/test_slurm_launch.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from oobleck_hpc.bootstrap import environment as envmod
from oobleck_hpc.bootstrap.discovery import (
    Discovery,
    NodeRecord,
    TooFewNodes,
    run_discovery_step,
    wait_for_discovery,
)
from oobleck_hpc.bootstrap.environment import (
    LocalEnvironment,
    NodeEnvironment,
    SlurmEnvironment,
    detect,
)
from oobleck_hpc.config import job_from_dict
from oobleck_hpc.control import wire
from oobleck_hpc.control.wire import NodeAddress, Roster
from oobleck_hpc.errors import ConfigError
from oobleck_hpc.records.runs import Outcome, outcome, verdict

SLURM_ENV = {
    "SLURM_JOB_ID": "42", "SLURMD_NODENAME": "gpu07", "SLURM_JOB_NODELIST": "gpu[05-08]",
    "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4", "SLURM_RESTART_COUNT": "1",
    "SLURM_STEP_ID": "3", "CUDA_VISIBLE_DEVICES": "0,1,2,3", "OOBLECK_NODE_ADDR": "10.0.0.7",
}


@pytest.mark.parametrize("hostlist, names", [
    ("n1", ["n1"]),
    ("n[1-4]", ["n1", "n2", "n3", "n4"]),
    ("n[1,3-4]", ["n1", "n3", "n4"]),
    ("gpu[05-07],cpu1", ["gpu05", "gpu06", "gpu07", "cpu1"]),
    ("a[8-10]x", ["a8x", "a9x", "a10x"]),
])
def test_hostlist_expansion(hostlist, names):
    assert envmod._expand_hostlist_py(hostlist) == names
    if shutil.which("scontrol"):  # the parser agrees with Slurm's own
        assert envmod.expand_hostlist(hostlist) == names


def test_slurm_environment_from_variables():
    env = SlurmEnvironment.detect(SLURM_ENV)
    assert env.source == "slurm" and env.job_id == "42" and env.node == "gpu07"
    assert env.nodes == ["gpu05", "gpu06", "gpu07", "gpu08"] and env.node_rank == 2
    assert (env.task_rank, env.local_rank, env.num_tasks) == (2, 0, 4)
    assert (env.restart_count, env.step_id) == (1, "3")
    assert (env.address, env.device_count) == ("10.0.0.7", 4)
    # Inside a step, the step's node list wins over the (possibly stale) job list.
    step = SlurmEnvironment.detect({**SLURM_ENV, "SLURM_STEP_NODELIST": "gpu[05,07]"})
    assert step.nodes == ["gpu05", "gpu07"] and step.node_rank == 1
    assert SlurmEnvironment.detect({"PATH": "/bin"}) is None


def test_local_environment_round_trips_and_wins_over_slurm():
    original = NodeEnvironment(source="local", job_id="run-3", node="node1",
                               nodes=["node0", "node1", "node2"], task_rank=3, local_rank=1,
                               num_tasks=6, restart_count=2, address="127.0.0.1",
                               device_count=2, extra={"run_dir": "runs/x"})
    env = original.to_env()
    assert env["OOBLECK_RUN_DIR"] == "runs/x"
    assert LocalEnvironment.detect(env) == original
    # A worker under Slurm inherits SLURM_* too; the agent's OOBLECK_* describe it better.
    assert detect({**SLURM_ENV, **env}) == original
    with pytest.raises(RuntimeError, match="not in OOBLECK_NODES"):
        LocalEnvironment.detect({"OOBLECK_NODE": "x", "OOBLECK_NODES": "a,b"})


def test_plain_process_is_one_local_node():
    env = detect({"CUDA_VISIBLE_DEVICES": ""})
    assert env.source == "local" and env.nodes == [env.node] and env.device_count == 0


def test_visible_devices():
    assert envmod.visible_device_count({"CUDA_VISIBLE_DEVICES": "2,3"}) == 2
    assert envmod.visible_device_count({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}) == 0


def test_discovery_record_round_trip_and_roster_format(tmp_path):
    found = Discovery("42", 1, (NodeRecord("n1", "10.0.0.1", 40001, 8),
                                NodeRecord("n2", "10.0.0.2", 40002, 8)), 40100, ("n1", "n2"))
    found.write(tmp_path)
    assert Discovery.load(tmp_path) == found
    assert wait_for_discovery(tmp_path, "42", 1, timeout_s=1) == found
    roster = Roster.load(tmp_path / "roster.json")  # the elastic agents' own reader
    assert roster.names == ("n1", "n2") and roster.store_port == 40100
    assert found.store == ("10.0.0.1", 40100)
    other = Discovery("42", 1, found.records[::-1], 40100)
    assert other.digest != found.digest  # order is part of what everyone must agree on
    with pytest.raises(TimeoutError, match="restart 2"):
        wait_for_discovery(tmp_path, "42", 2, timeout_s=0.3)
    spared = Discovery("42", 1, found.records, 40100, spares=1)  # cluster.spares: 1
    spared.write(tmp_path)
    assert Discovery.load(tmp_path) == spared and spared.digest != found.digest
    assert Roster.load(tmp_path / "roster.json").members0 == ("n1",)


FAKE_SRUN = r"""#!/bin/bash
# A stand-in for srun: the discovery step hangs on its first $HANGS calls and exits $DISCOVERY_RC
# after, a trivial step (`true`) fails on the nodes named in $BAD.
echo "$*" >> "$CALLS"
case "$*" in
  *discover*) n=$(grep -c discover "$CALLS")
              if [ "$n" -le "$HANGS" ]; then exec sleep 60; fi; exit "$DISCOVERY_RC" ;;
esac
for node in $BAD; do case "$*" in *--nodelist=$node\ *) exit 1 ;; esac; done
exit 0
"""


def _discovery_with(tmp_path, monkeypatch, *, hangs=0, rc=0, bad="", min_nodes=1):
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "srun").write_text(FAKE_SRUN)
    (fake / "srun").chmod(0o755)
    calls = tmp_path / "calls"
    calls.write_text("")
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    for k, v in {"CALLS": str(calls), "HANGS": str(hangs), "DISCOVERY_RC": str(rc),
                 "BAD": bad}.items():
        monkeypatch.setenv(k, v)
    nodes = run_discovery_step(tmp_path, ["n1", "n2", "n3"], python=sys.executable, mpi="pmix",
                               log=tmp_path / "log", min_nodes=min_nodes, attempt_s=0.3)
    return nodes, [line for line in calls.read_text().splitlines() if "discover" in line]


def test_a_discovery_step_that_hangs_is_cancelled_and_run_again_on_the_same_nodes(
        tmp_path, monkeypatch):
    nodes, tried = _discovery_with(tmp_path, monkeypatch, hangs=2)
    assert nodes == ["n1", "n2", "n3"] and len(tried) == 3
    assert all("--nodelist=n1,n2,n3 " in t for t in tried)


def test_a_discovery_step_leaves_out_the_nodes_that_cannot_run_a_step(tmp_path, monkeypatch):
    nodes, tried = _discovery_with(tmp_path, monkeypatch, hangs=1, bad="n2")
    assert nodes == ["n1", "n3"] and "--nodelist=n1,n3 " in tried[-1]
    with pytest.raises(TooFewNodes, match="needs at least 3"):
        _discovery_with(tmp_path, monkeypatch, rc=1, bad="n2", min_nodes=3)


def test_a_discovery_step_that_fails_on_good_nodes_is_not_run_again(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="exit 2.*each of which runs a step alone"):
        _discovery_with(tmp_path, monkeypatch, rc=2)
    assert (tmp_path / "calls").read_text().count(" discover ") == 1
    with pytest.raises(RuntimeError, match="failed 3 times"):
        _discovery_with(tmp_path, monkeypatch, hangs=3)


def test_handed_out_ports_avoid_the_ephemeral_range_and_each_other(monkeypatch, tmp_path):
    """The ports discovery and the local launcher hand to agents and stores never lie in the
    kernel's ephemeral range (where srun's own listeners and every outgoing connection get
    theirs: the race seen in loop round 6), are distinct, and skip a port in use."""
    lo, hi = wire._ephemeral_range()
    ports = wire.free_ports(200)
    assert len(set(ports)) == 200
    assert all(wire.PORT_FLOOR <= p < 65536 and not lo <= p <= hi for p in ports), ports
    # A narrow window outside the range: [PORT_FLOOR, PORT_FLOOR + 3) with one port taken.
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text(f"{wire.PORT_FLOOR + 3} 65535\n")
    monkeypatch.setattr(wire, "_EPHEMERAL", narrow)
    taken = wire.reserve_port()
    if not wire.PORT_FLOOR <= taken.getsockname()[1] < wire.PORT_FLOOR + 3:
        taken.close()
        pytest.skip("the three ports above PORT_FLOOR are in use on this host")
    try:
        for _ in range(20):
            with wire.reserve_port() as s:
                assert s.getsockname()[1] != taken.getsockname()[1]
    finally:
        taken.close()
    # No room outside the range: the OS picks.
    narrow.write_text("1024 65535\n")
    assert wire.free_port() > 0


@pytest.mark.parametrize("finished, codes, expected", [
    (True, [0, 0, 0], 0),
    (True, [0, 137, 75], 0),      # finished: whoever was lost (killed, fenced) on the way
    (True, [2], 0),               # finished wins over a late bad-input report
    (True, [], 0),                # every agent killed with its node after the last step
    (False, [0, 0, 0], 3),        # every node exited 0 (drained, left early): not finished
    (False, [0, 75, 3], 75),      # a drained node's 0 is no success: the others requeue
    (False, [0, 3], 3),
    (False, [3, 75, 2], 2),       # unfinished: bad input first...
    (False, [3, 75, 3], 75),      # ...then a requeue request...
    (False, [3, 1, 137], 3),      # ...else 3
    (False, [], 3),               # nothing recorded: every node lost
])
def test_verdict_is_finished_from_the_record_else_a_rule_over_the_codes(finished, codes,
                                                                         expected):
    assert verdict(finished, codes) == expected


def _record(run_dir, events=(), rows=()):
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events)
                                          + '{"t": 99.0, "ki')  # a line being written
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_outcome_is_finished_only_for_this_runs_last_step(tmp_path):
    started = {"t": 1.0, "kind": "run_started", "run": "r2", "steps": 6}
    done = {"t": 9.0, "kind": "run_finished", "run": "r2", "steps": 6, "total": 6}
    rows = [{"step": k, "run": "r2", "attempt": 0} for k in range(1, 7)]
    (tmp_path / "run-id").write_text("r2\n")
    _record(tmp_path, [started, done], rows)
    assert outcome(tmp_path) == Outcome("r2", True, 6, 6, 6)
    assert outcome(tmp_path).describe() == "finished at step 6 of 6"
    assert not outcome(tmp_path, run="r1").finished          # another run's records
    _record(tmp_path, [started, {**done, "run": "r1"}], rows)
    assert not outcome(tmp_path).finished                    # only an earlier run finished
    _record(tmp_path, [started], rows[:4])                   # every node drained or killed
    assert outcome(tmp_path) == Outcome("r2", False, 4, 6, 4)
    assert outcome(tmp_path).describe() == "ended at step 4 of 6: not finished"
    _record(tmp_path, [started, done], rows[:5])             # the metrics lack the last step
    assert not outcome(tmp_path).finished
    _record(tmp_path, [started, {**done, "steps": 4}], rows[:4])   # fewer steps than the job's
    assert not outcome(tmp_path).finished
    replayed = rows[:4] + [{"step": k, "run": "r2", "attempt": 1} for k in range(3, 7)]
    _record(tmp_path, [started, done], replayed)             # a fallback replayed steps 3-4
    assert outcome(tmp_path) == Outcome("r2", True, 6, 6, 6)


def test_run_verdict_reads_the_record_and_this_attempts_codes(tmp_path):
    from oobleck_hpc.launch.slurm_task import run_verdict

    (tmp_path / "run-id").write_text("slurm-7\n")
    (tmp_path / "exit" / "7-r1").mkdir(parents=True)
    for node, code in {"a": 0, "b": 0, "c": 75}.items():
        (tmp_path / "exit" / "7-r1" / node).write_text(f"{code}\n")
    rows = [{"step": k, "run": "slurm-7"} for k in (1, 2, 3)]
    _record(tmp_path, [{"t": 1.0, "kind": "run_started", "run": "slurm-7", "steps": 3}], rows)
    rc, codes, out = run_verdict(tmp_path, "7-r1")
    assert (rc, codes, out.finished) == (75, {"a": 0, "b": 0, "c": 75}, False)
    _record(tmp_path, [{"t": 2.0, "kind": "run_finished", "run": "slurm-7", "steps": 3,
                        "total": 3}], rows)
    assert run_verdict(tmp_path, "7-r1")[0] == 0


def test_recorded_outcome_is_published_unless_it_asks_to_resume(tmp_path):
    from oobleck_hpc.launch.slurm_driver import LaunchResult
    from oobleck_hpc.launch.slurm_task import recorded_outcome

    record = {"job_id": "7", "restart_count": 0, "nodes": ["n1", "n2"], "lost_nodes": ["n1"],
              "exit_code": 0, "finished_by": "n2", "batch_host_lost": "n1"}
    (tmp_path / "launch-7-r0.json").write_text(json.dumps(record))
    assert recorded_outcome(tmp_path, "7", 0) is None       # the first run publishes nothing
    assert recorded_outcome(tmp_path, "7", 2) is None       # only the run right before counts
    assert recorded_outcome(tmp_path, "7", 1) == record
    result = LaunchResult.from_record(record, "/logs")
    assert (result.exit_code, result.lost_nodes, result.restart_count) == (0, ["n1"], 0)
    (tmp_path / "launch-7-r0.json").write_text(json.dumps({**record, "exit_code": 75}))
    assert recorded_outcome(tmp_path, "7", 1) is None       # 75: the next run resumes
    del record["finished_by"]
    (tmp_path / "launch-7-r0.json").write_text(json.dumps(record))
    assert recorded_outcome(tmp_path, "7", 1) is None       # written by a driver: a normal run


def test_a_job_that_resumes_asks_for_the_nodes_left(monkeypatch):
    """A requeue after a node loss asks for the nodes whose agent recorded an exit code, when at
    least the plan's minimum are; else (or with nothing lost) for the original count (None)."""
    from oobleck_hpc.launch.slurm_task import nodes_left

    roster = ["n1", "n2", "n3", "n4"]
    assert nodes_left(roster, {"n2": 75, "n4": 75}, least=2) == 2
    assert nodes_left(roster, {"n2": 75}, least=2) is None  # too few: wait for nodes
    assert nodes_left(roster, dict.fromkeys(roster, 75), least=2) is None  # nothing lost
    assert nodes_left(roster, {"n1": 75, "n2": 75, "n3": 75, "n9": 75}, least=1) == 3
    monkeypatch.setenv("OOBLECK_MIN_NODES", "3")  # the batch script's, for the agents' wrappers
    assert nodes_left(roster, {"n2": 75, "n4": 75}) is None
    assert nodes_left(roster, {"n1": 75, "n2": 75, "n4": 75}) == 3


def test_sbatch_parameters_and_agent_command():
    from oobleck_hpc.launch.slurm import (DEFAULT_AGENT_COMMAND, agent_argv, members,
                                          sbatch_parameters)

    job = job_from_dict({"name": "t", "cluster": {"nodes": 8}, "slurm": {
        "partition": "gpu", "time_min": 120, "gpus_per_node": 4, "signal": "SIGUSR1",
        "signal_delay_s": 300, "extra": {"qos": "high"}, "setup": ["module load cuda"]}})
    p = sbatch_parameters(job)
    assert (p["nodes"], p["time"], p["partition"], p["gpus_per_node"]) == (8, 120, "gpu", 4)
    assert p["use_srun"] is False and p["setup"] == ["module load cuda"]
    extra = p["additional_parameters"]
    assert extra["no-kill"] is True and extra["requeue"] is True
    assert extra["signal"] == "USR1@300" and extra["qos"] == "high"
    spared = job_from_dict({"name": "t", "cluster": {"launch": "slurm", "nodes": 8, "spares": 2}})
    assert sbatch_parameters(spared)["nodes"] == 10  # the spares are allocated with the job
    assert (members(spared), members(job)) == (8, 0)
    assert agent_argv(None, python="/p y", job_file="/r/job.yaml", run_dir="/r") == [
        "/p y", "-m", "oobleck_hpc.control.agent", "--job", "/r/job.yaml", "--run-dir", "/r"]
    assert "{run_dir}" in DEFAULT_AGENT_COMMAND
    assert agent_argv("{python} -m x --roster {roster}", python="py", job_file="j",
                      run_dir="/r") == ["py", "-m", "x", "--roster", "/r/roster.json"]


@pytest.mark.parametrize("slurm, key", [
    ({"signal": "USR9"}, "slurm.signal"),
    ({"signal_delay_s": 7200, "time_min": 60}, "slurm.signal_delay_s"),
    ({"agent_command": "{python} -m x {nodes}"}, "slurm.agent_command"),
    ({"extra": {"no_kill": "1"}}, "slurm.extra.no_kill"),
    ({"time_min": 0}, "slurm.time_min"),
])
def test_bad_slurm_section_names_key_and_fix(slurm, key):
    with pytest.raises(ConfigError) as err:
        job_from_dict({"slurm": slurm}, source="job.yaml")
    assert err.value.key == key and "Fix:" in str(err.value)


def test_submit_without_controller_says_how_to_start_one(tmp_path, monkeypatch):
    from oobleck_hpc.launch.slurm import SlurmUnavailable, submit

    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "missing.conf"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol at all
    with pytest.raises(SlurmUnavailable, match="dev-cluster.sh up"):
        submit(job_from_dict({"run_dir": str(tmp_path / "run")}))


def test_submit_dry_run_prints_flags(tmp_path):
    job = tmp_path / "j.yaml"
    job.write_text("name: dry\ncluster: {nodes: 3}\n")
    out = subprocess.run([sys.executable, "-m", "oobleck_hpc", "submit", str(job), "--dry-run"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["sbatch"]["nodes"] == 3 and shown["sbatch"]["additional_parameters"]["no-kill"]
    assert shown["agent"][1:3] == ["-m", "oobleck_hpc.control.agent"]


def test_a_replacement_agent_adds_itself_to_the_running_jobs_roster(tmp_path):
    """`agent --join` (join_roster_file): appended as a grown node with its address and a free
    port; a name already in the roster -- a lost node given back to the job -- gets a suffix."""
    from oobleck_hpc.control.wire import join_roster_file

    path = tmp_path / "roster.json"
    Roster((NodeAddress("n1", "10.0.0.1", 40001), NodeAddress("n2", "10.0.0.2", 40002)),
           40100).write(path)
    name, roster = join_roster_file(path, "n4", "127.0.0.1")
    assert name == "n4" and roster == Roster.load(path)
    assert roster.names == ("n1", "n2", "n4") and roster.members0 == ("n1", "n2")
    again, roster = join_roster_file(path, "n2", "127.0.0.1")
    assert again == "n2~2" and Roster.load(path).names == ("n1", "n2", "n4", "n2~2")
    assert len({n.port for n in roster.nodes}) == 4


def test_replace_needs_slurm():
    with pytest.raises(ConfigError) as err:
        job_from_dict({"fault_tolerance": {"replace": True}}, source="job.yaml")
    assert err.value.key == "fault_tolerance.replace" and "oobleck-hpc grow" in str(err.value)
    job = job_from_dict({"cluster": {"launch": "slurm"}, "fault_tolerance": {"replace": True}})
    assert job.fault_tolerance.replace
