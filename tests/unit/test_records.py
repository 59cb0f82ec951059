"""Run records and the user's view, without processes: run ids and the run directory
(oobleck_hpc/records/runs.py), the console's story (oobleck_hpc/records/story.py), the metrics writer's
numbering (progress.Progress) and the report (oobleck_hpc/records/report.py) on a hand-made run."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from oobleck_hpc.records import runs
from oobleck_hpc.records.events import EventLog, read_jsonl
from oobleck_hpc.records.story import Story, Tail, tell


def test_a_new_run_moves_the_previous_runs_records_to_history(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "KEEP_RUNS", 2)
    run_dir = tmp_path / "job"
    assert runs.begin(run_dir, "run-a") is None  # nothing there yet
    for name in ("events.jsonl", "metrics.jsonl", "run.json", "job.lock", "logs-attempt0/x"):
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(name)
    assert runs.begin(run_dir, "run-a") is None  # a requeued attempt of the same run keeps them
    assert (run_dir / "events.jsonl").exists()

    assert runs.begin(run_dir, "run-b") == "run-a"
    old = run_dir / "history" / "run-a"
    assert sorted(p.name for p in old.iterdir()) == ["events.jsonl", "logs-attempt0",
                                                    "metrics.jsonl"]
    assert (old / "logs-attempt0" / "x").read_text() == "logs-attempt0/x"
    assert not (run_dir / "events.jsonl").exists() and not (run_dir / "logs-attempt0").exists()
    assert (run_dir / "run.json").exists() and (run_dir / "job.lock").exists()  # across runs
    assert runs.read_run_id(run_dir) == "run-b"

    for i in range(3):  # only the last KEEP_RUNS earlier runs are kept
        (run_dir / "events.jsonl").write_text("x")
        runs.begin(run_dir, f"run-c{i}")
    assert [p.name for p in runs.history(run_dir)] == ["run-c0", "run-c1"]


def test_records_from_before_run_ids_are_kept_under_a_made_up_name(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    moved = runs.begin(tmp_path, runs.new_run_id())
    assert moved.startswith("unnamed-") and (tmp_path / "history" / moved / "metrics.jsonl").exists()


def test_events_name_their_run_and_attempt(tmp_path, monkeypatch):
    for key in ("SLURM_RESTART_COUNT", "OOBLECK_REQUEUE_COUNT", "OOBLECK_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("OOBLECK_RUN_ID", raising=False)
    runs.begin(tmp_path, "from-file")
    EventLog(tmp_path / "events.jsonl", "kill-node").emit("node_killed", node="node1",
                                                          signal="SIGKILL", pid=1)
    monkeypatch.setenv("OOBLECK_RUN_ID", "from-env")
    monkeypatch.setenv("OOBLECK_REQUEUE_COUNT", "2")
    EventLog(tmp_path / "events.jsonl", "node0").emit("agent_started", pid=1, workers=1,
                                                      port=4000, worker_pids=[2])
    rows = read_jsonl(tmp_path / "events.jsonl")
    assert [(r["run"], r["attempt"]) for r in rows] == [("from-file", 0), ("from-env", 2)]


def ev(t: float, kind: str, source: str = "node0", **fields) -> dict:
    return {"t": t, "kind": kind, "source": source, "run": "r1", "attempt": 0, **fields}


# A run as its agents and workers record it: node3 killed during step 4, seen by three agents,
# agreed by four, recovered by rank 0; then a checkpoint and the end.
RUN = [
    ev(0.0, "run_started", "launcher", job="demo", model="gpt-tiny", steps=6, launch="local",
       nodes=4, gpus_per_node=2),
    ev(0.1, "agent_started"),
    ev(1.0, "plan_chosen", "node0/0", generation=0, plan="aaaaaaaa11", pipelines=[2, 1, 1],
       microbatches=[2, 1, 1], nodes=4, gpus_per_node=2, predicted_step_ms=50.0, note="",
       layout=["pipeline 0: ..."]),
    ev(2.00, "fault_injected", "node3/0", node="node3", step=4, phase="backward", fault="kill"),
    ev(2.02, "failure_detected", "node1", node="node3", how="connection_lost", gen=0),
    ev(2.02, "failure_detected", "node2", node="node3", how="connection_lost", gen=0),
    ev(2.03, "step_failed", "node1/0", step=4, phase="backward", generation=0),
    ev(2.04, "agreement_reached", "node0", gen=1, nodes=["node0", "node1", "node2"],
       lost=["node3"]),
    ev(2.04, "agreement_reached", "node1", gen=1, nodes=["node0", "node1", "node2"],
       lost=["node3"]),
    ev(2.05, "membership_agreed", "node0/0", generation=1, lost=["node3"]),
    ev(2.06, "plan_chosen", "node0/0", generation=1, plan="bbbbbbbb22", pipelines=[1, 1, 1],
       microbatches=[2, 1, 1]),
    ev(2.10, "groups_rebuilt", "node0/0", generation=1),
    ev(2.12, "state_transferred", "node0/1", generation=1),
    ev(2.15, "state_transferred", "node1/0", generation=1),
    ev(2.30, "recovered", "node0/0", step=4, generation=1, lost=["node3"], seconds=0.27,
       rounds=1, plan="bbbbbbbb22", bytes_moved=3_000_000),
    ev(2.50, "checkpoint_saved", "node1/0", step=4, bytes=12_000_000, seconds=0.05),
    ev(3.00, "run_finished", "node0/0", steps=6, model="gpt-tiny", wall_s=2.0, first_loss=5.5,
       last_loss=4.0, samples_per_s=10.0),
]


def test_the_story_tells_each_transition_once_with_the_users_recovery_time():
    lines = tell(RUN)
    # said at the launch: the plan comes only once every worker imported torch
    assert lines[0].startswith("starting 4 nodes x 2 workers on this machine: each worker "
                               "imports torch, then they meet and plan")
    assert lines[1].startswith("plan aaaaaaaa on 4 nodes x 2 GPUs: 3 pipelines of [2, 1, 1] "
                               "nodes, 4 microbatches, predicted step 50.0 ms")
    assert lines[2:] == [
        "fault injected: kill node3 during step 4 (backward)",
        "fault seen: node3 lost (connection lost, seen by node1)",  # once, not per agent
        "agreed: generation 1 on 3 nodes, without node3",           # once, not per agent
        "recovered: lost node3; step 4 replayed on plan bbbbbbbb (pipelines of [1, 1, 1] "
        "nodes) 0.30 s after the fault; 3.00 MB of layer state moved",  # from the kill
        "checkpoint: step 4 written (12.00 MB, 0.05 s in the background)",
        # what its samples/s counts: the loop ended at 3.0 after 2.0 s, the run began at 0.0
        "done: 6 steps of gpt-tiny; loss 5.5000 -> 4.0000; 10.0 samples/s over the 2.0 s of the "
        "training loop (its first step's warm-up included, the 1.0 s of start-up before it not; "
        "`oobleck-hpc report` counts the whole run); 1 recovery",
    ]


def test_the_story_says_what_a_later_attempts_done_line_counts():
    story = Story()
    story.feed({**ev(10.0, "agent_started"), "attempt": 1})
    (line,) = story.feed({**ev(20.0, "run_finished", "node0/0", steps=6, model="m", wall_s=4.0,
                                first_loss=5.0, last_loss=4.0, samples_per_s=3.0), "attempt": 1})
    assert ("3.0 samples/s over the 4.0 s of attempt 1's training loop (its first step's "
            "warm-up included, the 6.0 s of start-up before it not;") in line, line


def test_the_story_says_what_a_slurm_job_is_doing_before_its_plan():
    (line,) = tell([ev(0.0, "run_started", "driver", launch="slurm", job_id="42", nodes=3)])
    assert line.startswith("starting on 3 nodes of Slurm job 42: one agent per node starts its "
                           "workers; each imports torch"), line


def test_the_story_tells_a_hang_by_kill_node_as_a_hang_not_a_kill():
    """`oobleck-hpc kill-node --signal STOP` freezes the node (issue 27: the console said
    "node killed"); SIGKILL kills it, SIGTERM asks it to stop."""
    said = [Story().feed(ev(1.0, "node_killed", "kill-node", node="node2", signal=sig, pid=7))
            for sig in ("SIGSTOP", "SIGKILL", "SIGTERM")]
    assert said == [["node hung: node2 (SIGSTOP from kill-node)"],
                    ["node killed: node2 (SIGKILL from kill-node)"],
                    ["node asked to stop: node2 (SIGTERM from kill-node)"]]
    # The hang's recovery is timed from the stop, as a kill's is from the kill.
    story = Story()
    for e in (ev(1.0, "node_killed", "kill-node", node="node2", signal="SIGSTOP", pid=7),
              ev(4.1, "failure_detected", "node1", node="node2", how="lease expired", gen=0),
              ev(4.2, "agreement_reached", "node0", gen=1, nodes=["node0", "node1"],
                 lost=["node2"])):
        story.feed(e)
    (line,) = story.feed(ev(4.5, "recovered", step=9, generation=1, lost=["node2"],
                            seconds=0.3, plan="f" * 16))
    assert "3.50 s after the fault" in line, line


def test_the_story_tells_the_plan_of_a_start_on_survivors():
    """A node lost while the job starts: no recovery follows (nothing trained yet), the new
    plan is the start's own (chaos seed 7007, trial 6: the console said nothing of it)."""
    story = Story()
    (line,) = story.feed(ev(1.0, "plan_chosen", "node1/0", generation=1, plan="cccccccc33",
                            pipelines=[1, 1, 1, 1], microbatches=[1, 1, 1, 1], nodes=4,
                            gpus_per_node=2, lost=["node0"], start=True))
    assert line.startswith("plan cccccccc on 4 nodes x 2 GPUs: 4 pipelines of [1, 1, 1, 1]")


def test_the_story_tells_a_spare_swapped_in_by_a_recovery():
    story = Story()
    (agreed,) = story.feed(ev(2.0, "agreement_reached", "node0", gen=1, lost=["node2"],
                              joined=["node5"], nodes=["node0", "node1", "node3", "node4", "node5"]))
    assert agreed == "agreed: generation 1 on 5 nodes, without node2, node5 swapped in"
    (line,) = story.feed(ev(2.5, "recovered", step=3, generation=1, lost=["node2"],
                            joined=["node5"], seconds=0.4, plan="e" * 16))
    assert line.startswith("recovered: lost node2, node5 swapped in; step 3 replayed on plan "
                           "eeeeeeee"), line


def test_the_story_tells_a_slurm_jobs_replacement_and_a_node_given_back():
    story = Story()
    (released,) = story.feed(ev(1.0, "nodes_released", "driver", nodes=["n2"], ok=True))
    assert released == "gave back n2: agreed away but still allocated, now released from the job"
    (asked,) = story.feed(ev(1.5, "replacement_submitted", "grow", job_id="17", nodes=1,
                             reason="generation 1 lost n2"))
    assert asked.startswith("replacement: Slurm job 17 submitted for 1 node (generation 1 lost")
    (line,) = story.feed(ev(9.5, "recovered", step=40, generation=2, lost=[], joined=["n4"],
                            seconds=0.2, plan="e" * 16))
    assert "after the grow" in line, line  # timed from the request, not from the loss
    (ended,) = story.feed(ev(20.0, "replacements_ended", "driver", job_ids=["18"], why="done"))
    assert ended == "replacements ended with the run: 18 cancelled"


def test_the_story_tells_a_loss_after_the_last_step_as_the_end_agreed():
    story = Story()
    (started,) = story.feed(ev(0.0, "run_started", "launcher", steps=12, nodes=3))
    assert started.startswith("starting 3 nodes x 1 worker on this machine"), started
    (line,) = story.feed(ev(2.0, "recovered", step=13, generation=1, lost=["node2"],
                            seconds=0.1, plan="d" * 16))
    assert line.startswith("recovered: lost node2 after the last step; the end agreed on plan "
                           "dddddddd"), line


def test_the_story_warns_of_a_worker_that_crashed_after_its_work():
    story = Story()
    assert story.feed(ev(1.0, "worker_exited", "node2", local_rank=1, code=0, done=0)) == []
    (line,) = story.feed(ev(1.1, "worker_exited", "node2", local_rank=0, code=-6, done=0,
                            pid=42))
    assert line.startswith("warning: worker 0 of node2 (pid 42) finished its work (0) but "
                           "exited with SIGABRT")


def test_the_story_times_a_recovery_from_the_first_survivor_when_the_fault_is_unknown():
    story = Story()
    story.feed(ev(5.0, "failure_detected", "node1", node="node2", how="lease_expired", gen=3))
    (line,) = story.feed(ev(8.5, "recovered", step=9, generation=4, lost=["node2"],
                            seconds=3.0, plan="c" * 16))
    assert "3.50 s after the fault" in line and "layer state" not in line


def write_run(run_dir: Path, events: list[dict], rows: list[dict]) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "run-id").write_text("r1\n")
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def row(step: int, t: float, attempt: int = 0, seconds: float = 0.1) -> dict:
    return {"step": step, "loss": 6.0 - step / 10, "samples": 8, "seconds": seconds, "time": t,
            "plan": "p", "generation": 0, "run": "r1", "attempt": attempt}


def test_report_breaks_a_recovery_into_phases_and_counts_the_time_lost(tmp_path):
    from oobleck_hpc.records.report import PHASES, build, text

    rows = [row(1, 1.2), row(2, 1.4), row(3, 1.6), row(4, 2.3), row(5, 2.5), row(6, 2.7)]
    write_run(tmp_path / "run", RUN, rows)
    rep = build(tmp_path / "run")
    (r,) = rep["recoveries"]
    assert r["recovery_s"] == pytest.approx(0.30) and r["lost"] == ["node3"]
    assert list(r["phases"]) == list(PHASES)
    assert sum(r["phases"].values()) == pytest.approx(r["recovery_s"])
    assert r["phases"]["detect"] == pytest.approx(0.02)     # kill -> first survivor noticed
    assert r["phases"]["agree"] == pytest.approx(0.02)
    assert r["phases"]["transfer"] == pytest.approx(0.05)   # until the LAST rank finished
    assert rep["steps"] == {"committed": 6, "computed": 6, "total": 6, "replayed": 0}
    assert rep["time_lost_s"]["recovery"] == pytest.approx(0.20)  # less the replayed step
    assert rep["goodput_samples_per_s"] == rep["throughput_samples_per_s"]
    assert [c["step"] for c in rep["checkpoints"]] == [4]
    out = text(rep)
    assert "recovered: lost node3" in out and "goodput" in out


def test_report_tells_start_up_apart_from_training(tmp_path):
    """Issue 27: the console said 87 samples/s, the report 22 for the same run, and the plot
    began at the first step. The report names start-up as a phase and gives both figures."""
    from oobleck_hpc.records.report import build, text

    rows = [row(1, 1.2), row(2, 1.4), row(3, 1.6), row(4, 2.3), row(5, 2.5), row(6, 2.7)]
    write_run(tmp_path / "run", RUN, rows)
    rep = build(tmp_path / "run")
    # launch (run_started, 0.0) -> step 1 committed (1.2)
    assert rep["startups"] == [{"attempt": 0, "t": 0.0, "t_first_step": 1.2, "first_step": 1,
                                "seconds": 1.2}]
    assert rep["startup_s"] == pytest.approx(1.2)
    assert rep["wall_s"] == pytest.approx(3.0)  # until the last event (run_finished)
    assert rep["goodput_samples_per_s"] == pytest.approx(6 * 8 / 3.0)
    # steps 2..6 committed between step 1's commit (1.2) and the last (2.7)
    assert rep["training_s"] == pytest.approx(1.5)
    assert rep["training_goodput_samples_per_s"] == pytest.approx(5 * 8 / 1.5, abs=0.01)
    kinds = [x["kind"] for x in rep["timeline"]]
    assert kinds[:3] == ["run_started", "plan_chosen", "startup"]  # in time order
    assert rep["timeline"][2]["line"].startswith("start-up done: step 1 committed 1.20 s after "
                                                 "the launch")
    out = text(rep)
    assert ("goodput 16.0 samples/s over the whole run (3.0 s, start-up 1.2 s included); "
            "26.7 samples/s while training (first committed step to last, 1.5 s)") in out, out


def test_report_counts_replayed_steps_of_a_fallback_as_lost_work(tmp_path):
    from oobleck_hpc.records.report import build, text

    events = [ev(0.0, "run_started", "launcher", job="demo", steps=5),
              ev(2.0, "fallback", "node0/0", reason="no replica", resume_from=2),
              ev(2.5, "requeued", "launcher", next_attempt=1, nodes=2, reason="no replica"),
              {**ev(3.0, "agent_started"), "attempt": 1}]
    rows = [row(1, 1.0), row(2, 1.1), row(3, 1.2), row(4, 1.3),
            row(3, 4.0, attempt=1), row(4, 4.1, attempt=1), row(5, 4.2, attempt=1)]
    write_run(tmp_path / "run", events, rows)
    rep = build(tmp_path / "run")
    assert rep["attempts"] == 2
    assert rep["steps"] == {"committed": 5, "computed": 7, "total": 5, "replayed": 2}
    assert rep["time_lost_s"]["replayed"] == pytest.approx(0.2)  # steps 3 and 4, once each
    assert rep["time_lost_s"]["requeue"] == pytest.approx(4.0 - 1.3 - 0.1)
    assert rep["goodput_samples_per_s"] < rep["throughput_samples_per_s"]
    assert rep["goodput_fraction"] == pytest.approx(5 / 7, abs=1e-4)
    assert any(x["line"].startswith("fell back: no replica; the job resumes from step 2")
               for x in rep["timeline"])
    assert any(x["line"].startswith("requeued: attempt 1 on 2 nodes") for x in rep["timeline"])
    # each attempt's start-up (the launch -> 1.0; attempt 1's agents at 3.0 -> 4.0)
    assert [(x["attempt"], x["seconds"]) for x in rep["startups"]] == [(0, 1.0), (1, 1.0)]
    assert rep["startup_s"] == pytest.approx(2.0)
    # training: step 1's commit (1.0) to the last (4.2); steps 2..5 committed after it, step 3
    # and 4 counted once (their last computation)
    assert rep["training_s"] == pytest.approx(3.2)
    assert rep["training_goodput_samples_per_s"] == pytest.approx(4 * 8 / 3.2)
    assert "start-ups 1.0 + 1.0 s included" in text(rep)


def test_report_refuses_what_is_not_a_run_directory(tmp_path):
    from oobleck_hpc.records.report import ReportError, build

    with pytest.raises(ReportError, match="no events.jsonl"):
        build(tmp_path)
    write_run(tmp_path / "run", RUN, [])
    with pytest.raises(ReportError, match="no run 'old'"):
        build(tmp_path / "run", "old")


def test_report_plot_marks_the_run(tmp_path):
    pytest.importorskip("matplotlib")
    from oobleck_hpc.records.report import main

    rows = [row(k, 1.0 + 0.2 * k) for k in range(1, 7)]
    write_run(tmp_path / "run", RUN, rows)

    @dataclass
    class Args:
        run_dir: str
        run: str | None = None
        plot: str | None = None
        json: bool = True

    out = tmp_path / "run.png"
    assert main(Args(str(tmp_path / "run"), plot=str(out))) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


@dataclass
class Result:
    """A committed step as the engine reports it (engine/state.py StepResult's fields)."""

    step: int  # the engine's 0-based index
    loss: float = 1.0
    samples: int = 4
    seconds: float = 0.1
    grad_norm: float = 0.0
    lr: float = 1e-3


def test_metrics_lines_count_steps_from_one_and_name_their_attempt(tmp_path, capsys):
    from oobleck_hpc.records.progress import Progress

    path = tmp_path / "metrics.jsonl"
    # an earlier attempt of the same run recorded steps 1..3; this attempt resumes after step 1
    path.write_text("".join(json.dumps({"step": k, "run": "r", "attempt": 0}) + "\n"
                            for k in (1, 2, 3)))
    p = Progress(total=4, log_every=2, metrics=path, run="r", attempt=1)
    p.record([Result(1), Result(2)], "plan", 0, active=True)
    p.record([Result(3)], "plan", 0, active=True)
    p.finish()
    rows = read_jsonl(path)
    assert [(r["step"], r["attempt"]) for r in rows] == [(1, 0), (2, 0), (3, 0), (2, 1), (3, 1),
                                                         (4, 1)]
    assert capsys.readouterr().out.splitlines()[0].startswith("step 2/4")
    assert all(math.isfinite(r.get("loss", 0.0)) for r in rows)


def test_the_metrics_keep_a_step_whose_writer_crashed_and_rejoined(tmp_path):
    """Chaos seed 2812, trial 22: rank 0's worker crashed in step 1's optimizer, after the
    commit vote; restarted, it rejoined as rank 0 at step 2 without step 1, and wrote steps
    2.. while the survivors, who kept step 1, never write: step 1 was missing. A writer that
    joined late leaves a gap to the others, who append after each recovery."""
    from oobleck_hpc.records.progress import Progress

    path = tmp_path / "metrics.jsonl"
    survivor = Progress(total=4, log_every=1, metrics=path, run="r")
    survivor.record([Result(0)], "p0", 0, active=False)  # step 1 committed; rank 0 crashed
    rejoined = Progress(total=4, log_every=1, metrics=path, run="r", joined=True)
    rejoined.record([Result(1)], "p1", 1, active=True)   # first: it has no step 1
    assert not path.read_text().strip()
    survivor.record([Result(1)], "p1", 1, active=False)  # a new generation: it appends
    rejoined.record([Result(2)], "p1", 1, active=True)
    survivor.record([Result(2)], "p1", 1, active=False)
    for p in (rejoined, survivor):
        p.record([Result(3)], "p1", 1, active=p is rejoined)
        p.finish()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4]


def test_a_recovery_is_named_by_what_left_or_came():
    from oobleck_hpc.records.report import what

    assert what({"lost": ["node2"], "joined": [], "drained": []}) == "lost node2"
    assert what({"lost": ["node3"], "joined": [], "drained": ["node3"]}) == "drained node3"
    assert what({"lost": ["node4"], "joined": ["node5"], "drained": []}) == "lost node4 +node5"
    assert what({"lost": [], "joined": ["node5"], "drained": []}) == "+node5"  # a grow
    assert what({"lost": [], "joined": [], "drained": []}) == "(retry)"
    assert what({"lost": ["node1"]}) == "lost node1"  # a report of records before joins


def test_a_tail_moves_past_each_line_as_it_is_read(tmp_path):
    """The fleet manager records how far it read a job's events after each event it handled:
    the offset is past that event and no further; a torn last line waits for its end."""
    path = tmp_path / "events.jsonl"
    lines = [json.dumps({"kind": "a", "i": i}) + "\n" for i in range(3)]
    path.write_text("".join(lines) + "not json\n" + '{"kind": "torn"')
    tail = Tail(path)
    seen = []
    for e in tail.read():
        seen.append((e["i"], tail.offset))
        if e["i"] == 1:
            break
    assert seen == [(0, len(lines[0])), (1, len(lines[0]) + len(lines[1]))]
    rest = Tail(path)
    rest.offset = tail.offset
    assert [e["i"] for e in rest.read()] == [2]
    assert rest.offset == len("".join(lines) + "not json\n")
    with open(path, "a") as f:
        f.write("}\n")
    assert [e["kind"] for e in rest.read()] == ["torn"]
