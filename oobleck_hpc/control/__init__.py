"""The agent side: one node agent per node; failure detection and agreement on who is still in
the job, over the control plane between the agents.

Standard library only (plus `config`, `files`, `errors`, `records` and the pure `planning`):
agents start in tens of milliseconds and never import torch (tests/unit/test_imports.py checks
it). The control plane is out of band -- plain TCP between the agents, never the training's
process groups -- authenticated with the run's secret, and has no single point of failure.

- `agent`         the per-node supervisor: `python -m oobleck_hpc.control.agent` owns its
                  node's workers, runs the control plane, relays memberships to the workers;
                  `agent_options`: its options and command line; `workers`: the worker
                  processes (environment, watching threads, kill).
- `membership`    the agreement protocol as a pure state machine (`MembershipCore`); its
                  docstring gives the message flow, what each timeout bounds and why two
                  survivors cannot decide differently; `decision`: what it agrees on (`Decision`,
                  `has_quorum`); `exchange`: the all-gathers that ride on it.
- `plane`         `ControlPlane`: the protocol over sockets (heartbeats, leases, probes,
                  fencing); `loop`: its one event-loop thread (selector, timers);
                  `links`: outgoing connections; `inbound`: accepted ones; `topology`: who watches whom (K rings) and
                  when silence becomes a suspicion.
- `auth`          the run's secret and the authenticated handshake; `wire`: framing and the
                  `Roster`; `messages`: every message's declared fields.
- `client`        `AgentClient`: what a worker process uses to talk to its agent (report a
                  failure as a value, wait for the next membership, exchange a digest).
- `drain`         a node leaving at a step boundary on notice (`oobleck-hpc drain`, Slurm's
                  DRAIN state); `faults`: the job file's injected failures (kill, hang, exit,
                  crash, drain, grow), fired from the workers and the agent.

May import: the standard library, `oobleck_hpc.{config,errors,files,polling,diagnostics}`,
`oobleck_hpc.records`, `oobleck_hpc.planning` (pure). Never torch, `recovery`, `engine`.
"""
