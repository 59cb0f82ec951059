"""Test and benchmark support that ships with the package but that production code never
imports (tests/unit/test_imports.py checks it):

- `harness`: `WorkerPool`, long-lived worker processes that run plan after plan (the engine's
  multi-process tests and bench/engine.py: importing torch once per process, not per case).
- `echo_worker`: the smallest worker that follows the agent interface, without torch (the
  control plane's tests and benchmarks: `python -m oobleck_hpc.testing.echo_worker`).
- `netsim`: the control plane's protocol (the agents' own MembershipCore and Monitor) on a
  simulated network, thousands of agents in one process (tests/unit/test_netsim.py,
  bench/control_plane.py --scale).
"""
