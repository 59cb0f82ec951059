"""The control plane's protocol on the simulated network (oobleck_hpc/testing/netsim.py): the
agents' own MembershipCore and Monitor, every failure scenario of issue 14, safety checked on
every decision. Small sizes here (seconds); bench/control_plane.py --scale runs 1,024-16,384."""

from __future__ import annotations

import pytest

from oobleck_hpc.testing.netsim import Sim, scenarios

SCENARIOS = scenarios(f=3, switch=8)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_scenario_is_safe_and_live(name):
    r = Sim(48, seed=7).run_scenario(name, SCENARIOS[name])
    print(f"\n[figures] {r}")
    assert r["safe"] and r["live"], r
    if name in ("one_crash", "coordinator_crash", "hang"):
        # agreement within a few one-way delays of the detection, a few messages per agent
        assert r["agree_after_detect_delays"] <= 12, r
        assert r["msgs_per_event_per_agent"] <= 5, r
    if name == "hang":
        assert 2.0 <= r["detect_s"] <= 3.5, r  # the lease (3 s) after its last heartbeat


def test_steady_load_per_agent_does_not_grow_with_the_job():
    small, large = (Sim(n, seed=1).run_scenario("one_crash", SCENARIOS["one_crash"])
                    for n in (32, 512))
    ratio = large["msgs_per_agent_per_s_steady"] / small["msgs_per_agent_per_s_steady"]
    print(f"\n[figures] steady messages per agent per second: 32 nodes "
          f"{small['msgs_per_agent_per_s_steady']}, "
          f"512 nodes {large['msgs_per_agent_per_s_steady']}")
    assert 0.9 <= ratio <= 1.1
    assert large["msgs_per_event_per_agent"] <= small["msgs_per_event_per_agent"] + 1


def test_a_partition_leaves_the_majority_going_and_fences_the_minority():
    sim = Sim(30, seed=3)
    r = sim.run_scenario("partition", SCENARIOS["partition"])
    assert r["safe"] and r["live"], r
    # The minority cannot reach a quorum. Without workers it learns of the majority's silence
    # one coordinator at a time (each proposal goes to the first node not suspected, across the
    # cut, and fails after connect_timeout_s): 27 s here. In a job its workers' collectives
    # fail at once, and their probes suspect every silent member within probe_s.
    minority = sim.names[20:]
    t0 = sim.now
    while not all(sim.cores[m].fenced for m in minority) and sim.now < t0 + 60:
        sim.run_until(sim.now + 1.0)
    assert not sim.unsafe
    assert all(sim.cores[m].fenced and sim.cores[m].fence_code == 75 for m in minority)


def test_a_machine_wide_pause_over_the_lease_fences_nobody():
    """Every agent of the machine unscheduled for 1.5 leases together (a 2-core machine under
    load paused all agents for 4.5 s with lease_s = 3 in a chaos trial): each observer's lease
    excuses its own pause, so nobody excluded anybody, and no agent may fence itself on its
    pause alone -- two did, and the job fell back to its checkpoint."""
    sim = Sim(8, seed=5)
    sim.run_until(5.0)
    gen = {m: c.decided.gen for m, c in sim.cores.items()}
    for i, m in enumerate(sim.names):  # resumes within 0.2 s of each other
        sim.stop(m, 1.5 * sim.lease_s + 0.025 * i)
    sim.run_until(sim.now + 4 * sim.lease_s)
    assert not [m for m, c in sim.cores.items() if c.fenced], \
        {m: c.fenced for m, c in sim.cores.items()}
    assert {m: c.decided.gen for m, c in sim.cores.items()} == gen
    assert not sim.unsafe


def test_an_agent_paused_alone_is_fenced_by_its_peers_answer_when_it_resumes():
    """One agent unscheduled for 1.5 leases: its peers exclude it meanwhile, and the first
    heartbeat it sends on resuming is answered with FENCE -- it ends with exit 3 (its peers
    went on), at once and without a round of its own."""
    sim = Sim(8, seed=5)
    sim.run_until(5.0)
    x = sim.names[3]
    sim.stop(x, 1.5 * sim.lease_s)
    resume = sim.now + 1.5 * sim.lease_s
    others = tuple(m for m in sim.names if m != x)
    sim.run_until(resume)
    assert sim.agreed(others) is not None
    sim.run_until(resume + sim.heartbeat_s)
    core = sim.cores[x]
    assert core.fenced and core.fence_code == 3, core.fenced
    assert core.proposal is None and core.decided.nodes == sim.names
    assert not sim.unsafe
