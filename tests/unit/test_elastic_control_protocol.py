"""The membership protocol (oobleck_hpc/control/membership.py) under simulated networks.

No processes: N `MembershipCore`s exchange messages through per-link FIFO queues; a seeded random
scheduler interleaves deliveries, crashes, false suspicions (a slow node taken for dead) and
failure detection (each observer learns of a crash at its own random moment, possibly before the
crashed node's last messages arrive). Checked on every run:

- safety: two nodes that decided the same generation, each inside the other's decided view,
  decided the same view and the same store;
- liveness: once detection is complete and the network is quiet, every node still running
  (neither crashed nor fenced) holds the same decision, whose view is exactly those nodes, and
  no round is left open;
- no spurious generation: every decided generation loses or adds at least one node, unless a
  node asked for a retry in place of the generation before (`retry`: same view, fresh store) or
  joins were pending (two rounds opened for different joiners keep only the joiners both add);
- a falsely suspected node ends fenced (it never silently stays in) unless the node that
  suspected it is itself gone;
- with spares (nodes outside generation 0 that ask to join at random moments): a node that left
  a decided view never comes back into a later one, and every spare still running that asked
  to join is a member at the end, unless the job has all its nodes (then spares wait);
- with withdrawals (a member whose worker crashed steps out, `withdraw`, and asks to join again
  at a random later moment): the same, a withdrawn node being the only one that may come back;
- with drains (4e: a member other than its view's coordinator drains, `leave("drained")`, and
  each member is told at its own random moment, `drain_out`; a node still waiting once the
  network is quiet says BYE, as its agent does after lease_s): the drained nodes end outside
  every running node's view, with exit 0 unless something else ended them first.
"""

from __future__ import annotations

import itertools
import random
from collections import deque

import pytest

from oobleck_hpc.control.membership import DRAINED, Decision, MembershipCore


class SimNet:
    def __init__(self, n: int, seed: int, quorum: str = "majority", spares: int = 0,
                 withdraws: bool = False, drains: bool = False):
        self.rng = random.Random(seed)
        self.names = tuple(f"n{i}" for i in range(n + spares))
        ports = itertools.count(1000)
        hold = seed % 2 == 1  # half the schedules: coordinators hold re-broadcasts (flush)
        # a third of them: rounds that only add joiners wait for a step boundary (7b), which
        # comes at random (a commit vote, or the plane's JOIN_HOLD_S)
        boundary = seed % 3 == 0
        self.cores = {m: MembershipCore(m, self.names, 999, lambda: next(ports), quorum,
                                        members0=self.names[:n], hold_rebroadcasts=hold,
                                        joins_at_boundary=boundary)
                      for m in self.names}
        self.spares = self.names[n:]
        self.asked: set[str] = set()  # spares that asked to join
        self.withdraws = withdraws
        self.withdrew: set[str] = set()  # members that stepped out (they may come back)
        self.drains = drains
        self.draining: set[str] = set()  # members drained by a commit vote (4e)
        self.drain_told: set[tuple[str, str]] = set()  # (member, drained node) told
        self.links: dict[tuple[str, str], deque] = {(a, b): deque() for a in self.names for b in self.names if a != b}
        self.crashed: set[str] = set()
        self.detected: set[tuple[str, str]] = set()  # (observer, crashed) pairs already told
        self.decisions: dict[str, dict[int, Decision]] = {m: {} for m in self.names}
        self.false_suspicions: set[tuple[str, str]] = set()  # (suspecter, suspected)
        self.retried: set[int] = set()  # generations some node opened a retry round for
        self.joins_pending = False  # some node asked to join: a round may then change nothing
        self.sent = 0  # messages put on the links

    def hand_over(self, a: str, b: str) -> None:
        """Every message queued from a to b, handled by b (not drained: b's notes stay)."""
        while self.links[(a, b)]:
            self.cores[b].handle(a, self.links[(a, b)].popleft())

    def down(self, m: str) -> bool:
        return m in self.crashed or self.cores[m].fenced is not None

    def drain(self, m: str) -> None:
        core = self.cores[m]
        for dst, msg in core.outbox:
            self.links[(m, dst)].append(msg)
            self.sent += 1
        core.outbox.clear()
        for kind, fields in core.notes:
            if kind == "retry":
                self.retried.add(fields["gen"])
            if kind == "join_requested":
                self.joins_pending = True
            if kind == "decided":
                d = Decision.from_msg(fields)
                assert d.gen not in self.decisions[m], f"{m} decided generation {d.gen} twice"
                assert d.lost or d.joined or d.gen in self.retried or self.joins_pending, \
                    f"{m}: generation {d.gen} changes no node and nobody asked for a retry"
                assert set(d.joined) <= self.asked, f"{m}: {d.joined} joined without asking"
                self.decisions[m][d.gen] = d
        core.notes.clear()

    def step(self, chaos: bool) -> bool:
        """One random event; False when nothing is left to do."""
        options = []
        for (a, b), q in self.links.items():
            if q and not self.down(b):
                options.append(("deliver", a, b))
        for obs in self.names:
            if self.down(obs):
                continue
            core = self.cores[obs]
            if core.held:
                options.append(("flush", obs, ""))
            if core.joins_held:
                options.append(("boundary", obs, ""))
            watched = {*core.decided.nodes, *core.joiners, *core._round_adds}  # grows with joins
            if not core.joined and core.proposal is None:
                watched = set()  # a spare watches nobody until a round adds it
            for dead in self.names:
                # (once per pair; again for a dead node taken back as a joiner -- a withdrawn
                # node readmitted -- as its agent's links keep failing)
                again = dead in {*core.joiners, *core._round_adds} and dead not in core.suspects
                if dead in watched and self.down(dead) and ((obs, dead) not in self.detected
                                                            or again):
                    options.append(("detect", obs, dead))
            for d in self.draining:  # (every rank of the vote computes the drain: 4e)
                if core.joined and d in core.decided.nodes and (obs, d) not in self.drain_told:
                    options.append(("drain_out", obs, d))
        if chaos:
            alive = [m for m in self.names if not self.down(m)]
            options += [("crash", m, "") for m in alive] * 1
            pairs = [("false", a, b) for a in alive for b in alive if a != b]
            options += self.rng.sample(pairs, min(3, len(pairs)))
            options += [("retry", m, "") for m in alive]
            # a heartbeat (liveness only): also from a node excluded but not told yet, or one
            # that just withdrew -- its receiver may answer FENCE
            options += [("beat", a, b) for _, a, b in self.rng.sample(pairs, min(2, len(pairs)))]
            options += [("join", m, "") for m in alive if not self.cores[m].joined] * 2
            if self.withdraws:
                options += [("withdraw", m, "") for m in alive if self.cores[m].joined]
            if self.drains:  # (a drain of the coordinator itself says BYE: not this path)
                options += [("drain", m, "") for m in alive if self.cores[m].joined
                            and m != self.cores[m].decided.nodes[0] and m not in self.draining]
        if not options:
            return False
        kind, a, b = self.rng.choice(options)
        if kind == "deliver":
            msg = self.links[(a, b)].popleft()
            self.cores[b].handle(a, msg)
            self.drain(b)
        elif kind == "detect":
            self.detected.add((a, b))
            self.cores[a].suspect(b, "connection_lost")
            self.drain(a)
        elif kind == "crash":
            self.crashed.add(a)
            if self.rng.random() < 0.5:  # its unsent messages may be lost too
                for (x, _y), q in self.links.items():
                    if x == a and q and self.rng.random() < 0.5:
                        q.pop()
        elif kind == "flush":
            self.cores[a].flush()
            self.drain(a)
        elif kind == "boundary":  # (the held joiners taken, as at JOIN_HOLD_S: any member)
            self.cores[a].take_joiners()
            self.drain(a)
        elif kind == "join":
            self.asked.add(a)
            self.cores[a].request_join()
            self.drain(a)
        elif kind == "withdraw":
            self.withdrew.add(a)
            self.cores[a].withdraw("a worker crashed")
            self.drain(a)
        elif kind == "beat":
            self.links[(a, b)].append({"type": "heartbeat"})
        elif kind == "drain":
            self.draining.add(a)
            self.cores[a].leave("drained", 0)
            self.drain(a)
        elif kind == "drain_out":
            self.drain_told.add((a, b))
            self.cores[a].drain_out([b])
            self.drain(a)
        elif kind == "retry":
            self.cores[a].retry("a collective failed, every peer answered the probe")
            self.drain(a)
        elif kind == "false":
            self.cores[a].suspect(b, "lease_expired")
            if b in self.cores[a].suspects:  # not a node it does not watch (a spare outside)
                self.false_suspicions.add((a, b))
            self.drain(a)
        return True

    def check_safety(self) -> None:
        for a, b in itertools.combinations(self.names, 2):
            for g in set(self.decisions[a]) & set(self.decisions[b]):
                da, db = self.decisions[a][g], self.decisions[b][g]
                if a in db.nodes and b in da.nodes:
                    assert da == db, f"generation {g}: {a} decided {da}, {b} decided {db}"
        for m, decided in self.decisions.items():  # who left a view never comes back ...
            gone: set[str] = set()
            for g in sorted(decided):
                assert not gone & set(decided[g].nodes), f"{m}: {gone} back in generation {g}"
                gone |= set(decided[g].lost) - self.withdrew  # ... unless it withdrew

    def quiesce(self) -> None:
        """Deliver and detect until nothing is left; then a spare that asked to join and is not
        in yet asks again, of the members still running (a replacement reads the current view
        from the run directory), until none is left to ask (a few times: run() then checks)."""
        for _ in range(5):
            while self.step(chaos=False):
                pass
            late = [d for d in self.draining if not self.down(d)]
            for d in late:  # no decision without it: its agent says BYE after lease_s (4e)
                self.cores[d].leave("early", 0, "drained (late)")
                self.drain(d)
            while self.step(chaos=False):
                pass
            members = [m for m in self.names if not self.down(m) and self.cores[m].joined]
            waiting = [s for s in self.asked if not self.down(s) and not self.cores[s].joined]
            if not members or not waiting or len(members) >= len(self.names) - len(self.spares):
                return
            for s in waiting:
                self.cores[s].request_join(to=members)
                self.drain(s)


def run(n: int, seed: int, chaos_steps: int, quorum: str = "majority", spares: int = 0,
        withdraws: bool = False, drains: bool = False) -> SimNet:
    net = SimNet(n, seed, quorum, spares, withdraws, drains)
    for i in range(chaos_steps):
        net.step(chaos=net.rng.random() < 0.05)
    net.quiesce()
    net.check_safety()
    running = [m for m in net.names if not net.down(m) and net.cores[m].joined]
    waiting = [s for s in net.asked if not net.down(s) and not net.cores[s].joined]
    if running and waiting:  # spares wait only while the job has all its nodes
        assert len(running) >= n, f"{waiting} asked to join and are still outside {running}"
    if running:
        finals = {(net.cores[m].decided.gen, net.cores[m].decided.nodes) for m in running}
        assert len(finals) == 1, f"running nodes disagree: {finals}"
        (gen, nodes), = finals
        assert set(nodes) == set(running), f"decided {nodes} but running {running}"
        assert all(net.cores[m].proposal is None for m in running)
        for a, b in net.false_suspicions:  # (a node that withdrew may come back: 4d)
            assert b in net.withdrew or not (a in running and b in running), \
                f"{a} suspected {b}, yet both still run"
    return net


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7])
def test_random_schedules_are_safe_and_live(n):
    outcomes = set()
    for seed in range(300):
        net = run(n, seed, chaos_steps=40 * n)
        running = [m for m in net.names if not net.down(m)]
        outcomes.add(len(running))
    # The sweep must exercise real recoveries, not only total collapse or nothing at all.
    assert any(0 < k < n for k in outcomes), outcomes


@pytest.mark.parametrize("n, spares", [(3, 0), (4, 1), (5, 0), (7, 1)])
def test_random_schedules_with_nodes_withdrawing_and_rejoining_are_safe_and_live(n, spares):
    back = 0
    for seed in range(300):
        net = run(n, seed, chaos_steps=40 * (n + spares), spares=spares, withdraws=True)
        back += any(set(d.joined) & net.withdrew for ds in net.decisions.values()
                    for d in ds.values())
    assert back > 30, back  # the sweep must exercise rejoins


@pytest.mark.parametrize("n", [3, 4, 5, 7])
def test_random_schedules_with_nodes_drained_by_the_vote_are_safe_and_live(n):
    quiet = 0
    for seed in range(300):
        net = run(n, seed, chaos_steps=40 * n, drains=True)
        for d in net.draining - net.crashed:
            assert net.down(d), f"seed {seed}: {d} drains and still runs"
        quiet += sum(1 for d in net.draining
                     if net.cores[d].fence_code == 0 and "drained (told" in net.cores[d].fenced)
    assert quiet > 30, quiet  # the sweep must exercise drains decided away without a BYE


def recorded_notes(net: SimNet) -> dict[str, list]:
    """Every node's notes, kept as the net drains them (the cores' lists are emptied)."""
    notes: dict[str, list] = {m: [] for m in net.names}
    plain_drain = net.drain

    def drain(m):
        notes[m].extend(net.cores[m].notes)
        plain_drain(m)

    net.drain = drain
    return notes


def notes_of_kind(core: MembershipCore, kind: str) -> list[dict]:
    """The fields of `core`'s notes of `kind` not yet drained."""
    return [f for k, f in core.notes if k == kind]


def _vote(net: SimNet, key: str) -> None:
    """A commit vote of every member of n0's view, delivered to the end."""
    for m in net.cores["n0"].decided.nodes:
        net.cores[m].exchange(key, 1)
        net.drain(m)
    while net.step(chaos=False):
        pass


def test_a_node_drained_by_the_vote_is_decided_away_without_a_bye_and_exits_0():
    """4e: after the commit vote that drains n2, a survivor (n3) suspects it at once; its
    PROPOSE goes to the coordinator n0 only, whose broadcast follows the vote's values on
    every link. n2 says no BYE: it waits for the decision without it and ends with exit 0
    (not fenced); nobody sends it a FENCE."""
    net = SimNet(4, seed=3)
    _vote(net, "commit-4")
    net.cores["n2"].leave("drained", 0)
    net.drain("n2")
    assert not any(net.links[("n2", m)] for m in ("n0", "n1", "n3"))  # no BYE
    net.cores["n3"].drain_out(["n2"])
    assert [dst for dst, _ in net.cores["n3"].outbox] == ["n0"]
    net.drain("n3")
    net.cores["n0"].handle("n3", net.links[("n3", "n0")].popleft())
    kinds = [(dst, msg["type"]) for dst, msg in net.cores["n0"].outbox]
    assert ("n2", "propose") in kinds and ("n1", "propose") in kinds, kinds
    net.drain("n0")
    net.quiesce()
    for m in ("n0", "n1", "n3"):
        d = net.cores[m].decided
        assert (d.gen, d.nodes, d.lost) == (1, ("n0", "n1", "n3"), ("n2",))
        assert DRAINED in net.cores[m].suspects["n2"]
    n2 = net.cores["n2"]
    assert n2.fence_code == 0 and n2.fenced.startswith("drained (told by n0")
    net.check_safety()


def test_the_drains_round_may_reach_the_drained_node_before_its_workers_left():
    """4e: n0's PROPOSE without n2 (reason DRAINED) arrives before n2's workers said they
    left: n2 waits instead of fencing itself, and its decision ends it with exit 0; n2's
    own `leave("drained")` afterwards changes nothing."""
    net = SimNet(3, seed=4)
    _vote(net, "commit-9")
    notes: list = []
    net.cores["n0"].drain_out(["n2"])
    net.drain("n0")
    propose = net.links[("n0", "n2")].popleft()
    net.cores["n2"].handle("n0", propose)
    notes += net.cores["n2"].notes
    assert net.cores["n2"].draining and not net.cores["n2"].fenced
    assert [k for k, _ in notes] == ["draining"]
    net.drain("n2")
    net.quiesce()
    assert net.cores["n2"].fence_code == 0 and "drained" in net.cores["n2"].fenced
    net.cores["n2"].leave("drained", 0)
    assert net.cores["n2"].outbox == []
    assert net.cores["n0"].decided.nodes == net.cores["n1"].decided.nodes == ("n0", "n1")


def test_a_drained_node_still_held_by_a_round_says_bye_and_that_round_loses_it():
    """4e: n3 crashed and n0's round for it, which still holds n2, reaches n2 after its
    drain (before any survivor said so): n2 says BYE "early" -- a loss for that round -- and
    ends with exit 0. The survivors decide without both."""
    net = SimNet(5, seed=6)
    net.cores["n2"].leave("drained", 0)
    net.drain("n2")
    net.crashed.add("n3")
    net.cores["n0"].suspect("n3", "connection_lost")
    net.drain("n0")
    net.cores["n2"].handle("n0", net.links[("n0", "n2")].popleft())
    assert [k for k, _ in net.cores["n2"].notes] == ["drained_out"]
    assert net.cores["n2"].fence_code == 0 and "early" in net.cores["n2"].fenced
    assert all(msg["type"] == "bye" for dst, msg in net.cores["n2"].outbox)
    net.drain("n2")
    net.quiesce()
    for m in ("n0", "n1", "n4"):
        assert net.cores[m].decided.nodes == ("n0", "n1", "n4")
    net.check_safety()


def test_a_node_that_withdraws_is_decided_away_at_once_and_rejoins_when_it_asks():
    """A worker of n1 crashed: n1 steps out (BYE "withdraw"), the others decide without it in
    one round; n1 follows as a spare, asks to join once its new workers are ready (here: at
    once -- a member that still has it in its view drops the request, n1 asks again: plane.py
    does every lease_s, quiesce() here), and the next round takes it back."""
    net = SimNet(4, seed=3)
    n1 = net.cores["n1"]
    n1.withdraw("worker 0 exited with signal SIGKILL")
    net.withdrew.add("n1")
    net.drain("n1")
    assert not n1.joined and not n1.fenced
    n1.request_join("rejoin")
    net.drain("n1")
    net.asked.add("n1")
    net.quiesce()
    histories = [net.decisions[m] for m in ("n0", "n2", "n3")]
    for h in histories:
        assert [(d.gen, d.nodes, d.lost, d.joined) for d in h.values()] == [
            (1, ("n0", "n2", "n3"), ("n1",), ()), (2, ("n0", "n2", "n3", "n1"), (), ("n1",))]
    for m in net.names:  # (a joiner comes after the survivors: the store stays on n0)
        assert net.cores[m].decided.nodes == ("n0", "n2", "n3", "n1") and not net.cores[m].fenced
    assert n1.joined and list(net.decisions["n1"]) == [2]
    # It can step out and come back again (a second crash).
    n1.withdraw("again")
    net.drain("n1")
    n1.request_join("rejoin")
    net.drain("n1")
    net.quiesce()
    assert all(net.cores[m].decided.gen == 4 and len(net.cores[m].decided.nodes) == 4
               for m in net.names)
    net.check_safety()


def test_a_member_that_decides_a_withdrawn_node_away_before_its_bye_does_not_fence_it():
    """n3 sends n2 a heartbeat and withdraws (its BYE follows on the same link); n2 adopts
    n0's decision without n3 first, then reads the heartbeat from a node it excluded and
    answers FENCE (it has not read the BYE yet). n3 withdrew: being outside is what it asked
    for, so it stays a spare and rejoins (seen in a CI run: the node exited 3 instead)."""
    net = SimNet(4, seed=5)
    n3 = net.cores["n3"]
    net.links[("n3", "n2")].append({"type": "heartbeat"})
    n3.withdraw("worker 1 exited with signal SIGKILL")
    net.withdrew.add("n3")
    net.drain("n3")
    def deliver(a: str, b: str) -> None:
        net.cores[b].handle(a, net.links[(a, b)].popleft())
        net.drain(b)
    while net.cores["n2"].decided.gen < 1:  # every link but n3 -> n2: a round without n3
        deliver(*next(k for k, q in net.links.items() if q and k != ("n3", "n2")))
    assert net.cores["n2"].decided.nodes == ("n0", "n1", "n2")
    deliver("n3", "n2")  # the heartbeat: n3 is outside n2's view, and not known to have withdrawn
    assert [m for m in net.links[("n2", "n3")] if m["type"] == "fence"]
    net.quiesce()
    assert not n3.fenced and not n3.joined
    n3.request_join("rejoin")
    net.asked.add("n3")
    net.drain("n3")
    net.quiesce()
    assert all(net.cores[m].decided.nodes == ("n0", "n1", "n2", "n3") and not net.cores[m].fenced
               for m in net.names), {m: (c.decided, c.fenced) for m, c in net.cores.items()}
    net.check_safety()


def test_a_node_outside_the_view_stops_once_too_few_members_are_left_to_add_it():
    """n0 withdrew from a 5-node job and waits to rejoin; the others fell back without a word
    (fenced members tell no one): n0's JOINs find their agents gone. While the members it can
    reach could still form a quorum of the view it knows it waits; then it stops for the
    requeue (chaos seed 2819, trial 13: it waited until the trial's timeout). A spare that
    cannot reach one member of a healthy job waits on."""
    net = SimNet(5, seed=1, spares=1)
    n0, spare = net.cores["n0"], net.cores["n5"]
    n0.withdraw("worker 0 exited with signal SIGKILL")
    net.drain("n0")
    n0.suspect("n1", "send_failed (refused)")
    assert not n0.fenced  # n2, n3, n4: 3 of 5
    n0.suspect("n3", "send_failed (refused)")
    assert n0.fenced and n0.fence_code == 75 and "members are gone" in n0.fenced, n0.fenced
    spare.suspect("n1", "send_failed (refused)")
    assert not spare.fenced


@pytest.mark.parametrize("n, spares", [(2, 1), (3, 2), (4, 1), (5, 3)])
def test_random_schedules_with_spares_joining_are_safe_and_live(n, spares):
    grown = 0
    for seed in range(300):
        net = run(n, seed, chaos_steps=40 * (n + spares), spares=spares)
        grown += any(d.joined for ds in net.decisions.values() for d in ds.values())
    assert grown > 30, grown  # the sweep must exercise joins (spares go in only after a loss)


@pytest.mark.parametrize("n", [3, 4, 6])
def test_random_schedules_without_quorum_are_safe_and_live(n):
    for seed in range(200):
        run(n, seed, chaos_steps=40 * n, quorum="none")


def test_one_crash_every_survivor_decides_the_same_new_generation():
    net = SimNet(5, seed=1)
    net.crashed.add("n2")
    while net.step(chaos=False):
        pass
    for m in ("n0", "n1", "n3", "n4"):
        d = net.cores[m].decided
        assert (d.gen, d.nodes, d.lost, d.store_node) == (1, ("n0", "n1", "n3", "n4"), ("n2",), "n0")
    ports = {net.cores[m].decided.store_port for m in ("n0", "n1", "n3", "n4")}
    assert len(ports) == 1 and ports != {999}  # a fresh store port, the same everywhere


@pytest.mark.parametrize("crashed", ["n5", "n0"], ids=["member", "coordinator"])
def test_a_round_costs_messages_linear_in_the_job_size(crashed):
    """Proposals go to the coordinator and only it tells everyone (membership.py, steps 2-3):
    a crash costs a few messages per member, whatever N, where every member telling every
    other cost 2 (N - 1) each. Here every survivor detects the crash itself (the worst case:
    on the control plane only the dead node's observers and links do)."""
    per_member = {}
    for n in (8, 24, 64):
        net = SimNet(n, seed=3)
        net.crashed.add(crashed)
        while net.step(chaos=False):
            pass
        assert {net.cores[m].decided.gen for m in net.names if m != crashed} == {1}
        per_member[n] = round(net.sent / n, 2)
    print(f"\n[figures] messages per member for one crash ({crashed}): {per_member}")
    assert max(per_member.values()) <= 5, per_member


def test_store_host_death_moves_the_store_to_the_next_survivor():
    net = SimNet(4, seed=2)
    net.crashed.add("n0")
    while net.step(chaos=False):
        pass
    assert {net.cores[m].decided.store_node for m in ("n1", "n2", "n3")} == {"n1"}


def test_minority_is_fenced_for_lack_of_quorum():
    net = SimNet(5, seed=3)
    net.crashed.update({"n0", "n1", "n2"})
    while net.step(chaos=False):
        pass
    for m in ("n3", "n4"):
        assert net.cores[m].fenced and "quorum" in net.cores[m].fenced
        assert net.cores[m].decided.gen == 0


def test_exactly_half_continues_only_with_the_first_node():
    for dead, survives in (({"n2", "n3"}, True), ({"n0", "n3"}, False)):
        net = SimNet(4, seed=4)
        net.crashed.update(dead)
        while net.step(chaos=False):
            pass
        alive = [m for m in net.names if m not in dead]
        assert all((net.cores[m].fenced is None) == survives for m in alive)


def test_falsely_suspected_node_is_fenced_and_answered_with_fence_later():
    net = SimNet(4, seed=5)
    net.cores["n1"].suspect("n3", "lease_expired")
    net.drain("n1")
    while net.step(chaos=False):
        pass
    assert net.cores["n3"].fenced
    assert all(net.cores[m].decided.nodes == ("n0", "n1", "n2") for m in ("n0", "n1", "n2"))
    # A message of a node outside the view (e.g. a heartbeat of a resumed node) is answered
    # with FENCE, and a FENCE from a member fences.
    core = net.cores["n0"]
    core.handle("n3", {"type": "heartbeat"})
    assert core.outbox == [("n3", {"type": "fence", "gen": 1, "nodes": ["n0", "n1", "n2"]})]
    fresh = MembershipCore("n3", net.names, 999, lambda: 1)
    fresh.handle("n0", core.outbox[0][1])
    assert fresh.fenced and "n0" in fresh.fenced


def test_exchange_gathers_one_value_per_node_and_is_superseded_by_a_round():
    net = SimNet(3, seed=6)
    notes = recorded_notes(net)
    for m in net.names:
        net.cores[m].exchange("plan", f"digest-{m}")
        net.drain(m)
    while net.step(chaos=False):
        pass
    for m in net.names:
        (done,) = [f for k, f in notes[m] if k == "exchange_done"]
        assert done["values"] == {"n0": "digest-n0", "n1": "digest-n1", "n2": "digest-n2"}
    # A failure while an exchange is pending fails it everywhere with a reason.
    for m in ("n0", "n1"):
        net.cores[m].exchange("again", 1)
        net.drain(m)
    net.crashed.add("n2")
    while net.step(chaos=False):
        pass
    for m in ("n0", "n1"):
        (failed,) = [f for k, f in notes[m] if k == "exchange_failed"]
        assert failed["key"] == "again" and "round" in failed["reason"]
        assert net.cores[m].decided.nodes == ("n0", "n1")
    # A contribution meant for a generation the core has left fails at once (the agent checked
    # the generation a moment before the core moved on: seen as a worker waiting 30 s).
    net.cores["n0"].exchange("late", 1, gen=0)
    (failed,) = [f for k, f in net.cores["n0"].notes if k == "exchange_failed"]
    assert (failed["gen"], failed["key"]) == (0, "late") and "moved on" in failed["reason"]


def test_a_vote_takes_one_value_per_member_from_members_for_open_keys_only():
    """What a member that misbehaves (it holds the run's secret) can do to a vote is bounded:
    its second value for a key, a value from a non-member, a value for a generation two
    ahead, a fifth open key, and gathered values from another than the coordinator are all
    ignored (issue 28: forged values became every member's result of the exchange)."""
    from oobleck_hpc.control.exchange import OPEN_PER_NODE

    coordinator = MembershipCore("n0", ("n0", "n1", "n2", "n3"), 999, lambda: 1,
                                 members0=("n0", "n1", "n2"))
    def x(key, value, gen=0):
        return {"type": "exchange", "xgen": gen, "key": key, "value": value}

    coordinator.handle("n1", x("step-1", "n1's"))
    coordinator.handle("n1", x("step-1", "forged"))  # a second value
    coordinator.handle("n3", x("step-1", "not a member's"))
    coordinator.handle("n2", x("step-1", "too far ahead", gen=2))
    for i in range(OPEN_PER_NODE + 2):
        coordinator.handle("n2", x(f"k-{i}", i))
    coordinator.exchange("step-1", "n0's")
    coordinator.handle("n2", x("step-1", "n2's"))  # (n2's keys are full, step-1 was not open)
    assert not [n for n in coordinator.notes if n[0] == "exchange_done"]
    for i in range(OPEN_PER_NODE):  # (its open keys complete: room for step-1)
        coordinator.exchange(f"k-{i}", i)
        coordinator.handle("n1", x(f"k-{i}", i))
    coordinator.handle("n2", x("step-1", "n2's"))
    done = [f for k, f in coordinator.notes if k == "exchange_done" and f["key"] == "step-1"]
    assert done and done[0]["values"] == {"n0": "n0's", "n1": "n1's", "n2": "n2's"}, done

    member = MembershipCore("n1", ("n0", "n1", "n2"), 999, lambda: 1)
    member.exchange("step-1", "n1's")
    values = {"n0": "a", "n1": "n1's", "n2": "c"}
    member.handle("n2", {"type": "exchange_done", "xgen": 0, "key": "step-1",
                         "values": {**values, "n0": "forged"}})  # not the coordinator
    assert not [n for n in member.notes if n[0] == "exchange_done"]
    member.handle("n0", {"type": "exchange_done", "xgen": 0, "key": "step-1",
                         "values": {**values, "mallory": "x"}})
    (done,) = [f for k, f in member.notes if k == "exchange_done"]
    assert done["values"] == values


def test_retry_in_place_decides_the_same_nodes_on_a_fresh_store():
    """A failure with no dead node: one agent opens a retry round, the others join it, and all
    decide the next generation with the same nodes, nothing lost and a fresh store port."""
    net = SimNet(4, seed=7)
    assert net.cores["n2"].retry("allreduce timed out, every peer answered")
    net.drain("n2")
    assert not net.cores["n2"].retry("a second report of the same failure")  # round already open
    while net.step(chaos=False):
        pass
    decisions = {net.cores[m].decided for m in net.names}
    assert len(decisions) == 1
    (d,) = decisions
    assert (d.gen, d.nodes, d.lost, d.store_node) == (1, net.names, (), "n0")
    assert d.store_port != 999 and not any(net.cores[m].fenced for m in net.names)
    # A crash during a retry round shrinks it like any other round.
    net.cores["n0"].retry("again")
    net.drain("n0")
    net.crashed.add("n3")
    while net.step(chaos=False):
        pass
    for m in ("n0", "n1", "n2"):
        assert net.cores[m].decided.nodes == ("n0", "n1", "n2")
        assert net.cores[m].decided.lost == ("n3",)


def test_fence_codes_requeue_only_when_the_majority_cannot_be_proved():
    """No quorum -> 75 (fall back to the checkpoint, requeue); excluded by the peers -> 3."""
    net = SimNet(6, seed=8)  # 3 of 6 lost at once, node0 among them: exactly half, no first node
    net.crashed.update({"n0", "n1", "n2"})
    while net.step(chaos=False):
        pass
    assert all(net.cores[m].fenced and net.cores[m].fence_code == 75 for m in ("n3", "n4", "n5"))
    net = SimNet(4, seed=9)
    net.cores["n1"].suspect("n3", "lease_expired")
    net.drain("n1")
    while net.step(chaos=False):
        pass
    assert net.cores["n3"].fenced and net.cores["n3"].fence_code == 3
    assert not any(net.cores[m].fenced for m in ("n0", "n1", "n2"))


@pytest.mark.parametrize("how, expect", [("finished", "left"), ("early", "lost"),
                                         ("abort", "stopped")])
def test_bye_finished_early_and_abort(how, expect):
    """BYE "finished" only marks the node as left; "early" is a loss (a round opens at once and
    decides without it); "abort" (bad input) stops every peer with exit code 2."""
    net = SimNet(4, seed=10)
    net.cores["n2"].leave(how, 0 if how != "abort" else 2, "model.name unknown")
    net.drain("n2")
    net.crashed.add("n2")  # its agent exits right after
    if how == "finished":  # the BYE explains its dropped connections: not a failure
        net.detected.update((m, "n2") for m in net.names)
    while net.step(chaos=False):
        pass
    others = ("n0", "n1", "n3")
    if expect == "left":
        assert all(net.cores[m].decided.gen == 0 and net.cores[m].left == {"n2"}
                   and net.cores[m].proposal is None and not net.cores[m].fenced for m in others)
    elif expect == "lost":
        assert all(net.cores[m].decided.nodes == others and net.cores[m].decided.lost == ("n2",)
                   for m in others)
        assert any("left_early" in h for m in others for h in [net.cores[m].suspects.get("n2", "")])
    else:
        assert all(net.cores[m].fence_code == 2 and "bad input" in net.cores[m].fenced
                   for m in others)


def test_a_waiting_joiner_lost_after_a_peer_finished_opens_no_round():
    """The job ends: n0's BYE "finished" reaches n1, and the spare n2 that asked to join
    stops (the job ended without it): n1 sees its link close. Dropping a joiner no round adds
    opens no round -- one would also drop n0, which left, and fence n1 for want of a quorum
    (exit 75: a requeue of a job that finished; seen in a CI run)."""
    net = SimNet(2, seed=12, spares=1)
    net.asked.add("n2")
    net.cores["n2"].request_join()
    net.drain("n2")
    net.quiesce()
    assert "n2" in net.cores["n1"].joiners and net.cores["n1"].decided.gen == 0
    net.cores["n0"].leave("finished", 0)
    net.drain("n0")
    while net.links[("n0", "n1")]:
        net.cores["n1"].handle("n0", net.links[("n0", "n1")].popleft())
    assert net.cores["n1"].left == {"n0"}
    net.cores["n1"].suspect("n2", "connection_lost")
    core = net.cores["n1"]
    assert not core.fenced and core.proposal is None and "n2" not in core.joiners
    assert core.decided.gen == 0 and core.suspects == {"n2": "connection_lost"}


def test_a_spare_waits_until_a_loss_and_the_losss_round_swaps_it_in():
    net = SimNet(4, seed=11, spares=1)
    spare = net.cores["n4"]
    assert not spare.joined and not spare.retry("no") and spare.decided.nodes == net.names[:4]
    spare.exchange("plan", 1)
    assert ("exchange_failed", {"gen": 0, "key": "plan", "reason": "not a member yet"}) in spare.notes
    net.asked.add("n4")
    spare.request_join()
    net.drain("n4")
    net.quiesce()  # the job has all its nodes: the spare waits, no round
    assert all(net.cores[m].decided.gen == 0 and net.cores[m].proposal is None for m in net.names)
    assert all(net.cores[m].joiners == {"n4": "spare"} for m in net.names[:4])
    net.crashed.add("n2")
    net.quiesce()
    for m in ("n0", "n1", "n3", "n4"):
        d = net.cores[m].decided
        assert (d.gen, d.nodes, d.lost, d.joined, d.store_node) == \
            (1, ("n0", "n1", "n3", "n4"), ("n2",), ("n4",), "n0")
        assert not net.cores[m].fenced and net.cores[m].joined


def test_joiners_wait_until_the_job_trains():
    """Before the first committed step (rendezvous, checkpoint restore) there is no state for a
    joiner to take: a loss's round adds no spare; the members add it once they train."""
    net = SimNet(3, seed=5, spares=1)
    for m in ("n0", "n1", "n2"):
        net.cores[m].open_to_joins = False
    net.asked.add("n3")
    net.cores["n3"].request_join()
    net.drain("n3")
    net.crashed.add("n1")
    net.quiesce()
    for m in ("n0", "n2"):
        d = net.cores[m].decided
        assert (d.gen, d.nodes, d.joined) == (1, ("n0", "n2"), ())
        assert net.cores[m].joiners == {"n3": "spare"}
    assert not net.cores["n3"].joined
    net.cores["n2"].open_joins()  # the first member that trains opens the round that adds it
    net.drain("n2")
    net.quiesce()
    for m in ("n0", "n2", "n3"):
        d = net.cores[m].decided
        assert (d.gen, d.nodes, d.lost, d.joined) == (2, ("n0", "n2", "n3"), (), ("n3",))
    net.check_safety()


def test_a_round_that_only_adds_a_joiner_opens_at_the_next_commit_vote():
    """Step 7b: members that train hold a round that would only add a joiner until a commit
    vote completes; the coordinator sends the vote's values ahead of its PROPOSE on every link,
    so every member commits that step before it hears of the round (nothing is replayed). A
    loss meanwhile takes the joiner at once; `take_joiners` opens a held round (what the
    plane does after JOIN_HOLD_S without a commit). Another member's boundary opens nothing:
    it comes when the coordinator's values reach it, and others may have begun the next step
    (CI: such a round aborted it)."""
    net = SimNet(3, seed=4, spares=1)
    for m in ("n0", "n1", "n2"):
        net.cores[m].joins_at_boundary = True
    net.crashed.add("n1")  # the view lacks a node: the spare is wanted
    net.quiesce()
    assert net.cores["n0"].decided.nodes == ("n0", "n2")

    def deliver(a: str, b: str) -> None:  # (by hand: quiesce() would reach a boundary)
        net.hand_over(a, b)
        net.drain(b)

    net.asked.add("n3")
    net.cores["n3"].request_join()
    net.drain("n3")
    deliver("n3", "n0"), deliver("n3", "n2")
    for m in ("n0", "n2"):  # another exchange is no step boundary
        net.cores[m].exchange("recover-1", 1)
        net.drain(m)
    deliver("n2", "n0"), deliver("n0", "n2")
    assert all(net.cores[m].decided.gen == 1 and net.cores[m].joins_held
               and net.cores[m].proposal is None for m in ("n0", "n2"))
    net.cores["n2"].step_boundary()  # (not the coordinator: it keeps holding)
    assert net.cores["n2"].joins_held and net.cores["n2"].proposal is None
    net.cores["n2"].exchange("commit-7", 1)
    net.drain("n2")
    net.cores["n0"].handle("n2", net.links[("n2", "n0")].popleft())
    net.cores["n0"].exchange("commit-7", 1)  # the coordinator's vote completes the exchange
    kinds = [(dst, msg["type"]) for dst, msg in net.cores["n0"].outbox]
    assert kinds.index(("n2", "exchange_done")) < kinds.index(("n2", "propose")), kinds
    assert net.cores["n0"].proposal == ("n0", "n2", "n3")
    # Every member's workers hear a round that only adds: the coordinator's, and n2's, which
    # its PROPOSE opens (they move on from the committed step: nothing failed)
    opened = {"n0": notes_of_kind(net.cores["n0"], "round_started")}
    net.drain("n0")
    net.hand_over("n0", "n2")
    opened["n2"] = notes_of_kind(net.cores["n2"], "round_started")
    net.drain("n2")
    assert [f["joins_only"] for m in ("n0", "n2") for f in opened[m]] == [True, True], opened
    net.quiesce()
    for m in ("n0", "n2", "n3"):
        d = net.cores[m].decided
        assert (d.gen, d.nodes, d.lost, d.joined) == (2, ("n0", "n2", "n3"), (), ("n3",))
        assert not net.cores[m].joins_held
    net.check_safety()


def test_a_joiner_held_by_a_member_waits_for_the_coordinators_boundary():
    """Step 7b: the JOIN reached n2 but not yet the coordinator n0. A commit vote completes at
    both: n2's boundary (when n0's values reach it, while n0 may begin the next step) opens no
    round -- in a CI run such a round aborted the step in flight. Once the JOIN reaches n0,
    n0's next boundary opens the round, after the vote's values on every link."""
    net = SimNet(3, seed=5, spares=1)
    for m in ("n0", "n1", "n2"):
        net.cores[m].joins_at_boundary = True
    net.crashed.add("n1")
    net.quiesce()

    def deliver(a: str, b: str) -> None:
        net.hand_over(a, b)
        net.drain(b)

    def vote(key: str) -> None:
        net.cores["n2"].exchange(key, 1)
        net.drain("n2")
        deliver("n2", "n0")
        net.cores["n0"].exchange(key, 1)
        net.drain("n0")

    net.asked.add("n3")
    net.cores["n3"].request_join()
    net.drain("n3")
    deliver("n3", "n2")
    vote("commit-8")
    assert not net.cores["n0"].joins_held and net.cores["n0"].proposal is None
    deliver("n0", "n2")  # the values: n2's boundary
    assert net.cores["n2"].joins_held and net.cores["n2"].proposal is None
    deliver("n3", "n0")
    assert net.cores["n0"].joins_held and net.cores["n0"].proposal is None
    vote("commit-9")
    assert net.cores["n0"].proposal == ("n0", "n2", "n3")
    to_n2 = [msg["type"] for msg in net.links[("n0", "n2")]]
    assert to_n2 == ["exchange_done", "propose"], to_n2
    net.quiesce()
    for m in ("n0", "n2", "n3"):
        d = net.cores[m].decided
        assert (d.gen, d.nodes, d.joined) == (2, ("n0", "n2", "n3"), ("n3",))
        assert not net.cores[m].joins_held
    net.check_safety()


def test_a_retry_round_is_no_joins_only_round_at_the_member_that_opens_it():
    """A retry (a failed step, nobody lost) that also takes a held joiner: the workers of the
    member whose step failed recover (step_failed); a peer that its PROPOSE reaches hears a
    round that only adds a node to its view (nothing failed there)."""
    net = SimNet(3, seed=4, spares=1)
    for m in ("n0", "n1", "n2"):
        net.cores[m].joins_at_boundary = True
    net.crashed.add("n1")
    net.quiesce()
    net.asked.add("n3")
    net.cores["n3"].request_join()
    net.drain("n3")
    net.hand_over("n3", "n0")
    net.drain("n0")
    assert net.cores["n0"].joins_held and net.cores["n0"].proposal is None
    assert net.cores["n0"].retry("a collective failed")
    (opened,) = notes_of_kind(net.cores["n0"], "round_started")
    assert opened["joiners"] == ["n3"] and opened["joins_only"] is False, opened
    net.drain("n0")
    net.hand_over("n0", "n2")
    (opened,) = notes_of_kind(net.cores["n2"], "round_started")
    assert opened["joiners"] == ["n3"] and opened["joins_only"] is True, opened
    net.drain("n2")
    net.quiesce()
    assert net.cores["n2"].decided.nodes == ("n0", "n2", "n3")
    net.check_safety()


def test_a_loss_and_a_join_agree_on_the_survivors_plus_the_joiner():
    for seed in range(20):
        net = SimNet(4, seed=seed, spares=1)
        net.crashed.add("n2")
        net.asked.add("n4")
        net.cores["n4"].request_join()
        net.drain("n4")
        net.quiesce()
        net.check_safety()
        for m in ("n0", "n1", "n3", "n4"):
            assert net.cores[m].decided.nodes == ("n0", "n1", "n3", "n4") and not net.cores[m].fenced
        # One round or two: n2 is lost and n4 added, whatever the interleaving.
        history = net.decisions["n0"].values()
        assert {n for d in history for n in d.lost} == {"n2"}
        assert {n for d in history for n in d.joined} == {"n4"}


def test_a_round_opened_by_a_peers_proposal_adds_that_proposals_joiners():
    """n2 knows spare n5 asked to join; n1's proposal for the loss of n3 adds spare n4 (n1 heard
    only n4). The suspicion n2 takes over opens its round: with n1's joiner, not its own pick
    (before: n2 proposed n0,n1,n2,n5, then dropped n5 -- the round added nobody, and a further
    round was needed)."""
    names = ("n0", "n1", "n2", "n3", "n4", "n5")
    core = MembershipCore("n2", names, 999, lambda: 7, members0=names[:4])
    core.handle("n5", {"type": "join", "how": "spare"})
    assert core.joiners == {"n5": "spare"} and core.proposal is None  # the job has all its nodes
    core.handle("n1", {"type": "propose", "round": 1, "view": ["n0", "n1", "n2", "n4"],
                       "port": 5, "reasons": {"n3": "connection_lost"}, "readmits": [],
                       "decided": core.decided.to_msg()})
    assert core.proposal == ("n0", "n1", "n2", "n4")
    assert [f["nodes"] for kind, f in core.notes if kind == "proposed"] == [["n0", "n1", "n2", "n4"]]
    assert set(core.joiners) == {"n4", "n5"}  # n5 waits for a later round


def test_a_joiner_that_dies_while_joining_and_an_excluded_member_never_come_back():
    net = SimNet(3, seed=13, spares=1)
    net.asked.add("n3")
    net.cores["n3"].request_join()
    net.drain("n3")
    for m in ("n0", "n1", "n2"):
        net.cores[m].handle("n3", net.links[("n3", m)].popleft())
        net.drain(m)
    net.crashed.add("n1")  # a loss: n0's round swaps the spare in ...
    net.cores["n0"].suspect("n1", "connection_lost")
    net.drain("n0")
    assert net.cores["n0"].proposal == ("n0", "n2", "n3")
    net.crashed.add("n3")  # ... which dies before it proposes
    net.quiesce()
    for m in ("n0", "n2"):
        d = net.cores[m].decided
        assert (d.nodes, d.lost, d.joined) == (("n0", "n2"), ("n1",), ())
        assert "n3" in net.cores[m].suspects
    # A new process under the same name (not a new incarnation) is refused: FENCE.
    again = MembershipCore("n3", net.names, 999, lambda: 1, members0=net.names[:3])
    again.request_join(to=["n0"])
    net.cores["n0"].handle("n3", again.outbox[0][1])
    (reply,) = [msg for dst, msg in net.cores["n0"].outbox if dst == "n3"]
    again.handle("n0", reply)
    assert again.fenced and "excluded" in again.fenced
    # So is a member the others excluded (here falsely suspected), asking to join again.
    net = SimNet(3, seed=14)
    net.cores["n0"].suspect("n2", "lease_expired")
    net.drain("n0")
    net.quiesce()
    assert net.cores["n2"].fenced
    net.cores["n0"].handle("n2", {"type": "join", "how": "spare"})
    assert net.cores["n0"].outbox[-1] == ("n2", {"type": "fence", "gen": 1, "nodes": ["n0", "n1"]})


@pytest.mark.parametrize("code, exchanging", [(75, True), (75, False), (0, True)])
def test_a_member_that_stops_for_a_requeue_alone_ends_the_exchanges_that_wait_on_it(
        code, exchanging):
    """A member that says BYE "finished" with exit 75 (it fell back alone: a joiner that could
    not rebuild its members' plan) while the others wait on an exchange of the generation: a
    round opens at once and decides without it -- its value would never come (fleet chaos seed
    3201 trial 7: the members waited out their 52 s bound). With no exchange waiting, or after
    the job's last step (exit 0), "finished" only marks the node as left (4c)."""
    net = SimNet(4, seed=13)
    notes = recorded_notes(net)
    if exchanging:
        for m in ("n0", "n1", "n3"):
            net.cores[m].exchange("recover-0", m)
            net.drain(m)
    net.cores["n2"].leave("finished", code)
    net.drain("n2")
    net.crashed.add("n2")  # its agent exits right after
    net.detected.update((m, "n2") for m in net.names)  # the BYE explains its closed links
    while net.step(chaos=False):
        pass
    others = ("n0", "n1", "n3")
    if code == 75 and exchanging:
        assert all(net.cores[m].decided.nodes == others for m in others)
        for m in others:
            (failed,) = [f for k, f in notes[m] if k == "exchange_failed"]
            assert failed["key"] == "recover-0" and "round" in failed["reason"]
    else:
        assert all(net.cores[m].decided.gen == 0 and net.cores[m].proposal is None
                   for m in others)
    assert not any(net.cores[m].fenced for m in others)
