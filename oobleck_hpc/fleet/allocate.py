"""The fleet's decision: how many nodes each job gets, exactly, with the cost of every move.

Input: per job j its WAF curve W_j(n) for n = 0..N (weight x achieved FLOP/s on n nodes, 0
where the planner has no plan), its bounds min_j..max_j, its transition time t_j (seconds a
job pauses when its node count changes: recovery after a drain, join after a grow) and
optionally its current node count c_j; the pool's N nodes and the expected time T to the next
failure (the pool's MTBF). Output: the counts n_j that maximise

    sum_j  v_j(n_j),   v_j(n) = W_j(n)                  if n == c_j (no move, no cost)
                              = W_j(n) * (1 - t_j / T)  otherwise

subject to sum_j n_j <= N and n_j in {0} U [min_j, max_j] (0: the job waits for nodes).
v_j is the job's work over the time to the next failure, divided by T: a job that moves
trains at its new rate for T - t_j of it. So a move is made only when its gain over T pays for
the pauses of the jobs it touches (both the one that gives a node and the one that takes it).
Without a current allocation (a fresh plan) nothing moves and nothing costs.

Solved exactly by dynamic programming over jobs x nodes, backwards: G_{J+1}(m) = 0 and

    G_j(m) = max over n in C_j, n <= m of  v_j(n) + G_{j+1}(m - n)

(the best value of jobs j..J on at most m nodes; non-decreasing in m), each step a max-plus
convolution done with numpy in blocks of candidate counts. Two prunings, both exact:
C_j keeps only the counts whose value is above that of every smaller count (a count that buys
no more than a smaller one is never needed: G is non-decreasing, so the smaller count is as
good and leaves nodes over; for a planner's curve, flat between the node counts where another
pipeline fits, that removes most counts); and a block of counts lo..hi is skipped at every m
where even v_j(hi) + G_{j+1}(m - lo), a bound on all its sums, does not beat the best so far
(blocks are taken from the largest counts down). The work is at most sum_j |C_j| x N / 2
additions, O(J x N^2), as for any exact max-plus convolution of arbitrary curves; the bound
skips most of it unless the jobs are nearly tied at every split (bench/fleet.py measures both:
64 jobs x 4,096 nodes in about 0.1 s of CPU, 0.6 s when every split is nearly tied).

Ties, deterministic: among allocations of equal value the one that gives the fewest nodes to
the first job (in the fleet file's order), then to the second, and so on -- lexicographically
smallest. The forward pass picks, for each job in turn, the smallest count that reaches the
optimum (the same floating-point sums the backward pass maximised, so the comparison is exact).
Pure: numpy only, no processes, no files.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BLOCK = 32
"""Candidate counts convolved at once (one BLOCK x N array: fewer numpy calls, still in cache)."""


@dataclass(frozen=True)
class JobCurve:
    """One job, as the decision sees it."""

    name: str
    waf: np.ndarray
    """WAF_j(n) for n = 0..len-1 (weighted FLOP/s; 0 where no plan). Counts past its end are
    not allowed."""
    min_nodes: int = 1
    max_nodes: int | None = None
    transition_s: float = 0.0
    """Seconds the job pauses when its node count changes."""
    current: int | None = None
    """Its node count now (None: not running or no current allocation)."""


@dataclass(frozen=True)
class Decision:
    nodes: tuple[int, ...]
    """Each job's node count, in the order of the input."""
    waf: tuple[float, ...]
    """Each job's WAF on its nodes (no move cost)."""
    objective: float
    """sum of v_j(n_j): the WAF net of the moves' cost amortised over the horizon."""
    moved: tuple[bool, ...]
    """Whether each job's count changes from its current one."""

    @property
    def total_waf(self) -> float:
        return float(sum(self.waf))


def values(job: JobCurve, nodes: int, horizon_s: float) -> np.ndarray:
    """v_j(n) for n = 0..nodes: -inf where n is not allowed (1..min-1, above max or the curve)."""
    v = np.full(nodes + 1, -np.inf)
    top = min(nodes, len(job.waf) - 1, job.max_nodes if job.max_nodes is not None else nodes)
    low = max(job.min_nodes, 1)
    if top >= low:
        v[low:top + 1] = job.waf[low:top + 1]
    if job.current is not None and math.isfinite(horizon_s):
        keep = v.copy()
        allowed = np.isfinite(v)
        v[allowed] *= 1.0 - job.transition_s / horizon_s
        if 0 <= job.current <= nodes:
            v[job.current] = keep[job.current]
    v[0] = 0.0
    return v


def candidates(v: np.ndarray) -> np.ndarray:
    """The counts whose value is strictly above every smaller count's (0 always)."""
    best_before = np.maximum.accumulate(np.concatenate(([-np.inf], v[:-1])))
    return np.flatnonzero(v > best_before)


def convolve(v: np.ndarray, cand: np.ndarray, g: np.ndarray) -> np.ndarray:
    """out[m] = max over c in cand, c <= m of v[c] + g[m - c], m = 0..len(g)-1 (cand[0] = 0).

    Blocks of candidates, the largest counts first; a block is skipped where it cannot win:
    its sums are at most v[its largest count] + g[m - its smallest count] (g non-decreasing),
    and where that is not above the best so far no count of the block can beat it."""
    n = len(g) - 1
    out = g + v[0]
    padded = np.concatenate((np.full(n, -np.inf), g))
    windows = np.lib.stride_tricks.sliding_window_view(padded, n + 1)  # windows[n-c][m] = g[m-c]
    buf = np.empty((BLOCK, n + 1))
    starts = range(1, len(cand), BLOCK)
    for start in reversed(starts):
        block = cand[start:start + BLOCK]
        low, high, k = int(block[0]), int(block[-1]), len(block)
        open_ = np.flatnonzero(v[high] + g[:n + 1 - low] > out[low:])
        if not len(open_):
            continue
        first, last = low + int(open_[0]), low + int(open_[-1]) + 1  # columns that may change
        if high - low == k - 1:  # consecutive counts: the rows are a view, nothing copied
            rows = windows[n - high:n - low + 1, first:last][::-1]
        else:
            rows = windows[n - block, first:last]
        sums = np.add(rows, v[block][:, None], out=buf[:k, :last - first])
        np.maximum(out[first:last], sums.max(axis=0), out=out[first:last])
    return out


def solve(vals: Sequence[np.ndarray], nodes: int) -> tuple[list[int], float]:
    """The lexicographically smallest allocation of the best value, and that value. vals[j][n]
    is v_j(n) for n = 0..nodes (-inf: not allowed; vals[j][0] must be finite)."""
    cands = [candidates(v) for v in vals]
    g = [np.zeros(nodes + 1)]  # g[k] = G_{J-k+1}: built from the last job backwards
    for v, c in zip(reversed(vals[1:]), reversed(cands[1:])):
        g.append(convolve(v, c, g[-1]))
    g.reverse()  # g[j] = best of jobs j+1.. on m nodes
    left, out = nodes, []
    for v, c, rest in zip(vals, cands, g):
        c = c[c <= left]
        total = v[c] + rest[left - c]
        pick = int(c[int(np.argmax(total))])  # argmax: the first, so the smallest count
        out.append(pick)
        left -= pick
    best = float(sum(v[n] for v, n in zip(vals, out)))
    return out, best


def decide(jobs: Sequence[JobCurve], nodes: int, horizon_s: float = math.inf) -> Decision:
    """The allocation of `nodes` among `jobs` (module docstring). horizon_s: the expected time
    to the next failure in the pool; inf (or no job with a current count) makes moves free."""
    if nodes < 0:
        raise ValueError(f"nodes must be >= 0, not {nodes}")
    if not jobs:
        return Decision((), (), 0.0, ())
    vals = [values(job, nodes, horizon_s) for job in jobs]
    counts, objective = solve(vals, nodes)
    waf = tuple(float(job.waf[n]) if n < len(job.waf) else 0.0 for job, n in zip(jobs, counts))
    moved = tuple(job.current is not None and n != job.current for job, n in zip(jobs, counts))
    return Decision(tuple(counts), waf, objective, moved)
