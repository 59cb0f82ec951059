"""How a job gets onto machines: local processes (local.py, with local_agents.py: node agents as
local process groups) or Slurm through submitit (slurm.py; slurm_task.py, supervise.py: what runs
inside the allocation; requeue.py: the local requeue).

`oobleck_hpc.launch.submit(job)` is the Slurm entry point of the Python API; submitit is imported
only when it is called (launch/slurm.py is the only module importing it).
"""

from __future__ import annotations

from typing import Any


def submit(job: Any, **kwargs: Any) -> Any:
    """Submit `job` (a JobConfig) to Slurm; returns the submitit Job. See launch/slurm.py."""
    from oobleck_hpc.launch.slurm import submit as submit_to_slurm

    return submit_to_slurm(job, **kwargs)
