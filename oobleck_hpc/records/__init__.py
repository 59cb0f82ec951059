"""The run's records and their readers: what happened, written once, read by every command.

- `events`    the run's event log (`RUN_DIR/events.jsonl`): every kind declared with its fields
              (`EVENTS`); the writer refuses an undeclared one.
- `runs`      run records: which run and attempt wrote a record, the run's outcome ("finished"
              means the last step is committed: one function for every launcher and reader),
              the requeue record, private files.
- `progress`  the console and `metrics.jsonl`, as the current plan's rank 0 reports them.
- `story`     the run as a user reads it: one line per event that matters.
- `report`    `oobleck-hpc report RUN_DIR`: the story after the fact, with figures and a plot.

No torch: agents, launchers and workers all write here. May import: the standard library, tqdm
(the console bar), yaml (job.yaml), matplotlib (`report`'s plot, when asked),
`oobleck_hpc.{errors,files}`, and `control.auth` (a new run's secret, in `runs.begin_run`).
"""
