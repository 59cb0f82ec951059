"""Fleets: many training jobs sharing one pool of nodes (Unicron-like, issue 32).

- `allocate.py`  the decision, pure (numpy only): each job's node count that maximises the
                 fleet's WAF (weighted achieved FLOP/s) net of the moves' cost, solved exactly;
- `config.py`    the fleet file (`fleet.yaml`) as typed dataclasses, loaded strictly;
- `curves.py`    each job's WAF curve from its own planner (templates built once, instantiated
                 for every node count) and its model's FLOPs per sample;
- `cli.py`       `oobleck-hpc fleet plan FLEET.yaml --nodes N` and `fleet status`;
- `simulate.py`  the same decision replayed on failure traces (`oobleck-hpc simulate --fleet`):
                 the manager vs every job healing on its own vs checkpoint-restart, each job
                 one of the simulator's policies (sim/policies.py) on its curve;
- `report.py`    its table, JSON and plot (WAF over time, each job's nodes);
- `manager.py`   the manager of `fleet run`: each job's events in, drains and grows out (the
                 same decision, with the local limits on growing); launch/fleet.py starts the
                 jobs and enacts its moves (that side starts processes: not in this package);
- `status.py`    `oobleck-hpc fleet status RUN_DIR`: the manager's events told.

What is built: the decision, `fleet plan`, `simulate --fleet`, and `fleet run` / `fleet status`
on this machine. Not yet: `fleet submit` (a Slurm fleet), a manager restarted from its records.

Imports: config, errors, schema, planning, profiling (profiles), models' configs (pure data),
sim (the planner as a throughput for any node count; the simulator's engine, policies, traces
and plots). Never torch, h5py at import, mpi4py, submitit, nor the worker or agent side
(recovery, engine, control, launch): the decision is arithmetic, testable in milliseconds.
"""
