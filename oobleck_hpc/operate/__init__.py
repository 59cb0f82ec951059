"""What an operator does to jobs from another shell: act on a running job, watch it, qualify
recovery.

- `cli`           `oobleck-hpc kill-node | drain | grow | watch`.
- `kill`          kill or stop a node of a running local job (agent and workers at once).
- `watch`         the independent watchdog: restart a job that died or hung, from its checkpoint;
                  `liveness`: the job's side of it (job.lock, heartbeat, run.json, exit.json).
- `chaos`         `oobleck-hpc chaos JOB.yaml`: a campaign of random faults, each trial checked
                  against the fp64 reference; `chaos_oracle`: which outcomes a set of faults may
                  have on a job's plan.
"""
