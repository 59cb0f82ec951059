"""Table-driven scenarios: published measurements in, the same policies out.

A scenario file is YAML with one top-level key `simulation:` (a job file has none; that is how
`oobleck-hpc simulate` tells them apart). It gives, per policy, the measured throughput by node
count and the recovery constants, e.g. examples/bert-large-paper.yaml, the Oobleck artifact's
BERT-large comparison:

    simulation:
      name: bert-large-paper
      nodes: 30                    # nodes at time 0
      samples_per_iteration: 8192  # global batch
      every_minutes: 10            # default trace (the CLI's --trace/--mtbf/--every override it)
      duration_hours: 2.5
      oobleck:   {throughput: {30: 368.2, ..., 15: 192.3}, reconfiguration_s: 2, restart_s: 76}
      restart:   {throughput: {...}, restart_s: 76, checkpoint_s: 15.8, checkpoint_every_steps: 10}
      redundant: {throughput: {...}, useful: 0.197, reconfiguration_s: 76, restart_s: 76}

Throughput is samples/s of the whole job on that many nodes; a node count between table
entries uses the largest entry not above it (the extra nodes idle), a count below the smallest
entry cannot run (`stopped`). `useful` is the fraction of a redundant step that is not redundant
computation. `f` (oobleck, default 1): more than f failures inside one reconfiguration exceed the
guarantee, as does falling below the table's smallest node count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from oobleck_hpc.errors import ConfigError, GuaranteeExceeded
from oobleck_hpc.sim.engine import RunConfig


@dataclass(frozen=True)
class PolicyTable:
    throughput: dict[int, float]
    """Samples/s by node count."""
    restart_s: float = 0.0
    reconfiguration_s: float = 0.0
    checkpoint_s: float = 0.0
    checkpoint_every_steps: int = 0
    useful: float = 1.0
    f: int = 1


@dataclass(frozen=True)
class Scenario:
    name: str
    nodes: int
    samples_per_iteration: float
    policies: dict[str, PolicyTable]
    description: str = ""
    every_minutes: float | None = None
    mtbf_hours: float | None = None
    duration_hours: float = 24.0
    source: str = "<scenario>"


_POLICY_KEYS = {"throughput", "restart_s", "reconfiguration_s", "checkpoint_s",
                "checkpoint_every_steps", "useful", "f"}
_TOP_KEYS = {"name", "description", "nodes", "samples_per_iteration", "every_minutes",
             "mtbf_hours", "duration_hours", "oobleck", "restart", "redundant"}


def is_scenario_file(path: str | Path) -> bool:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and "simulation" in data


def _num(src: str, key: str, value: Any, lo: float = 0.0, integer: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and integer:
        ok = float(value).is_integer()
    if not ok or value < lo:
        kind = "an integer" if integer else "a number"
        raise ConfigError(src, key, f"value {value!r} is not {kind} >= {lo:g}",
                          f"write {kind} of at least {lo:g}")
    return int(value) if integer else float(value)


def load_scenario(path: str | Path) -> Scenario:
    src = str(path)
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(src, "<file>", f"cannot be read ({e.strerror})",
                          "pass an existing scenario or job YAML file") from e
    except yaml.YAMLError as e:
        raise ConfigError(src, "<file>", f"is not valid YAML ({e})", "fix the syntax") from e
    if not isinstance(data, dict) or set(data) != {"simulation"} or not isinstance(
            data["simulation"], dict):
        raise ConfigError(src, "<top>", "is not a scenario (one mapping under 'simulation:')",
                          "see examples/bert-large-paper.yaml")
    sim = data["simulation"]
    unknown = sorted(set(sim) - _TOP_KEYS, key=str)
    if unknown:
        raise ConfigError(src, f"simulation.{unknown[0]}", "is not a known key",
                          f"valid keys here are: {', '.join(sorted(_TOP_KEYS))}")
    for key in ("nodes", "samples_per_iteration"):
        if key not in sim:
            raise ConfigError(src, f"simulation.{key}", "is required but missing",
                              f"add '{key}:' to the simulation section")
    policies = {}
    for name in ("oobleck", "restart", "redundant"):
        if name not in sim:
            continue
        body = sim[name]
        where = f"simulation.{name}"
        if not isinstance(body, dict):
            raise ConfigError(src, where, f"is {body!r}, not a mapping", "give its keys indented")
        bad = sorted(set(body) - _POLICY_KEYS, key=str)
        if bad:
            raise ConfigError(src, f"{where}.{bad[0]}", "is not a known key",
                              f"valid keys here are: {', '.join(sorted(_POLICY_KEYS))}")
        table = body.get("throughput")
        if not isinstance(table, dict) or not table:
            raise ConfigError(src, f"{where}.throughput", f"value {table!r} is not a mapping of "
                              "node count to samples/s", "write e.g. {30: 368.2, 29: 362.2}")
        tput = {}
        for k, v in table.items():
            n = _num(src, f"{where}.throughput[{k!r}]", k, 1, integer=True)
            tput[int(n)] = _num(src, f"{where}.throughput[{k}]", v, 1e-12)
        kw: dict[str, Any] = {"throughput": dict(sorted(tput.items()))}
        for key in ("restart_s", "reconfiguration_s", "checkpoint_s"):
            if key in body:
                kw[key] = _num(src, f"{where}.{key}", body[key])
        if "checkpoint_every_steps" in body:
            kw["checkpoint_every_steps"] = int(_num(src, f"{where}.checkpoint_every_steps",
                                                    body["checkpoint_every_steps"], integer=True))
        if "f" in body:
            kw["f"] = int(_num(src, f"{where}.f", body["f"], integer=True))
        if "useful" in body:
            kw["useful"] = _num(src, f"{where}.useful", body["useful"], 1e-9)
            if kw["useful"] > 1:
                raise ConfigError(src, f"{where}.useful", f"value {body['useful']!r} exceeds 1",
                                  "give the non-redundant fraction of a step, in (0, 1]")
        policies[name] = PolicyTable(**kw)
    if not policies:
        raise ConfigError(src, "simulation", "names no policy",
                          "add at least one of oobleck:, restart:, redundant:")
    opt = {}
    for key in ("every_minutes", "mtbf_hours"):
        if sim.get(key) is not None:
            opt[key] = _num(src, f"simulation.{key}", sim[key], 1e-9)
    if "duration_hours" in sim:
        opt["duration_hours"] = _num(src, "simulation.duration_hours", sim["duration_hours"], 1e-9)
    return Scenario(name=str(sim.get("name", Path(path).stem)),
                    description=str(sim.get("description", "")),
                    nodes=int(_num(src, "simulation.nodes", sim["nodes"], 1, integer=True)),
                    samples_per_iteration=_num(src, "simulation.samples_per_iteration",
                                               sim["samples_per_iteration"], 1e-9),
                    policies=policies, source=src, **opt)


@dataclass
class TableBackend:
    """A PolicyTable as the backend of any policy (see sim/policies.py)."""

    table: PolicyTable
    samples: float
    label: str = field(default="")

    def plan(self, nodes: tuple[str, ...]) -> RunConfig | None:
        fits = [n for n in self.table.throughput if n <= len(nodes)]
        if not fits:
            return None
        use = max(fits)
        return RunConfig(self.samples / self.table.throughput[use], self.samples, use,
                         self.table.useful, f"{use} nodes")

    def restart_s(self, nodes: int) -> float:
        return self.table.restart_s

    def reconfiguration_s(self, nodes: int) -> float:
        return self.table.reconfiguration_s

    # in-place (oobleck) interface
    def reconfigure(self, lost: tuple[str, ...], alive: tuple[str, ...]) -> tuple[RunConfig, float]:
        if len(lost) > self.table.f:
            raise GuaranteeExceeded(f"{len(lost)} nodes lost within one reconfiguration, more "
                                    f"than f={self.table.f}.")
        run = self.plan(alive)
        if run is None:
            raise GuaranteeExceeded(f"{len(alive)} nodes left, below the smallest configuration "
                                    f"({min(self.table.throughput)} nodes).")
        return run, self.table.reconfiguration_s

    def grow(self, alive: tuple[str, ...]) -> tuple[RunConfig, float]:
        run = self.plan(alive)
        assert run is not None
        return run, self.table.reconfiguration_s

    def commit(self) -> None:
        pass

    def reset(self, nodes: tuple[str, ...]) -> None:
        pass


def scenario_backends(s: Scenario) -> dict[str, tuple[TableBackend, dict[str, Any]]]:
    """Per policy: its backend and its checkpoint settings (Policy keyword arguments)."""
    out = {}
    for name, table in s.policies.items():
        out[name] = (TableBackend(table, s.samples_per_iteration),
                     {"checkpoint_s": table.checkpoint_s,
                      "checkpoint_every_steps": table.checkpoint_every_steps})
    return out
