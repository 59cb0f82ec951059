"""Goodput simulator: oobleck vs checkpoint-restart (Varuna-like) vs redundancy (Bamboo-like).

"Is this worth it for my job, at my failure rate?" A job replays a failure trace under each
policy; every simulated second is booked to one category (effective training, redundant
computation, idle nodes, checkpointing, reconfiguration, restart, lost work, stopped), so the
shares add up to the simulated time exactly.

- `trace.py`           traces: fixed interval, exponential (per node or per cluster), correlated
                       bursts, CSV/JSONL replay
- `engine.py`          the event-driven engine and its accounting
- `policies.py`        the three policies as documented models
- `scenario.py`        table-driven scenarios (published measurements; the paper preset)
- `planner_backend.py` the same policies driven by our planner and profiles
- `records/report.py`          table, JSON, plot; `cli.py` the `oobleck-hpc simulate` command

Fleets of jobs on one pool replay these policies per job: fleet/simulate.py (`simulate --fleet`).

Nothing here imports torch, h5py, mpi4py or submitit (matplotlib only for --plot).

    from oobleck_hpc.sim import run_policies
    results = run_policies(backends, trace, duration_s)    # {policy: PolicyResult}
"""

from __future__ import annotations

from oobleck_hpc.sim.engine import CATEGORIES, PolicyResult, RunConfig, simulate
from oobleck_hpc.sim.policies import POLICIES
from oobleck_hpc.sim.trace import Trace, TraceEvent, exponential, fixed_interval, load_trace


def run_policies(backends: dict[str, tuple[object, dict]], trace: Trace, duration_s: float,
                 policies: tuple[str, ...] = ("oobleck", "restart", "redundant"),
                 ) -> dict[str, PolicyResult]:
    """Replay `trace` for `duration_s` under each named policy; `backends` maps a policy name
    to (backend, checkpoint keyword arguments), as scenario_backends/planner_backends return."""
    out = {}
    for name in policies:
        backend, kw = backends[name]
        out[name] = simulate(POLICIES[name](backend, **kw), trace, duration_s)
    return out


__all__ = ["CATEGORIES", "POLICIES", "PolicyResult", "RunConfig", "Trace", "TraceEvent",
           "exponential", "fixed_interval", "load_trace", "run_policies", "simulate"]
