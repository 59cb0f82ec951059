"""The smallest worker that follows the agent <-> worker interface (control/client.py).

Used by the control-plane tests and as a template for a real worker, with no torch import:

- waits for each new membership generation and appends it to
  `<run_dir>/workers/<node>.<local_rank>.jsonl`;
- after each generation, all-gathers a digest of the decision it received over the control plane
  (`client.exchange`) and records what every node sent -- so a test can check that all
  survivors hold the same decision, the way the reconfigure driver checks its plan digest;
- polls `<run_dir>/ctl/`: a file `<node>.<local_rank>.report` (JSON {kind, detail, suspects})
  makes it report an in-band failure once; a file `<node>.<local_rank>.exit` (JSON {how:
  "leave"} or {how: "done", code, reason}) makes it leave the job early (`client.leave()`, exit
  0) or exit on purpose with `code`; a file `STOP` makes it say "done" and exit 0, after
  recording the run finished as a training run's rank 0 does (its `run_finished` event: the
  job's verdict is its record, oobleck_hpc/records/runs.py);
- exits with the fencing's exit code when fenced (3 excluded, 75 requeue, 2 bad input).

Run it under an agent:  python -m oobleck_hpc.control.agent ... -- python -m oobleck_hpc.testing.echo_worker
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

from oobleck_hpc.control.client import AgentClient, Membership
from oobleck_hpc.records.events import EventLog
from oobleck_hpc.control.membership import Fenced, Superseded


def digest(m: Membership) -> str:
    text = json.dumps([m.gen, m.nodes, m.store_node, m.store_host, m.store_port])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main() -> int:
    client = AgentClient.from_env()
    run_dir = Path(os.environ["OOBLECK_RUN_DIR"])
    me = f"{client.node}.{client.local_rank}"
    out_dir, ctl = run_dir / "workers", run_dir / "ctl"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = open(out_dir / f"{me}.jsonl", "a", buffering=1)

    def record(kind: str, **fields: object) -> None:
        out.write(json.dumps({"t": time.time(), "kind": kind, "pid": os.getpid(), **fields}) + "\n")

    gen = -1
    reported = False
    try:
        while True:
            if (ctl / "STOP").exists():
                record("stop")
                EventLog(run_dir / "events.jsonl", source=me).emit(
                    "run_finished", steps=max(gen, 0), total=max(gen, 0), model="echo")
                client.done(0)
                return 0
            leave = ctl / f"{me}.exit"
            if leave.exists():
                spec = json.loads(leave.read_text())
                record("exit", spec=spec)
                if spec["how"] == "leave":
                    client.leave()
                    return 0
                client.done(spec["code"], spec.get("reason", ""))
                return spec["code"]
            report = ctl / f"{me}.report"
            if not reported and report.exists():
                reported = True
                spec = json.loads(report.read_text())
                client.report_failure(spec.get("kind", "comm_error"), spec.get("detail", ""),
                                      spec.get("suspects", []))
                record("reported", spec=spec)
            try:
                m = client.wait_membership(after_gen=gen, timeout=0.1)
            except TimeoutError:
                continue
            gen = m.gen
            record("membership", gen=m.gen, nodes=list(m.nodes), lost=list(m.lost),
                   store=m.store_addr, store_node=m.store_node, hosts_store=client.hosts_store(m),
                   digest=digest(m))
            try:
                values = client.exchange(f"digest-{m.gen}", digest(m), timeout=30)
                record("exchange", gen=m.gen, values=values)
                client.training()  # the exchange stands for a committed step
            except Superseded as e:
                record("exchange_superseded", gen=m.gen, reason=str(e))
    except Fenced as e:
        record("fenced", reason=str(e), exit_code=e.exit_code)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
