"""Event log and roster: the small files the control plane and every other module share."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest

from oobleck_hpc.records.events import NODE_DRAINED, SIGNAL, STOPPING, EventLog, read_events
from oobleck_hpc.control.wire import Roster
from oobleck_hpc.errors import ConfigError


def _writer(path: str, name: str, n: int) -> None:
    log = EventLog(path, source=name)
    for i in range(n):
        log.emit(STOPPING, step=i, reason="x" * 300)
    log.close()


@pytest.mark.timeout(60)
def test_concurrent_writers_never_interleave_lines(tmp_path):
    path = tmp_path / "run" / "events.jsonl"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(path), f"p{k}", 200)) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    lines = path.read_text().splitlines()
    assert len(lines) == 800
    events = [json.loads(line) for line in lines]  # every line is whole JSON
    for k in range(4):
        assert [e["step"] for e in events if e["source"] == f"p{k}"] == list(range(200))


def test_read_events_merges_sorts_and_skips_a_torn_line(tmp_path):
    a, b = EventLog(tmp_path / "events.a.jsonl", "a"), EventLog(tmp_path / "events.b.jsonl", "b")
    a.emit(SIGNAL, signal="first")
    b.emit(SIGNAL, signal="second")
    a.emit(SIGNAL, signal="third")
    with open(tmp_path / "events.b.jsonl", "a") as f:
        f.write('{"t": 1, "kind": "tor')  # a writer killed mid-line
    signals = [e["signal"] for e in read_events(tmp_path / "events.*.jsonl")]
    assert signals == ["first", "second", "third"]


def test_event_log_never_raises_into_the_caller(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", "x")
    (tmp_path / "events.jsonl").mkdir()  # cannot be opened as a file
    event = log.emit(SIGNAL, signal=object())
    assert event["kind"] == SIGNAL
    assert EventLog(None).emit(NODE_DRAINED, node="n1")["kind"] == NODE_DRAINED


def test_roster_roundtrip_default_store_port_and_order(tmp_path):
    data = {"nodes": [{"name": "b", "host": "10.0.0.2", "port": 4000},
                      {"name": "a", "host": "10.0.0.1", "port": 4000}]}
    r = Roster.from_dict(data)
    assert r.names == ("b", "a") and r.store_port == 4001
    assert r.order({"a", "b"}) == ("b", "a")  # roster order, not alphabetical
    r.write(tmp_path / "roster.json")
    assert Roster.load(tmp_path / "roster.json") == r


@pytest.mark.parametrize("data, key, words", [
    ({}, "nodes", "missing or empty"),
    ({"nodes": [{"name": "a", "host": "h"}]}, "nodes[0]", "not a node entry"),
    ({"nodes": [{"name": "a", "host": "h", "port": "80"}]}, "nodes[0].port", "not a port"),
    ({"nodes": [{"name": "a", "host": "h", "port": 1}, {"name": "a", "host": "i", "port": 2}]},
     "nodes", "more than once"),
    ({"nodes": [{"name": "a", "host": "h", "port": 1}], "store_port": 0}, "store_port", "not a port"),
])
def test_bad_roster_is_named_with_key_and_fix(data, key, words):
    with pytest.raises(ConfigError) as e:
        Roster.from_dict(data, source="roster.json")
    assert e.value.key == key and words in str(e.value) and "Fix:" in str(e.value)


def test_unreadable_roster_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        Roster.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{nodes")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Roster.load(tmp_path / "bad.json")
