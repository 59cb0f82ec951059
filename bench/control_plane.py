"""Control-plane latency: node failure -> detection -> every survivor agreed on the new membership.

    python bench/control_plane.py --json                     # 8 nodes x 2 workers, 5 repetitions
    python bench/control_plane.py --json --nodes 16 --reps 3

Real processes (oobleck_hpc.launch.local_agents.LocalAgents with echo workers, no torch): per
repetition a fresh set of agents, then

    kill     SIGKILL of one node's process group (agent + workers, as when a machine dies):
             detect_s = kill -> first failure_detected event of any survivor,
             agree_s  = kill -> the LAST survivor's agreement_reached event (all survivors hold the
                        same generation: the decision the reconfiguration starts from)
    hang     SIGSTOP of another node (it keeps its sockets open: only the lease catches it):
             the same two figures; bounded by lease_s (+ one heartbeat)

Medians and maxima over the repetitions. Targets: kill agree_s <= 0.5 s (the recovery budget of
issue 5 is 5 s in total), hang agree_s <= lease_s + heartbeat_s.

    python bench/control_plane.py --json --steady 8,32,128     # steady load, no failure

`--steady N,...`: N control planes in this process (real sockets on loopback, no agents or
workers), each left running `--seconds` after all have heard from their subjects: messages
sent + received per agent per second, and the most sockets and threads one agent holds. The
monitoring topology (control/topology.py) keeps all three constant in N; the full mesh before
it had every agent heartbeat every other: 2 (N - 1) / heartbeat_s messages per agent per second
(`full_mesh_msgs_per_agent_per_s`, the formula) and N - 1 links with a thread each.

    python bench/control_plane.py --json --real 512      # failures among 512 control planes

`--real N`: N control planes in this process as above; then one is killed (`close()`: its
sockets close, as a SIGKILLed agent's do) and, once the survivors agreed, another hangs (its
lock held for lease_s + 2 s: it neither sends nor answers, its sockets stay open, as under
SIGSTOP). kill_agree_s / hang_agree_s: the failure -> the last survivor's decision of the view
without the node; max_sockets_per_agent / max_threads_per_agent: the most one agent held,
sampled after each agreement (while the round's links are still open).

    python bench/control_plane.py --json --scale [--sizes 1024,4096,16384] [--scenarios ...]
                                  [--jobs J]

`--scale`: {"simulated": [...], "real": {...}}. simulated: the agents' own protocol code on a
discrete-event network model (oobleck_hpc/testing/netsim.py: 100 us latency + up to 100 us
jitter), every scenario at every size: detect_s, agree_s, agree_after_detect_delays (agreement
after detection, in mean one-way delays), msgs_per_agent_per_s_steady (sent), msgs_per_event_
per_agent, live, safe. real: `--real` control planes (default 256) as above.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from oobleck_hpc.control.plane import ControlPlane
from oobleck_hpc.records import events as ev
from oobleck_hpc.records.events import read_events
from oobleck_hpc.launch.local_agents import LocalAgents
from oobleck_hpc.control.wire import NodeAddress, Roster, free_ports
from oobleck_hpc.testing.netsim import Sim, scenarios

SECRET = bytes.fromhex(os.environ.get("BENCH_SECRET") or os.urandom(32).hex())
"""The run secret of the control planes (every connection proves it: auth.py); the host
processes of --real inherit it ($BENCH_SECRET)."""


def wait_view(run_dir: Path, nodes: list[str], timeout: float) -> list[dict]:
    """The agreement_reached events of every node in `nodes` for the view `nodes`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = read_events(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
        got = {e["source"]: e for e in events
               if e["kind"] == ev.AGREEMENT_REACHED and e["nodes"] == nodes}
        if all(m in got for m in nodes):
            gens = {got[m]["gen"] for m in nodes}
            if len(gens) != 1:
                raise RuntimeError(f"survivors decided {nodes} as different generations {gens}")
            return [got[m] for m in nodes]
        time.sleep(0.02)
    raise TimeoutError(f"view {nodes} not agreed within {timeout} s (see {run_dir})")


def wait_started(agents: LocalAgents, timeout: float) -> None:
    """Until every agent has started all its workers (their gen-0 exchange is done)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [p for p in (agents.run_dir / "workers").glob("*.jsonl")
                if '"exchange"' in p.read_text()] if (agents.run_dir / "workers").exists() else []
        if len(done) == len(agents.names) * agents.workers:
            return
        time.sleep(0.05)
    raise TimeoutError(f"agents did not start within {timeout} s")


def measure(run_dir: Path, lost: str, survivors: list[str], t: float, timeout: float) -> dict:
    decided = wait_view(run_dir, survivors, timeout)
    events = read_events(run_dir / "events.jsonl")
    detect = min(e["t"] for e in events if e["kind"] == ev.FAILURE_DETECTED and e["node"] == lost)
    return {"detect_s": detect - t, "agree_s": max(e["t"] for e in decided) - t}


def steady(n: int, seconds: float, heartbeat_s: float, lease_s: float) -> dict:
    """`n` control planes in this process, no failure: their load once every lease is held."""
    cps = planes(n, heartbeat_s, lease_s)
    try:
        time.sleep(2 * heartbeat_s)
        before = sum(cp.sent + cp.received for cp in cps)
        time.sleep(seconds)
        msgs = sum(cp.sent + cp.received for cp in cps) - before
        held = [cp.resources() for cp in cps]
        suspected = sorted({s for cp in cps for s in cp.core.suspects})
    finally:
        stop(cps)
    if suspected:
        raise RuntimeError(f"{n} control planes without a failure suspected {suspected}")
    return {"nodes": n, "msgs_per_agent_per_s": round(msgs / n / seconds, 2),
            "full_mesh_msgs_per_agent_per_s": round(2 * (n - 1) / heartbeat_s, 2),
            "max_sockets_per_agent": max(h["sockets"] for h in held),
            "max_threads_per_agent": max(h["threads"] for h in held)}


def planes(n: int, heartbeat_s: float, lease_s: float, on_decided=None) -> list[ControlPlane]:
    """`n` started control planes on loopback, each with the view it decided: `on_decided(me,
    gen, nodes)` is called as it decides (with its lock held)."""
    *ports, store = free_ports(n + 1)
    roster = Roster(tuple(NodeAddress(f"n{i}", "127.0.0.1", p) for i, p in enumerate(ports)), store)

    def note(me):
        return lambda kind, f: on_decided(me, f["gen"], tuple(f["nodes"])) \
            if kind == "decided" and on_decided else None
    cps = [ControlPlane(m, roster, secret=SECRET, heartbeat_s=heartbeat_s, lease_s=lease_s,
                        startup_s=120,
                        on_note=note(m)) for m in roster.names]
    for cp in cps:
        cp.start()
    deadline = time.monotonic() + 120
    while not all(cp.detector.subjects and set(cp.detector.subjects) <= set(cp.detector.last_heard)
                  for cp in cps):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} control planes did not all hear their subjects")
        time.sleep(0.1)
    return cps


def stop(cps: list[ControlPlane]) -> None:
    for cp in cps:  # all stop first: else each close is a failure the others act on
        cp._stop.set()
    for cp in cps:
        cp.close()


def serve(roster_path: str, first: int, last: int, heartbeat_s: float, lease_s: float) -> None:
    """A host process of `real`: the control planes of roster nodes first..last-1. Prints one
    JSON line when all of them heard their subjects, one per decision ({me, gen, out: the
    roster nodes outside the view, t}), and on "peak" from stdin the most sockets and threads
    one of them held; ends on end of input."""
    sys.setswitchinterval(0.001)  # many agents share this process's GIL: hand it over sooner
    roster = Roster.load(roster_path)
    names = roster.names[first:last]
    lock = threading.Lock()

    def say(**fields) -> None:
        with lock:
            print(json.dumps(fields), flush=True)

    def note(me):
        def on_note(kind, f):
            if kind == "decided":
                say(me=me, gen=f["gen"], out=sorted(set(roster.names) - set(f["nodes"])),
                    t=time.monotonic())
        return on_note

    cps = [ControlPlane(m, roster, secret=SECRET, heartbeat_s=heartbeat_s, lease_s=lease_s,
                        startup_s=120,
                        on_note=note(m)) for m in names]
    for cp in cps:
        cp.start()
    while not all(cp.detector.subjects and set(cp.detector.subjects) <= set(cp.detector.last_heard)
                  for cp in cps):
        time.sleep(0.1)
    say(ready=len(cps))
    for line in sys.stdin:
        if line.strip() == "peak":
            peaks = [cp.resources(peak=True) for cp in cps]
            say(sockets=max(p["sockets"] for p in peaks), threads=max(p["threads"] for p in peaks))
    stop(cps)


def real(n: int, heartbeat_s: float, lease_s: float, procs: int) -> dict:
    """`n` control planes in `procs` host processes, and two more in a process of their own
    each: SIGKILL of one, then (once every survivor agreed) SIGSTOP of the other. Times from the
    signal to the last survivor's decision of the view without the node."""
    import queue
    import subprocess

    base = Path(tempfile.mkdtemp(prefix="bench-control-plane-"))
    *ports, store = free_ports(n + 1)
    roster = Roster(tuple(NodeAddress(f"n{i}", "127.0.0.1", p) for i, p in enumerate(ports)), store)
    roster.write(base / "roster.json")
    victims = [n // 2, n // 3]
    cuts = sorted({0, n, *victims, *(v + 1 for v in victims),
                   *(i * n // procs for i in range(1, procs))})
    lines: queue.SimpleQueue = queue.SimpleQueue()
    hosts: dict[int, subprocess.Popen] = {}
    for first, last in zip(cuts, cuts[1:]):
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(base / "roster.json"), f"{first}:{last}",
             "--heartbeat-s", str(heartbeat_s), "--lease-s", str(lease_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
            env={**os.environ, "BENCH_SECRET": SECRET.hex()})
        hosts[first] = proc
        threading.Thread(target=lambda p=proc: [lines.put(json.loads(x)) for x in p.stdout],
                         daemon=True).start()

    def wait(until, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            try:
                msg = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{what}: not within {timeout} s") from None
            got.append(msg)

    got: list[dict] = []
    try:
        wait(lambda: sum(m.get("ready", 0) for m in got) == n, 300, f"{n} planes starting")
        out: list[str] = []
        figures = {}
        for kind, sig, victim in (("kill", signal.SIGKILL, victims[0]),
                                  ("hang", signal.SIGSTOP, victims[1])):
            out = sorted([*out, f"n{victim}"])
            survivors = n - len(out)
            t = time.monotonic()
            hosts[victim].send_signal(sig)

            def agreed():
                return len({m["me"] for m in got if m.get("out") == out}) == survivors
            wait(agreed, 30 if kind == "kill" else lease_s * 3 + 10, f"{kind}: all survivors")
            figures[f"{kind}_agree_s"] = round(max(m["t"] for m in got if m.get("out") == out) - t, 4)
        held = []
        for first, proc in hosts.items():
            if first not in victims:
                proc.stdin.write("peak\n")
                proc.stdin.flush()
        wait(lambda: len([m for m in got if "sockets" in m]) == len(hosts) - 2, 30, "peaks")
        held = [m for m in got if "sockets" in m]
    finally:
        for first, proc in hosts.items():
            if first in victims:
                proc.kill()
            else:
                proc.stdin.close()
        for proc in hosts.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(base, ignore_errors=True)
    return {"agents": n, "processes": len(hosts), **figures,
            "max_sockets_per_agent": max(h["sockets"] for h in held),
            "max_threads_per_agent": max(h["threads"] for h in held)}


def simulate(n: int, name: str, heartbeat_s: float, lease_s: float) -> dict:
    """One simulated scenario (`--scale`), with its wall time. The cyclic garbage collector is
    off: the agents' state is millions of long-lived objects that its full passes would walk
    again and again (6x the whole simulation at 16,384 nodes), and nothing here needs it."""
    t = time.perf_counter()
    gc.disable()
    sim = Sim(n, seed=1, heartbeat_s=heartbeat_s, lease_s=lease_s)
    gc.freeze()
    out = sim.run_scenario(name, scenarios()[name])
    return {**out, "wall_s": round(time.perf_counter() - t, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--heartbeat-s", type=float, default=0.5)
    ap.add_argument("--lease-s", type=float, default=3.0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--steady", help="node counts, e.g. 8,32,128: steady load instead of failures")
    ap.add_argument("--seconds", type=float, default=10.0, help="--steady: measured seconds")
    ap.add_argument("--real", type=int, help="control planes: a kill and a hang among them")
    ap.add_argument("--procs", type=int, default=8, help="--real: host processes")
    ap.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)  # ROSTER FIRST:LAST (real())
    ap.add_argument("--scale", action="store_true", help="simulated sizes and --real planes")
    ap.add_argument("--sizes", default="1024,4096,16384", help="--scale: simulated node counts")
    ap.add_argument("--scenarios", default=",".join(scenarios()), help="--scale: which ones")
    ap.add_argument("--jobs", type=int, default=1, help="--scale: scenarios run at once "
                    "(one process each; 16,384 nodes take ~5 GB each)")
    a = ap.parse_args()
    if a.serve:
        first, last = map(int, a.serve[1].split(":"))
        serve(a.serve[0], first, last, a.heartbeat_s, a.lease_s)
        return 0
    if a.scale:
        runs = [(n, name, a.heartbeat_s, a.lease_s) for n in map(int, a.sizes.split(","))
                for name in a.scenarios.split(",")]
        # Each scenario in a process of its own (`--jobs` at once), its memory freed after it.
        with ProcessPoolExecutor(a.jobs, max_tasks_per_child=1) as pool:
            pending = [pool.submit(simulate, *r) for r in runs]
            for done in as_completed(pending):  # progress: a large size takes minutes
                print(json.dumps(done.result()), file=sys.stderr, flush=True)
            sims = [{k: v for k, v in p.result().items() if k != "wall_s"} for p in pending]
        out = {"simulated": sims, "real": (None if a.real == 0 else  # --real 0: simulated only
                                           real(a.real or 512, a.heartbeat_s, a.lease_s, a.procs)),
               "host": platform.node(), "python": platform.python_version()}
        print(json.dumps(out) if a.json else json.dumps(out, indent=1))
        return 0
    if a.real:
        out = {"real": real(a.real, a.heartbeat_s, a.lease_s, a.procs), "heartbeat_s": a.heartbeat_s,
               "lease_s": a.lease_s, "host": platform.node(), "python": platform.python_version()}
        print(json.dumps(out) if a.json else out)
        return 0
    if a.steady:
        rows = [steady(int(n), a.seconds, a.heartbeat_s, a.lease_s) for n in a.steady.split(",")]
        out = {"steady": rows, "heartbeat_s": a.heartbeat_s, "lease_s": a.lease_s,
               "host": platform.node(), "python": platform.python_version()}
        print(json.dumps(out) if a.json else "\n".join(map(str, rows)))
        return 0
    if a.nodes < 3:
        ap.error("--nodes must be at least 3 (one killed, one hung, one left)")
    worker = [sys.executable, "-m", "oobleck_hpc.testing.echo_worker"]
    figures: dict[str, list[float]] = {"kill_detect_s": [], "kill_agree_s": [],
                                       "hang_detect_s": [], "hang_agree_s": []}
    base = Path(tempfile.mkdtemp(prefix="bench-control-plane-"))
    try:
        for rep in range(a.reps):
            run_dir = base / f"rep{rep}"
            agents = LocalAgents.start(run_dir, a.nodes, a.workers, command=worker,
                                       heartbeat_s=a.heartbeat_s, lease_s=a.lease_s)
            try:
                wait_started(agents, timeout=120)
                names = agents.names
                killed = names[1 + rep % (a.nodes - 1)]
                survivors = [m for m in names if m != killed]
                f = measure(run_dir, killed, survivors, agents.kill(killed), timeout=30)
                figures["kill_detect_s"].append(f["detect_s"])
                figures["kill_agree_s"].append(f["agree_s"])
                hung = survivors[-1]
                survivors = [m for m in survivors if m != hung]
                f = measure(run_dir, hung, survivors, agents.signal(hung, signal.SIGSTOP),
                            timeout=a.lease_s * 3 + 10)
                figures["hang_detect_s"].append(f["detect_s"])
                figures["hang_agree_s"].append(f["agree_s"])
            finally:
                agents.cleanup()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out = {
        "nodes": a.nodes, "workers_per_node": a.workers, "reps": a.reps,
        "heartbeat_s": a.heartbeat_s, "lease_s": a.lease_s,
        **{k: round(statistics.median(v), 4) for k, v in figures.items()},
        "max": {k: round(max(v), 4) for k, v in figures.items()},
        "target_kill_agree_s": 0.5, "target_hang_agree_s": a.lease_s + a.heartbeat_s,
        "host": platform.node(), "python": platform.python_version(),
    }
    out["target_met"] = (out["max"]["kill_agree_s"] <= 0.5
                         and out["max"]["hang_agree_s"] <= a.lease_s + a.heartbeat_s)
    if a.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:22s} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
