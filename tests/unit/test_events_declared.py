"""Every event kind is declared once (oobleck_hpc/records/events.py): the writer refuses what its
declaration does not say, and every kind written or read anywhere in the package and the benches
is declared -- a typo in a writer or a reader fails here, not in a report that silently lacks it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from oobleck_hpc.records import events
from oobleck_hpc.records.events import KINDS, EventLog

ROOT = Path(__file__).resolve().parents[2]
NOT_EVENTS = {("bench/slurm.py", "membership")}  # a row of the echo worker's own record file
SOURCES = sorted([*(ROOT / "oobleck_hpc").rglob("*.py"), *(ROOT / "bench").rglob("*.py")])


def _is_kind_of_event(node: ast.AST) -> bool:
    """`e["kind"]` or `e.get("kind")` (an event's kind)."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "kind"
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get" and bool(node.args)
            and isinstance(node.args[0], ast.Constant) and node.args[0].value == "kind")


def _literals(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [x for elt in node.elts for x in _literals(elt)]
    if isinstance(node, ast.IfExp):
        return _literals(node.body) + _literals(node.orelse)
    return []


def _kinds_named(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, kind) of every kind written (`.emit("kind", ...)`) or read (`e["kind"] == "x"`,
    `e.get("kind") in ("x", "y")`) as a literal, and of every `events.NAME` constant used."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "emit" and node.args):
            found += [(node.lineno, k) for k in _literals(node.args[0])]
        elif isinstance(node, ast.Compare) and _is_kind_of_event(node.left):
            found += [(node.lineno, k) for c in node.comparators for k in _literals(c)]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in ("events", "ev") and node.attr.isupper()):
            kind = getattr(events, node.attr, None)
            found.append((node.lineno, kind if isinstance(kind, str) else f"<events.{node.attr}>"))
    return sorted(found)


def test_every_kind_written_or_read_is_declared():
    named = [(path.relative_to(ROOT), line, kind) for path in SOURCES
             for line, kind in _kinds_named(ast.parse(path.read_text()))]
    assert len({kind for _, _, kind in named}) > 40  # the scan sees the writers and readers
    undeclared = [f"{path}:{line} {kind!r}" for path, line, kind in named
                  if kind not in KINDS and (str(path), kind) not in NOT_EVENTS]
    assert undeclared == []


def test_the_scan_catches_a_typo():
    tree = ast.parse('log.emit("failure_detcted", node="n")\n'
                     'x = [e for e in evs if e["kind"] == "recoverd"]\n'
                     'y = events.RECOVERD\n')
    assert [kind for _, kind in _kinds_named(tree)] == ["failure_detcted", "recoverd",
                                                         "<events.RECOVERD>"]


def test_every_declaration_names_itself_and_says_what_it_means():
    for name, kind in KINDS.items():
        assert kind.name == name and kind.doc.endswith(".")
        assert not kind.fields.keys() & kind.optional.keys()
        assert not kind.fields.keys() & {"t", "kind", "source", "run", "attempt"}


@pytest.mark.parametrize("kind, fields, why", [
    ("failure_detcted", {"node": "n1", "how": "lease", "gen": 1}, "not declared"),
    (events.FAILURE_DETECTED, {"node": "n1", "how": "lease"}, "missing fields ['gen']"),
    (events.FAILURE_DETECTED, {"node": "n1", "how": "lease", "gen": 1, "nod": "n2"},
     "undeclared fields ['nod']"),
])
def test_the_writer_refuses_what_the_declaration_does_not_say(tmp_path, kind, fields, why):
    log = EventLog(tmp_path / "events.jsonl", "node0")
    with pytest.raises(TypeError, match=re.escape(why)):
        log.emit(kind, **fields)
    assert not (tmp_path / "events.jsonl").exists()


def test_optional_fields_may_be_left_out(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", "node0")
    assert log.emit(events.AGENT_EXIT, code=0, reason="done")["code"] == 0
    assert log.emit(events.AGENT_EXIT, code=0, reason="done", how="early")["how"] == "early"


def _kind_of(node: ast.AST) -> str | None:
    """The kind an emit call's first argument names: a literal, `events.NAME`, or a bare NAME
    that events declares (imported from it); None when it is computed."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
    value = getattr(events, name, None) if name and name.isupper() else None
    return value if isinstance(value, str) else None


def test_every_writer_passes_the_fields_its_kind_declares():
    """The writer's check, done on the source of every `.emit(...)` call: a call that would
    raise (a missing or undeclared field) on a path no test takes fails here. Calls whose kind
    is computed, or whose fields are spread from a dict, are only checked at run time; they
    must stay few (listed in the failure message)."""
    wrong, dynamic, checked = [], [], 0
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "emit" and node.args):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            kinds = _literals(node.args[0]) or [_kind_of(node.args[0])]
            if None in kinds or any(k.arg is None for k in node.keywords):
                dynamic.append(where)
                continue
            names = {k.arg for k in node.keywords}
            for kind in kinds:
                if kind not in KINDS or (str(path.relative_to(ROOT)), kind) in NOT_EVENTS:
                    continue  # (undeclared kinds: test_every_kind_written_or_read_is_declared)
                checked += 1
                try:
                    events.check(kind, dict.fromkeys(names))
                except TypeError as e:
                    wrong.append(f"{where}: {e}")
    assert checked > 50, checked  # the scan sees the writers
    assert wrong == []
    assert len(dynamic) <= 3, dynamic
