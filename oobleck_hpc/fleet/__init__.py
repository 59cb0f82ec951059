"""Fleets: many training jobs sharing one pool of nodes (Unicron-like, issue 32).

- `allocate.py`  the decision, pure (numpy only): each job's node count that maximises the
                 fleet's WAF (weighted achieved FLOP/s) net of the moves' cost, solved exactly;
- `config.py`    the fleet file (`fleet.yaml`) as typed dataclasses, loaded strictly;
- `curves.py`    each job's WAF curve from its own planner (templates built once, instantiated
                 for every node count) and its model's FLOPs per sample;
- `cli.py`       `oobleck-hpc fleet plan FLEET.yaml --nodes N`.

What is built: the decision and `fleet plan`. Not yet: `fleet run` / `fleet submit` (a manager
that moves nodes between running jobs) and `simulate --fleet`.

Imports: config, errors, schema, planning, profiling (profiles), models' configs (pure data),
sim.planner_backend (the planner as a throughput for any node count). Never torch, h5py at
import, mpi4py, submitit, nor the worker or agent side (recovery, engine, control, launch): the
decision is arithmetic, testable in milliseconds.
"""
