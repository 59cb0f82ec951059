"""Elastic layer: failure detection, agreement on survivors, (later) reconfiguration and transfer.

The control plane is out of band -- plain TCP between one agent per node, stdlib only, never the
training process groups -- and has no single point of failure:

- `membership`  the agreement protocol as a pure state machine (`MembershipCore`, `Decision`,
                `Fenced`, `Superseded`); its docstring gives the message flow, what each timeout
                bounds and why two survivors cannot decide differently.
- `control`     `ControlPlane`: the protocol over sockets (heartbeats, leases, probes, fencing);
                `links`: its outgoing connections; `topology`: who watches whom (K rings) and
                when silence becomes a suspicion.
- `client`      `AgentClient`, `Membership`: what a worker process uses to talk to its agent
                (report a failure as a value, wait for the next membership, exchange a digest).
- `events`      `EventLog(path).emit(kind, **fields)`: the run's JSONL event file, for every module.
- `wire`        message framing and the `Roster` (the launcher's node list: name -> host:port).
- `driver`      `ElasticDriver`: a worker's steps, transactional, recovering in place
                (`recovery`: the rounds; `rendezvous`: a generation's store; `transfer`: layer
                state between replicas; `faults`: the job file's injected failures).

The agent process itself is `python -m oobleck_hpc.agent` (oobleck_hpc/agent.py). Nothing here
imports torch: workers pay for torch, agents start in tens of milliseconds.
"""
