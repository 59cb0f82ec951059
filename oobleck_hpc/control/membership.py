"""Membership agreement among node agents: who is still in the job, with no single point of failure.

Every node runs one agent; the agents talk over their own TCP connections (the control plane,
`oobleck_hpc/control/plane.py`), never over the training process groups. This module is the
protocol itself, as a pure state machine (`MembershipCore`: messages in, messages and notes out,
no sockets, no clocks), so that its safety can be tested by simulation under every interleaving.

State of one agent
------------------
- `decided`: the last decided generation -- `Decision(gen, nodes, lost, store_node, store_port)`.
  Generation 0 is the roster (every node, store on the first node, port from the launcher).
- `suspects`: nodes this agent believes failed, each with how it learned it. Suspicion is
  permanent: a suspected node is never taken back (a falsely suspected node is fenced instead).
- `left`: nodes that said BYE because they finished (the job is ending): no longer expected.
- `proposal`: while a round for generation g = decided.gen + 1 is open, the agent's proposed view
  P = decided.nodes - suspects - left + the round's joiners (step 7). Within one generation an
  agent's proposals only shrink.

Message flow
------------
1. Detection (plane.py, control/agent.py) calls `suspect(node, how)`: a dropped connection (a SIGKILLed
   agent's sockets are closed by its kernel: seen in milliseconds), a lease expiry (no message
   for `lease_s`: a hung or partitioned node), an explicit FAILED message (an agent whose worker
   crashed declares its own node failed), a worker-reported communication error naming a peer,
   or a ping unanswered after a worker reported a stall (a hung node found in band, long before
   its lease: recovery/stall.py).
2. PROPOSE(g, P, reasons, my_store_port, my last decision) goes to P's coordinator: its first
   node in roster order (the next store host). The coordinator itself sends its PROPOSE to
   every node of decided.nodes and to the round's joiners. A receiver adopts the sender's
   suspicions (its own proposal becomes the intersection) and proposes too. So a suspicion
   reaches the coordinator in one hop and everyone in two; all live members converge on the
   coordinator's P, and each tells it so. A member that suspects the coordinator proposes
   without it, to the next node: that node absorbs the suspicion, coordinates, and its
   broadcast fences the old coordinator if it still runs. Messages per round: O(N) (a few per
   member; the coordinator sends and receives one per member), where every member telling
   every other would be O(N^2).
3. DECIDE: an agent decides P for generation g as soon as it holds the proposal P for g from
   every member of P, itself included, and P is a quorum of decided.nodes (below). Only the
   coordinator holds them all. The store of the new generation is hosted by the first node of
   P in roster order, on the port that node put in its proposal; it is the coordinator, so the
   store address is part of the decision. The decider sends DECIDED(g, P, store) to the old
   members, the joiners and the new members; the others adopt it (step 5). A PROPOSE for a
   generation the receiver has decided, from a member of that decision, is answered with
   DECIDED (the sender missed it: the coordinator died while it told the members).
4. A new suspicion while a round is open simply shrinks the proposal (a failure during agreement
   supersedes the round); a suspicion of a node that is still in a just-decided view opens round
   g + 1 at once.
4b. Retry in place (`retry`): a worker's collective failed but every peer answered the probe
   (a slow rank, a port clash). The agent opens round g + 1 with nothing suspected: its first
   proposal is the decided view itself. Peers join on its PROPOSE (step 2) with their own,
   equal, proposals, and the round decides like any other: the same nodes, `lost` empty, a
   fresh store port -- the workers rebuild their groups on the same members and replay the
   step. A suspicion during that round shrinks it as usual.
4c. Leaving (`leave`, BYE): "finished" (the node's workers ended the job, as every node's do:
   the last step is done, or all stop for a requeue) only marks the node as left: no round, no
   fencing, and later rounds leave it out -- except a member that stops for a requeue (exit
   75) while this node's workers wait on an exchange of the generation: its value will never
   come, so a round opens at once (a joiner that could not join fell back alone, and the
   members waited out their recovery's exchange: 52 s in fleet chaos seed 3201 trial 7). Its
   peers' exchanges then fail and the round decides without it; nodes that all stop for the
   requeue are past their exchanges (a stop is decided by the commit vote), or fall back
   anyway. "early" (it leaves while the others go on) is a loss like any other: the receivers
   suspect it. "abort" (a worker rejected the job's input) stops every receiver with exit code
   2: the input is the same everywhere. "finished" and "abort" go to the spares too, which
   stop with the member's code (the job ended without needing them).
4d. Withdrawing (`withdraw`, BYE "withdraw"): a node whose worker crashed steps out while its
   agent lives. For the others it is a loss like "early" (they go on without it at once); the
   node itself becomes a spare of the view it left (it takes no part in a round of its old
   generation), and once its new workers are ready it asks to join again (step 7): a member
   that heard its BYE "withdraw" and decided it away takes its JOIN as a new incarnation's --
   it forgets the suspicion (`_readmit`), and a member that a peer's proposal tells about the
   re-added node does the same. Until then the node's other messages are ignored, not fenced;
   and a FENCE it gets before it asks to join again -- a member that decided it away before
   reading its BYE answers what it sent before the BYE -- is no news to it: it stays a spare.
   (Once it asked, a FENCE refuses its JOIN, as for any joiner. A stale FENCE that arrives after
   the JOIN, which follows the BYE by the seconds its new workers take to start, costs the node,
   not safety.)
4e. Drained by the vote (`drain_out`, `leave("drained")`): a commit vote that carried a drain
   request (control/drain.py) tells every rank alike which nodes L leave after that step
   (recovery/planned.py). When the view's coordinator C stays, no node of L says BYE: the
   survivors' agents suspect L at once (reason DRAINED), and the round that removes L opens
   with nothing else sent first. That round's PROPOSE reaches each member after the vote's
   values: C sent every member those values (step 8) before it could open or join any round,
   on the same links, and a survivor's PROPOSE goes to C only. So no member hears of the round
   before it holds the vote's result -- no vote fails, nothing is replayed -- which is why the
   old path (a BYE, the "leave" exchange before it) stays only for a drain of C itself. A node
   of L (`draining`: its workers said so, or a PROPOSE names it DRAINED) takes part in no round
   any more: it waits for a decision that excludes it (DECIDED, a PROPOSE carrying one, a
   FENCE) and then ends with exit 0 (`drained_out`), not fenced. Only once decided away: every
   survivor proposed that round, so each read the vote's values first, and the connections
   this node then closes can fail no vote. A round that still holds it (one that opened before
   the drain's, for a failure) gets its BYE "early" instead: it is a loss there like any
   other. Safety: L are only suspected, and suspicion is always safe (the argument below).
5. Adoption: an agent still in round g that receives DECIDED(g, V) (or a PROPOSE for g + 1,
   which carries its sender's decision of g) from a node it does not suspect, with itself in V,
   decides V too. This is how every member but the coordinator decides; it also unblocks
   survivors when the coordinator decided and then failed.
6. Fencing: any message from a member of my view whose view excludes me, and any FENCE from a
   member, makes me fenced: the agent stops its workers and exits. A message from a node that
   is not in my view is answered with FENCE (e.g. a SIGSTOPped node resumed after survivors
   decided without it: its first heartbeat is answered with FENCE; its own pause alone does not
   fence it, for its peers may have paused with it: topology.py). An agent whose own proposal
   no longer contains a quorum is fenced (the survivors cannot be told apart from a
   partitioned minority). A FENCE from a node that I excluded myself, and whose view excludes
   me, means we excluded each other (a partition, or two simultaneous false suspicions): I am
   fenced too, so that the job never splits in two.
   How a fenced node ends (`fence_code`, carried to the workers as `Fenced.exit_code`): 3 when
   its peers excluded it (they go on without it); 75 when it cannot prove it is in the majority
   -- no quorum, an agreement timeout (plane.py), a mutual exclusion -- because then nobody
   may be going on: it falls back to the last checkpoint and the job is requeued.

7. Joins: a node outside the view -- a spare of the allocation (a roster node outside generation
   0, `members0`), or a node grown into the running job (`add_node`: the control plane learns
   its address from its first message) -- asks with JOIN (`request_join`). A member records the
   joiner; while the view is smaller than the job (`size`: a node was lost) it opens a round at
   once if none is open (the agents: at the next step boundary, 7b; else the next round takes
   it). So a spare that asked early waits, and
   the round of the next loss swaps it in. Only once the job trains (`open_joins`: the members'
   workers committed a step) does a member pick joiners itself: a joiner takes the members'
   committed state, which a job still starting (rendezvous, checkpoint restore) does not have
   yet; before that, joiners are recorded and a loss's round adds none. A round's joiners are
   fixed when it opens: the first joiners by name that the member knew of, as many as the view
   lacks, or, when a peer's PROPOSE opened it, those that proposal adds. They come after the
   surviving nodes, in name order, so that every agent computes the same tuple and the store
   stays on an old member. A PROPOSE goes to the
   round's joiners too; a joiner takes the carried decision as its own last one and proposes
   like a member, and the decision needs its proposal like any other. Absorbing a peer's
   proposal drops the joiners that the peer's proposal does not add: they wait for the next
   round, which opens as soon as this one decides. The quorum counts old members only. A joiner
   that fails (suspected, BYE, FAILED) is suspected for good: it is never added; one that no
   round adds yet is only dropped -- that opens no round (a round then would also drop the
   peers that left "finished" and fence this member for want of a quorum: a CI run's last
   member, when the spare that the job's end stopped closed its link). A node that
   left a decided view is answered with FENCE when it asks to join again (a repaired node
   comes back under a new name, a new incarnation) -- unless it withdrew itself (4d). A spare
   watches nobody and opens no round
   until a round adds it; before that it only follows the members' decisions. Messages about
   generations before the one that added a node do not exclude it.

7b. Joins at a step boundary (`joins_at_boundary`, the agents' setting): a round that would only
   add joiners -- nobody suspected or gone -- is held (`joins_held`) until a commit vote completes
   at the coordinator (`step_boundary`, from exchange.py: keys starting with BOUNDARY), which
   opens it then. The coordinator completes the vote first: it sends the gathered values to
   every member and then its PROPOSE, on the same links, so every member's workers hold the
   vote's result -- they commit that step -- before they hear of the round. They then move to
   the grown generation from the committed step with nothing failed and nothing replayed
   (recovery/rounds.py, `admit`: the round's notice says `joins_only` on every member, also
   where the coordinator's PROPOSE opens it); the joiner takes that step's state. Another
   member completes the vote only when the coordinator's values reach it, after some members
   began the next step (a round it opened there aborted that step): it keeps holding its
   joiners until the coordinator's round adds them (their JOIN reaches the coordinator too).
   A job that commits no step for JOIN_HOLD_S (plane.py: its start, a recovery, a long save)
   takes its joiners then, at any member (`take_joiners`), replaying the step in flight. A
   loss's round takes the joiners at once, as before. Only when a round opens changes, never
   what a proposal holds: the safety argument below is untouched.

8. Exchanges (`exchange`: the workers' all-gathers, e.g. the commit vote of every step): each
   member sends its value to the decided view's first node, the coordinator, which sends all
   of them to every member once it holds them -- 2 (N - 1) messages, not N (N - 1). A round
   fails the exchanges still open (their workers redo them in the next generation).

Why two survivors cannot decide differently
-------------------------------------------
Claim: if A decides V and B decides W for the same generation g, with A in W and B in V, then
V = W. For direct decisions: B in V means B proposed V at g; A in W means A proposed W at g. An
agent's proposals within a generation form a shrinking chain and it stops proposing once it
decides, so A's decided V is the last (smallest) of A's chain, which contains W: V <= W; and
likewise W <= V. For an adopted decision (A adopts V from r, where r is not suspected by A, so r
is in A's last proposal C_A), A in W means A proposed W before adopting, so W >= C_A contains r;
the pair (r, B) then satisfies the claim's premise with adoption depth one less, and V = W by
induction. So survivors (nodes that stay in each other's decided views) agree exactly. A
retry round changes nothing here: its first proposal is the decided view, which every later
proposal of the generation is a subset of, so proposals still form shrinking chains; it only
allows a decided generation that loses no node. Joins keep it too: a round's joiners are
fixed when the agent opens it and only leave it afterwards, so each agent's proposals still
shrink, a joiner's included (its first proposal is the one it opens the round with), and the
argument above never used that a view is a subset of the last decided one. A withdrawn node
that comes back (4d) is a joiner like any other: it took part in no round since its BYE (it
ignores its old generation's rounds until it asks again), and every member it reaches has
decided it away first (a member that still has it in its view drops its JOIN; the node asks
again every lease_s), so a generation that holds it again was proposed by it as a joiner, with
the same shrinking chains. A round whose
joiners were all dropped may decide a generation that changes nothing. The only
disagreement possible is asymmetric -- A decided V containing B while B decided W without A
(A was suspected after its proposal had left) -- and then A is fenced as soon as any message of
B reaches it (B's proposals exclude A), or, if none does, when its next round finds no quorum or
its agreement timeout fires. A fenced node never rejoins: it is not in any later view, and its
messages are answered with FENCE.

Quorum: `decision.has_quorum`.

The timeouts that bound detection and agreement: plane.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from itertools import filterfalse
from typing import Any, Callable, Sequence

from oobleck_hpc.control.decision import (Decision, Fenced, LeaveKind, Quorum, Superseded,
                                          has_quorum, member_set, shared)
from oobleck_hpc.control.exchange import Exchanges, ExchangeSteps
from oobleck_hpc.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_REQUEUE, EXIT_UNRECOVERABLE

__all__ = ["DRAINED", "Decision", "Fenced", "LeaveKind", "MembershipCore", "Quorum",
           "Superseded", "has_quorum"]

DRAINED = "drained at a step boundary"
"""Why the survivors suspect a node that a commit vote drained (4e): a PROPOSE whose reason for
the receiver holds it tells the receiver to wait for its decision, not to fence itself."""

@dataclass
class MembershipCore(ExchangeSteps):
    """The protocol of the module docstring for node `me`. Feed it `suspect()`, `handle()` and
    `exchange()`; after each call drain `outbox` (destination, message) and `notes` (kind, fields).
    """

    me: str
    roster: tuple[str, ...]
    store_port0: int
    alloc_port: Callable[[], int]
    quorum: Quorum = "majority"
    members0: tuple[str, ...] = ()
    """Generation 0's nodes (roster order; empty: the whole roster). The other roster nodes are
    spares: they take part only once a round has added them (`request_join`, step 7)."""
    size: int = 0
    """The job's node count (0: len(members0)): a round adds joiners only while the view is
    smaller, so a spare waits until a loss (and is then swapped in by the loss's own round)."""
    open_to_joins: bool = True
    """Whether this member picks joiners for the rounds it opens (step 7; False until the job
    trains, then `open_joins`). It always takes the joiners a peer's proposal adds."""
    joins_at_boundary: bool = False
    """Whether a round that only adds joiners waits for a step boundary (step 7b): it opens
    when a commit vote completes here (`step_boundary`), so that the step in flight commits
    and nothing is replayed. The driver of the core calls `step_boundary()` itself once
    `joins_held` has lasted too long (no step commits: the job is not training)."""
    hold_rebroadcasts: bool = False
    """Whether a coordinator holds the re-broadcast of its changed proposal (step 2) until
    `flush()`, which its driver calls once `held` is True, after a delay that doubles with each
    re-broadcast of the round (`rebroadcasts`): correlated failures (a switch, a partition)
    then cost a few broadcasts to every member, not one per suspicion."""
    joins_held: bool = field(init=False, default=False)
    """A round that would only add joiners waits for the next step boundary (step 7b)."""
    held: bool = field(init=False, default=False)
    rebroadcasts: int = field(init=False, default=0)
    decided: Decision = field(init=False)
    proposal: tuple[str, ...] | None = field(init=False, default=None)
    suspects: dict[str, str] = field(init=False, default_factory=dict)
    left: set[str] = field(init=False, default_factory=set)
    fenced: str | None = field(init=False, default=None)
    """Why this node no longer takes part: it was fenced (a "fenced" note says so) or it left."""
    fence_code: int = field(init=False, default=EXIT_UNRECOVERABLE)
    """The exit code the fencing asks for (see `Fenced`): 3, 75 (requeue) or 2 (bad input)."""
    draining: bool = field(init=False, default=False)
    """This node leaves by a drain the commit vote decided (4e): it waits for a decision
    without it, then ends with exit 0 (note "drained_out")."""
    outbox: list[tuple[str, dict[str, Any]]] = field(init=False, default_factory=list)
    notes: list[tuple[str, dict[str, Any]]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.me not in self.roster:
            raise ValueError(f"node {self.me!r} is not in the roster {list(self.roster)}")
        members0 = tuple(self.members0) or tuple(self.roster)
        if not set(members0) <= set(self.roster):
            raise ValueError(f"generation 0 {list(members0)} is not part of the roster {list(self.roster)}")
        self.decided = Decision(0, members0, (), members0[0], self.store_port0)
        self._in = member_set(members0)  # decided.nodes, for lookups (thousands of nodes)
        self.size = self.size or len(members0)
        self.joined = self.me in members0
        """False until a decided generation holds this node (a spare, a replacement)."""
        self._since = 0  # the first generation that holds this node (once joined)
        self._asked = False
        self.joiners: dict[str, str] = {}
        """Nodes that asked to join and are not in the view yet (node -> how it asked)."""
        self._removed: set[str] = set()
        """Nodes that were members and left a decided view: they never come back (FENCE), but
        for those in `_withdrawn`."""
        self._withdrawn: set[str] = set()
        """Peers that withdrew themselves (4d): their JOIN readmits them once decided away."""
        self._withdrew_from: int | None = None
        """This node withdrew from that generation (4d) and has not seen itself decided away
        yet: it ignores the rounds and decisions that still hold it."""
        self._readmitted: set[str] = set()
        """Withdrawn nodes readmitted as joiners and not in a decided view yet (`readmits`)."""
        self._rejoins = False
        """This node withdrew (4d) and no decided view holds it again yet: a FENCE before it
        asks to join again is no news."""
        self._unreachable: set[str] = set()
        """Members this node, outside the view, could not reach (`_member_gone`)."""
        self._round_adds: tuple[str, ...] = ()  # the open round's joiners (shrinks like the view)
        self._round_told: tuple[str, ...] = ()  # its joiners when it opened: they hear about it
        self._absorbing = False  # taking over a peer's suspicions (one proposal for all of them)
        self._my_port = 0
        self._told = -1  # the last round this node broadcast as its coordinator
        self._proposals: dict[int, dict[str, tuple[tuple[str, ...], int]]] = {}
        self._chain: dict[int, list[tuple[str, ...]]] = {}
        self._fence_sent: set[str] = set()
        self._reasons: dict[tuple[int, str], dict[str, Any]] = {}
        """Proposals for a later round, kept until it opens here: their `reasons` and
        `readmits` (keys of a PROPOSE)."""
        self._x = Exchanges()
        self._boundary = False  # inside `step_boundary`

    # ------------------------------------------------------------------ inputs

    def suspect(self, node: str, how: str, relayed: bool = False) -> None:
        """Local detection: `node` failed, as seen by `how` (e.g. 'connection_lost');
        `relayed`: learned from a peer's proposal (a spare that a round adds takes it too).
        A node that drains (4e) suspects nobody: it takes part in no round any more."""
        if self.fenced or self.draining:
            return
        if node == self.me:
            self.fence(f"own node failed: {how}")
            return
        if not self.joined and self.proposal is None and not relayed:
            self._member_gone(node, how)  # a spare watches nobody until a round adds it ...
            return
        if node in self.suspects or (node not in self._in and node not in self.joiners
                                     and node not in self._round_adds):
            return
        self.joiners.pop(node, None)  # a joiner that failed never joins (its incarnation is over)
        self.suspects[node] = how
        self.notes.append(("suspect", {"node": node, "how": how, "gen": self.decided.gen}))
        waiting = node not in self._in and node not in self._round_adds  # (nothing to undo)
        if not self._absorbing and not waiting:  # (_absorb proposes once, with all it took over)
            self._update_round()

    def _member_gone(self, node: str, how: str) -> None:
        """... but this node, outside the view (a spare, or withdrawn: 4d), could not reach
        `node` (its agent is gone: a refused connection). Once the members it can still reach
        are too few for a quorum of the last view it knows, no round can add it any more (the
        members fell back or ended without telling it: a fenced member tells no one) -- it
        stops for the requeue instead of waiting for ever (chaos seed 2819, trial 13: a crashed
        node's agent outlived the fallback of the others)."""
        if node not in self.decided.nodes:
            return
        self._unreachable.add(node)
        reachable = [n for n in self.decided.nodes if n != self.me
                     and n not in self._unreachable and n not in self.left]
        if not has_quorum(self.decided.nodes, reachable, self.quorum):
            self.fence(f"the job's members are gone ({how}: {sorted(self._unreachable)} of "
                       f"{list(self.decided.nodes)}): no round can add this node",
                       code=EXIT_REQUEUE)

    def leave(self, how: LeaveKind, code: int, reason: str = "") -> None:
        """This node leaves the job on purpose (BYE). `how`:
        - "finished": its workers ended the job as every node does (the last step is done, or
          all stop for a requeue): peers stop expecting it; no round opens, nobody is fenced;
        - "early": it leaves while the others go on: peers treat it as lost (a round opens);
        - "abort": it rejected the job's input (`code` 2): every peer stops with that code;
        - "drained": its workers left on a drain the commit vote decided, the view's coordinator
          staying (4e): no BYE; it waits for the survivors' decision without it -- unless a
          round open here still holds it (not the drain's, which it never joins): BYE "early"."""
        if self.fenced:
            return
        if how == "drained":
            self.draining = True
            if self.proposal is not None:
                self._bye_drained("a round open here holds it")
            return
        # The end of the job (or its abort) concerns the spares too: they stop with it.
        told = self.decided.nodes if how == "early" else self.roster
        for node in told:
            if node != self.me:
                self.outbox.append((node, {"type": "bye", "how": how, "code": code,
                                           "reason": reason}))
        # From here on this node takes no part (no rounds over peers that exit after it).
        self.fenced, self.fence_code, self.proposal = f"left the job ({how})", code, None

    def withdraw(self, reason: str) -> None:
        """This node steps out of the job while its agent lives (4d: its worker crashed): BYE
        "withdraw" to the view -- a loss for them -- and it is a spare of that view from now
        on, until it asks to join again (`request_join`) and a round adds it."""
        if self.fenced or not self.joined:
            return
        # Its view, and an open round's members and joiners: a joiner may have decided a
        # generation that holds this node already (the random-schedule sweep found one).
        for node in dict.fromkeys(self.decided.nodes + self._round_told + (self.proposal or ())):
            if node != self.me:
                self.outbox.append((node, {"type": "bye", "how": "withdraw",
                                           "code": EXIT_UNRECOVERABLE, "reason": reason}))
        self._fail_exchanges(f"this node withdrew: {reason}")
        self.joined, self._asked, self._withdrew_from = False, False, self.decided.gen
        self._rejoins = True
        self.proposal, self._round_adds, self._round_told = None, (), ()
        self.suspects.clear()
        self.joiners.clear()
        self.notes.append(("withdrawn", {"gen": self.decided.gen, "reason": reason}))

    def drain_out(self, nodes: Sequence[str]) -> None:
        """A commit vote decided that `nodes` leave after its step (4e; every rank computed
        it alike, so every survivor may say so): suspect them all, in one proposal."""
        if self.fenced or not self.joined:
            return
        self._absorbing = True
        try:
            for node in nodes:
                if node != self.me:
                    self.suspect(node, DRAINED)
        finally:
            self._absorbing = False
        self._update_round()

    def _drain_exclusion(self, src: str, kind: Any, msg: dict[str, Any]) -> bool:
        """`msg` from member `src` excludes this node: True when that is its drain (4e) --
        the drain's PROPOSE (its reason names DRAINED) makes it wait, a decision without it
        ends it with exit 0 -- False when it is fenced as usual."""
        if not self.draining:
            reasons = msg.get("reasons") if kind == "propose" else None
            if not isinstance(reasons, dict) or DRAINED not in str(reasons.get(self.me, "")):
                return False
            self.draining = True
            self.notes.append(("draining", {"gen": self.decided.gen, "by": src}))
        if kind in ("fence", "decided") or (
                kind == "propose" and self.me not in msg["decided"]["nodes"]):
            self.fenced, self.fence_code, self.proposal = f"drained (told by {src})", EXIT_OK, None
            self.notes.append(("drained_out", {"gen": self.decided.gen, "how": f"decided "
                                               f"without it ({kind} from {src})"}))
            self._fail_exchanges("this node drained")
        return True

    def _bye_drained(self, why: str) -> None:
        """A node that drains (4e) leaves a round that still holds it as a loss (BYE "early")."""
        self.leave("early", EXIT_OK, "drained")
        self.notes.append(("drained_out", {"gen": self.decided.gen, "how": f"BYE ({why})"}))

    def request_join(self, how: str = "spare", to: Sequence[str] = ()) -> None:
        """This node, outside the view (a spare, a replacement), asks the members (`to`, by
        default the last decided view it knows) to add it (step 7). Asking again is harmless;
        the answer is a PROPOSE that adds it, or FENCE. (A member that still has a node that
        withdrew in its view drops its JOIN: 4d.)"""
        if self.fenced or self.joined:
            return
        for node in to or self.decided.nodes:
            if node != self.me:  # (a node that withdrew may not know it was decided away yet)
                self.outbox.append((node, {"type": "join", "how": how}))
        if not self._asked:
            self._asked = True
            self.notes.append(("join_requested", {"node": self.me, "gen": self.decided.gen,
                                                  "how": how}))

    def add_node(self, node: str) -> None:
        """`node` was not in the roster when this agent started: it was grown into the running
        job (`oobleck-hpc grow`) and joins like a spare (step 7); the end of the job reaches it
        too."""
        if node not in self.roster:
            self.roster += (node,)

    def open_joins(self) -> None:
        """The job trains (its first step committed here): from now on this member adds
        joiners (step 7); one waiting while the view is smaller than the job is added now."""
        if self.open_to_joins:
            return
        self.open_to_joins = True
        if self.joiners and self.proposal is None and not self.fenced:
            self._update_round()

    def step_boundary(self) -> None:
        """A step boundary (step 7b): a commit vote completed here. At the coordinator its
        values are on their way to every member ahead of anything this call sends: a round
        held for joiners opens now. Another member's boundary comes later, when others may
        have begun the next step: it keeps holding them."""
        if self.decided.nodes[0] == self.me:
            self.take_joiners()

    def take_joiners(self) -> None:
        """Open a round held for joiners now: at the coordinator's step boundary, or at any
        member once the joiners were held too long (step 7b)."""
        if not self.joins_held or self.fenced or self.proposal is not None:
            return
        self._boundary = True
        try:
            self._update_round()
        finally:
            self._boundary = False
        self.joins_held = False  # (opened, or nothing left to add)

    def retry(self, why: str) -> bool:
        """Open a round although nobody is suspected (retry in place: a collective failed while
        every peer is alive): the next generation keeps the same nodes with a fresh store, and
        the workers rebuild their groups on it. False (nothing done) when fenced or when a
        round is already open -- that round gives the workers their fresh generation."""
        if self.fenced or self.proposal is not None or not self.joined:
            return False
        self.notes.append(("retry", {"gen": self.round, "why": why}))
        self._update_round(join=True)
        return True

    def fail_self(self, how: str) -> None:
        """This node declares itself failed (e.g. one of its workers crashed)."""
        if self.fenced:
            return
        for node in self.decided.nodes:
            if node != self.me:
                self.outbox.append((node, {"type": "failed", "how": how}))
        self.fence(f"own node failed: {how}")

    def handle(self, src: str, msg: dict[str, Any]) -> None:
        """A message `msg` from node `src` arrived."""
        if self.fenced:
            return
        kind = msg.get("type")
        if not self.joined:
            self._handle_as_spare(src, kind, msg)
            return
        gone = src in self._removed or src in self.suspects or src in self.left
        if src not in self._in and not (src in self._round_adds and not gone):
            self._from_outside(src, kind, msg, gone)
            return
        # A member whose view excludes me: I am fenced (suspicions are never withdrawn).
        if kind == "fence":
            self.fence(f"fenced by {src} (its generation {msg.get('gen')} excludes this node)")
            return
        # (Views from before the generation that added this node naturally leave it out.)
        if ("view" in msg and self.me not in msg["view"] and msg["round"] > self._since) or \
                ("nodes" in msg and self.me not in msg["nodes"] and msg["gen"] >= self._since):
            if not self._drain_exclusion(src, kind, msg):
                self.fence(f"excluded by {src} (generation {msg.get('round', msg.get('gen'))})")
            return
        if "decided" in msg and self.me not in msg["decided"]["nodes"] \
                and msg["decided"]["gen"] >= self._since:
            if not self._drain_exclusion(src, kind, msg):
                self.fence(f"excluded by {src} (its decided generation {msg['decided']['gen']})")
            return
        if self.draining:  # (4e) a round or a decision that still holds this node
            if kind == "propose":
                self._bye_drained(f"{src}'s round {msg.get('round')} holds it")
            if kind != "fence":
                return
        if kind == "failed":
            self.suspect(src, f"{msg.get('how', 'failed')} (reported by {src})")
        elif kind == "bye":
            self._on_bye(src, msg)
        elif src in self.suspects:
            return  # a node I suspect: only its exclusion of me (above) matters
        elif kind == "propose":
            self._on_propose(src, msg)
        elif kind == "decided":
            self._on_decided(src, Decision.from_msg(msg))
        elif kind == "exchange":
            self._on_exchange(src, msg)
        elif kind == "exchange_done":
            self._on_exchange_done(src, msg)
        # heartbeat / hello / ping / pong: liveness only (tracked by the caller)

    def _from_outside(self, src: str, kind: Any, msg: dict[str, Any], gone: bool) -> None:
        """A message from a node outside this member's view: one that never was a member (a
        spare, a replacement), or one that left it (`gone`)."""
        if kind == "bye" and msg.get("how") == "abort":
            self._on_bye(src, msg)  # bad input stops the job, even if src was excluded
            return
        if gone and (src in self._withdrawn or kind == "bye" and msg.get("how") == "withdraw"):
            self._on_withdrawn(src, kind, msg)
            return
        if not gone:  # a node that never was a member: a spare, a replacement
            if kind in ("join", "propose"):
                self._on_join(src, msg.get("how", "joins a round"))
            elif kind in ("bye", "failed") and src in self.joiners:
                self.suspect(src, f"{kind} while joining")
            return
        if kind == "fence" and self.me not in msg.get("nodes", ()):
            # We excluded each other (a partition, or two false suspicions at once): neither
            # side may go on alone, or the job would split in two.
            self.fence(f"{src} and this node excluded each other (split brain averted)",
                       code=EXIT_REQUEUE)
            return
        # No longer a member of my view: tell it, once, that it is fenced.
        if kind not in ("fence", "bye", "failed") and src not in self._fence_sent:
            self._fence_sent.add(src)
            self.outbox.append((src, {"type": "fence", "gen": self.decided.gen,
                                      "nodes": list(self.decided.nodes)}))

    def _on_withdrawn(self, src: str, kind: Any, msg: dict[str, Any]) -> None:
        """A message from `src`, which withdrew (4d) and which this member decided away: its
        JOIN readmits it (a new incarnation's request), a late BYE "withdraw" (this member
        adopted the decision before it arrived) marks it; anything else is dropped -- it
        knows it is out, no FENCE."""
        if kind == "bye":
            self._withdrawn.add(src)
        elif kind == "join":
            self._readmit(src)
            self._on_join(src, msg.get("how", "rejoins"))

    def _readmit(self, node: str) -> None:
        """`node` withdrew, was decided away, and asks to come back (4d): forget it was lost."""
        self._readmitted.add(node)
        self.suspects.pop(node, None)
        self._removed.discard(node)
        self._withdrawn.discard(node)
        self._fence_sent.discard(node)

    def _handle_as_spare(self, src: str, kind: Any, msg: dict[str, Any]) -> None:
        """Before a decided generation holds this node, only the rounds that may add it matter."""
        if kind == "fence":
            # A node that withdrew is outside by its own wish: a member that decided it away
            # before reading its BYE fences what it sent before the BYE (4d); the BYE follows
            # on the same link and makes that member readmit this node's JOIN. Once it asked
            # to join again, a FENCE refuses that (a joiner suspected is out for good: 7).
            if not self._rejoins or self._asked:
                self.fence(f"{src} refuses this node: it was a member and was excluded")
        elif kind == "bye" and msg.get("how") in ("finished", "abort") and src in self.decided.nodes:
            code = msg.get("code", EXIT_OK)  # the job ended (or stopped) before a loss needed it
            self.fence(f"the job ended without this spare ({src}: {msg.get('how')}, exit {code})",
                       code=code)
        elif kind == "propose":
            self._on_propose(src, msg)
        elif kind == "decided":
            self._on_decided(src, Decision.from_msg(msg))

    def _on_join(self, src: str, how: str, open_round: bool = True) -> None:
        """A node outside the view asks to be added (step 7): at once if no round is open (and
        `open_round`), else in the next round."""
        if src in self.joiners:
            return
        self.joiners[src] = how
        self.notes.append(("join_request", {"node": src, "gen": self.decided.gen, "how": how}))
        if self.proposal is None and open_round:
            self._update_round()

    def _on_bye(self, src: str, msg: dict[str, Any]) -> None:
        how, code, reason = msg.get("how", "early"), msg.get("code"), msg.get("reason", "")
        if how == "finished":
            self.joiners.pop(src, None)
            self.left.add(src)
            self.notes.append(("peer_left", {"node": src, "code": code}))
            d = self.decided
            if code == EXIT_REQUEUE and src in d.nodes and self._x.waiting(d.gen):
                self._update_round()  # 4c: it stopped for a requeue alone
        elif how == "abort":
            self.fence(f"{src} stopped the job: bad input: {reason}", code=EXIT_BAD_INPUT)
        elif how == "withdraw":
            self._withdrawn.add(src)
            self.suspect(src, f"withdrew ({reason})")
        else:
            self.suspect(src, f"left_early (exit {code}{': ' + reason if reason else ''})")

    # ------------------------------------------------------------------ protocol

    @property
    def round(self) -> int:
        return self.decided.gen + 1

    def round_waits_on(self) -> list[str]:
        """The nodes the open round waits on, as far as this node can tell: those of its
        proposal with no proposal here yet for the round, if this node coordinates it (it
        gathers them, step 2); else the coordinator, if it has sent none."""
        if self.proposal is None or self.fenced:
            return []
        got = self._proposals.get(self.round, {})
        waits = self.proposal if self.proposal[0] == self.me else self.proposal[:1]
        return [n for n in waits if n != self.me and n not in got]

    @property
    def round_joiners(self) -> tuple[str, ...]:
        """The open round's joiners (none when no round is open)."""
        return self._round_adds

    def _update_round(self, join: bool = False, adds: tuple[str, ...] | None = None) -> None:
        """Open or shrink the round for generation decided.gen + 1 after a change of suspects or
        joiners (`join`: open it even without a local change, because a peer proposed; `adds`:
        the joiners of the peer's proposal that opens it -- by default, this node's own)."""
        g = self.round
        x = (self.suspects.keys() | self.left) & self._in  # (C loops: thousands of nodes)
        base = tuple(filterfalse(x.__contains__, self.decided.nodes)) if x else self.decided.nodes
        if self.proposal is None:
            mine = adds is None
            if adds is None:
                if not self.joined:
                    return  # a spare opens no round: a PROPOSE that adds it does (_absorb)
                want = max(0, self.size - len(base)) if self.open_to_joins else 0
                adds = tuple(sorted(self.joiners))[:want]
            adds = tuple(sorted(adds))
            # (also a round a peer's PROPOSE opens here: its workers, like the coordinator's,
            # move on from the committed step; not a retry, which a failed step opened)
            joins_only = bool(adds) and base == self.decided.nodes and not (join and mine)
            if mine and joins_only and self.joins_at_boundary and not self._boundary:
                if not self.joins_held:  # (7b: at the next step boundary)
                    self.joins_held = True
                    self.notes.append(("joins_held", {"gen": g, "joiners": list(adds)}))
                return
            new = shared(base + adds)
            if not join and new == self.decided.nodes:
                return  # nothing to change
            self._round_adds = self._round_told = adds
            self.joins_held = False
            self._my_port = self.alloc_port()
            self._fail_exchanges("membership round open")
            self.notes.append(("round_started", {"gen": g, "suspects": dict(self.suspects),
                                                 "joiners": list(adds),
                                                 "joins_only": joins_only}))
        else:
            self._round_adds = tuple(a for a in self._round_adds
                                     if a not in self.suspects and a not in self.left)
            new = shared(base + self._round_adds)
            if new == self.proposal:
                return
        if self.me not in new:
            self.fence("this node is suspected")
            return
        if not has_quorum(self.decided.nodes, tuple(filter(self._in.__contains__, new)),
                          self.quorum):
            self.fence(f"no quorum: proposal {list(new)} of generation {g} holds too few of "
                        f"{list(self.decided.nodes)} (quorum={self.quorum})", code=EXIT_REQUEUE)
            return
        self.proposal = new
        self._chain.setdefault(g, []).append(new)
        self._proposals.setdefault(g, {})[self.me] = (new, self._my_port)
        self.notes.append(("proposed", {"gen": g, "nodes": list(new)}))
        if new[0] != self.me:  # to the coordinator (step 2), which tells everyone
            self.outbox.append((new[0], self._propose_msg()))
        elif self.hold_rebroadcasts and self._told == g:
            self.held = True
        else:
            self._broadcast()
        self._check_decide()

    def hold_delay(self, first_s: float, cap_s: float) -> float:
        """How long a driver holds the pending re-broadcast before `flush()`: `first_s`,
        doubled with each re-broadcast already sent in this round, at most `cap_s`."""
        return min(first_s * 2 ** self.rebroadcasts, cap_s)

    def flush(self) -> None:
        """Send the coordinator's held re-broadcast (`hold_rebroadcasts`), if still current."""
        if self.held and self.proposal is not None and self.proposal[0] == self.me:
            self._broadcast()
        self.held = False

    def _broadcast(self) -> None:
        self.rebroadcasts = self.rebroadcasts + 1 if self._told == self.round else 0
        self._told, self.held = self.round, False
        msg = self._propose_msg()
        for node in self.decided.nodes + self._round_told:
            if node != self.me:
                self.outbox.append((node, msg))

    def _propose_msg(self) -> dict[str, Any]:
        assert self.proposal is not None
        return {"type": "propose", "round": self.round, "view": list(self.proposal),
                "port": self._my_port, "decided": self.decided.to_msg(),
                # the suspected members, and joiners (never members): their suspicion spreads
                "reasons": {n: why for n, why in self.suspects.items() if n not in self._removed},
                # joiners that withdrew before (4d): a member that missed their BYE takes them
                "readmits": [n for n in self.proposal if n in self._readmitted]}

    def _on_propose(self, src: str, msg: dict[str, Any]) -> None:
        carried = Decision.from_msg(msg["decided"])
        # A joiner's carried decision is a copy of a member's; a spare learns from any.
        if carried.gen >= self.decided.gen and (src in self._in or not self.joined):
            self._on_decided(src, carried)
            if self.fenced or src in self.suspects:
                return
        g, view = msg["round"], shared(tuple(msg["view"]))
        if g <= self.decided.gen:  # an older round, already decided here
            if g == self.decided.gen and self.joined and src in self._in:
                self.outbox.append((src, {"type": "decided", **self.decided.to_msg()}))
            return
        if not self.joined and self.me not in view and self.proposal is None:
            return  # a round that does not add this spare
        if self._withdrew_from is not None:
            return  # a round of the generation this node withdrew from (4d)
        self._proposals.setdefault(g, {})[src] = (view, msg["port"])
        if g == self.round:
            self._absorb(src, view, msg)
        else:  # (kept until its round opens here: thousands of entries in a partition)
            self._reasons[(g, src)] = {k: msg[k] for k in ("reasons", "readmits") if k in msg}

    def _absorb(self, src: str, view: tuple[str, ...], msg: dict[str, Any]) -> None:
        """Take over the suspicions (`msg["reasons"]`: node -> why) of `src`'s proposal `view`
        for the current round, join it."""
        reasons: dict[str, str] = msg.get("reasons", {})
        # Joiners: a round opened by a peer's proposal adds what it adds -- also when one of the
        # suspicions it carries is what opens it here; an open round keeps only the joiners
        # the peer adds too (others wait for the next round). A node that withdrew and was
        # decided away here is readmitted -- its JOIN reached the peer first -- also when this
        # member never heard its BYE (it was not a member then): the peer says so (4d).
        readmits = set(msg.get("readmits", ()))
        for n in [n for n in view if n not in self._in and (n in self._withdrawn or n in readmits)]:
            self._readmit(n)
        adds = tuple(n for n in view if n not in self._in and n not in self.suspects
                     and n not in self._removed and n not in self.left) \
            if len(view) > len(self._in) or not self._in.issuperset(view) else ()
        gone = self._in.difference(view)
        if self.joined:
            for a in adds:
                if a not in self._round_adds:  # recorded only: the round opens with src's adds
                    self._on_join(a, f"proposed by {src}", open_round=False)
        self._absorbing = True
        try:
            for node in (n for n in self.decided.nodes if n in gone):
                if node not in self.suspects and node not in self.left:
                    # (interned: a cut makes thousands of nodes suspect for the same reason)
                    self.suspect(node, sys.intern(f"via {src}: {reasons.get(node, 'suspected')}"),
                                 relayed=True)
            for node, why in reasons.items():  # a joiner the peer suspects never joins
                # (joiners first: `view` is a tuple of thousands, `reasons` as many in a cut)
                if (node in self.joiners or node in self._round_adds) and node not in view:
                    self.suspect(node, f"via {src}: {why}", relayed=True)
        finally:
            self._absorbing = False
        if self.fenced:
            return
        if self.proposal is None:
            self._update_round(join=True, adds=adds)
        else:
            self._round_adds = tuple(a for a in self._round_adds if a in view or a == self.me)
            self._update_round(join=True)
        self._check_decide()

    def _check_decide(self) -> None:
        if self.proposal is None or self.fenced:
            return
        g, view = self.round, self.proposal
        got = self._proposals.get(g, {})
        if len(got) >= len(view) and all(n in got and got[n][0] == view for n in view):
            store, members = view[0], set(view)
            self._decide(Decision(g, view, tuple(n for n in self.decided.nodes if n not in members),
                                  store, got[store][1],
                                  tuple(n for n in view if n not in self._in)),
                         how="direct")

    def _on_decided(self, src: str, d: Decision) -> None:
        if d.gen < self.decided.gen:
            return
        if d.gen == self.decided.gen:
            if d.nodes != self.decided.nodes:
                self.fence(f"safety check: {src} decided {list(d.nodes)} for generation {d.gen}, "
                            f"this node {list(self.decided.nodes)}")
            return
        if src in self.suspects:
            return
        if not self.joined and self.me not in d.nodes:
            self._rebase(d)
            self._withdrew_from = None  # (4d: decided away; a round may add it again)
            return
        if self._withdrew_from is not None:
            return  # a decision that still holds this node, which withdrew (4d)
        if d.gen > self.round:
            return
        if d.nodes not in self._chain.get(d.gen, []):
            self.fence(f"safety check: {src} decided {list(d.nodes)} for generation {d.gen}, "
                        "a view this node never proposed")
            return
        self._decide(d, how=f"adopted from {src}")

    def _decide(self, d: Decision, how: str) -> None:
        told = self.decided.nodes + self._round_told + d.nodes
        self._rebase(d)
        if not self.joined:
            self.joined, self._since, self._rejoins = True, d.gen, False
        self._removed.update(d.lost)
        self._readmitted.difference_update(d.nodes)
        for node in [j for j in self.joiners if j in self._in]:
            del self.joiners[node]
        self.notes.append(("decided", {**d.to_msg(), "how": how}))
        msg = {"type": "decided", **d.to_msg()}
        for node in dict.fromkeys(told) if how == "direct" else ():  # adopters: step 5
            if node != self.me:
                self.outbox.append((node, msg))
        # Suspicions of nodes still in the decided view (adoption) and pending joiners open the
        # next round at once; proposals that arrived ahead of us are taken into account now.
        self._x.forget_before(d.gen)
        self._update_round()
        for src, (view, _) in sorted(self._proposals.get(self.round, {}).items()):
            if self.fenced:
                return
            if src != self.me and src in d.nodes and src not in self.suspects:
                self._absorb(src, view, self._reasons.pop((self.round, src), {}))
        for key in self._x.keys(d.gen):
            self._check_exchange(d.gen, key)

    def _rebase(self, d: Decision) -> None:
        """Take `d` as the last decided generation (a spare follows the members' decisions
        without taking part; `_decide` for a member) and forget the rounds it closes."""
        self.decided, self._in = d, member_set(d.nodes)
        self.proposal = None
        self._round_adds = self._round_told = ()
        for g in [g for g in {*self._proposals, *self._chain} if g <= d.gen]:
            self._proposals.pop(g, None), self._chain.pop(g, None)  # (closed rounds)
        for key in [k for k in self._reasons if k[0] <= d.gen]:
            del self._reasons[key]

    def fence(self, reason: str, code: int = EXIT_UNRECOVERABLE) -> None:
        """Stop taking part: this node is excluded (or must behave as if it were). `code`: how
        the node ends (see `Fenced`): 3 excluded by its peers, 75 it cannot prove it is in the
        majority (fall back to the checkpoint, requeue), 2 a peer stopped the job (bad input)."""
        if self.fenced:
            return
        self.fenced = reason
        self.fence_code = code
        self.proposal = None
        self.notes.append(("fenced", {"reason": reason, "gen": self.decided.gen, "code": code}))
        self._fail_exchanges(reason)
