"""Pipeline templates: the exact optimal pipeline for every node count (paper section 4.1).

A template for n nodes of G GPUs splits the model's L layers into contiguous stages; each stage
runs on 1..G GPUs of one node (never across nodes) and every GPU of the n nodes is used. Its cost
is the 1F1B time of planning/cost.py for m microbatches:

    pipe(m) = sum_i t_i + 2 * sum_i c_i + (m - 1) * max_i t_i

Why not "best sub-plan per sub-problem". The objective is a sum plus (m - 1) times a maximum;
the best way to place the first layers depends on the bottleneck of the rest, so a DP that keeps
one optimum per sub-problem (what the reference implementation does) can miss the optimum.

The exact algorithm. Fix a threshold tau and allow only stages with t_i <= tau. Let
S_tau(n) = the minimum of  sum_i t_i + 2 sum_i c_i  over such n-node pipelines; that IS
decomposable and a DP computes it for every n at once (below). Then

    OPT(n) = min over tau in {stage times} of  S_tau(n) + (m - 1) * tau.

Proof: every plan with bottleneck tau' is admissible at tau = tau', where its value is exactly
S + (m-1) tau' >= S_tau'(n) + (m-1) tau'; conversely S_tau(n) + (m-1) tau is the value of an
admissible plan whose own bottleneck is <= tau, i.e. an upper bound of a real plan's cost. So the
minimum over the candidates equals the optimum.

Not every candidate needs a DP: tau -> S_tau(n) is non-increasing, so on an interval of
candidates [tau_i, tau_j] the objective is at least S_tau_j(n) + (m - 1) tau_i, and if
S_tau_i(n) == S_tau_j(n) the best point of the interval is tau_i itself. A branch and bound over
the sorted candidates (evaluate both ends, prune, else split in the middle) visits few of them.

The DP (right to left, all node counts at once). V[q][u][a] = the least  sum t + 2 sum c  that
covers layers [a, L) when the current node still has u free GPUs and q - 1 full nodes follow.
A stage [a, b) on k <= u GPUs leads to V[q][u-k][b] (+ 2 c_intra) when u - k > 0, to
V[q-1][G][b] (+ 2 c_inter) when it fills the node, and ends the pipeline when q = 1 and b = L.
Its memory bound uses GPUs after it = (u - k) + G (q - 1) and layers after it = L - b, so the
suffix state carries all it needs. Template(n) = V[n][G][0]. Numpy evaluates each (q, u) as one
min over a (k, a, b) array.

Tie rule (determinism): among equal objectives the smallest bottleneck candidate wins; inside the
DP, at every state the stage with the fewest layers and then the fewest GPUs wins (first index of
numpy's argmin over (layers, GPUs)). Same profile, same inputs -> byte-identical templates.

Node counts above L have no template (each node holds at least one layer); counts whose memory
does not fit are left out of the result.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from dataclasses import dataclass

import numpy as np

from oobleck_hpc.planning import cost
from oobleck_hpc.planning.plan import StageSpec, Template
from oobleck_hpc.profiling.profile import ModelProfile

INF = float("inf")


@dataclass
class _Arrays:
    """Per-(k, a, b) stage tables shared by every threshold."""

    L: int
    G: int
    time: np.ndarray  # (G+1, L+1, L+1): t(a, b, k); inf where b <= a
    fit: np.ndarray  # (G+1, L+1, L+1): most microbatches in flight that fit (int64; -1: never)
    c_intra: np.ndarray  # (L+1,): 2 * c after layer b-1 inside a node (index b)
    c_inter: np.ndarray  # (L+1,)


def _arrays(profile: ModelProfile, microbatches: int) -> _Arrays:
    layers = profile.layers
    L, G = len(layers), profile.machine.gpus_per_node
    m = profile.machine
    mb = profile.fingerprint.microbatch_size
    opt = np.array([x.optimizer_ms for x in layers], dtype=np.float64)
    state = np.array([x.param_bytes + x.grad_bytes + x.optimizer_bytes for x in layers], dtype=np.int64)
    act = np.array([x.activation_bytes for x in layers], dtype=np.int64)
    grad = [x.grad_bytes for x in layers]

    def prefix(v):
        return np.concatenate([np.zeros(1, dtype=v.dtype), np.cumsum(v)])

    a_idx, b_idx = np.meshgrid(np.arange(L + 1), np.arange(L + 1), indexing="ij")
    valid = b_idx > a_idx
    Sp, Ap, Op = prefix(state), prefix(act), prefix(opt)
    Sd, Ad = Sp[b_idx] - Sp[a_idx], Ap[b_idx] - Ap[a_idx]
    time = np.full((G + 1, L + 1, L + 1), INF)
    fit = np.full((G + 1, L + 1, L + 1), -1, dtype=np.int64)
    mem = int(m.device_memory_bytes)
    big = np.int64(1) << 40
    for k in range(1, G + 1):
        # y: per-layer in-node all-reduce (cost.stage_allreduce_ms), summed by prefix
        y = np.array([cost.allreduce_ms(m.allreduce_intra, g, k) for g in grad], dtype=np.float64)
        Yp = prefix(y)
        # f_l(k), b_l(k): cost.layer_compute_ms (rows per GPU, or the ideal split)
        fb = np.array([cost.layer_compute_ms(x, k, mb) for x in layers], dtype=np.float64)
        Fp, Bp = prefix(fb[:, 0]), prefix(fb[:, 1])
        Fd, Bd = Fp[b_idx] - Fp[a_idx], Bp[b_idx] - Bp[a_idx]
        once = (Yp[b_idx] - Yp[a_idx]) + (Op[b_idx] - Op[a_idx])  # y_i + o_i, once a step
        t = Fd + (Bd + once / max(1, microbatches))
        time[k] = np.where(valid, t, INF)
        room = k * (mem - Sd)  # k * state + inflight * act <= k * mem
        with np.errstate(divide="ignore"):
            f = np.where(Ad > 0, room // np.maximum(Ad, 1), np.where(room >= 0, big, -1))
        fit[k] = np.where(valid & (room >= 0), f, -1)
    c_intra = np.full(L + 1, INF)
    c_inter = np.full(L + 1, INF)
    for b in range(1, L):
        c_intra[b] = 2.0 * cost.send_ms(profile, b - 1, same_node=True)
        c_inter[b] = 2.0 * cost.send_ms(profile, b - 1, same_node=False)
    return _Arrays(L, G, time, fit, c_intra, c_inter)


class _Solver:
    """Threshold DP for all node counts 1..qmax on a banded (a, d) layout: a stage [a, a+d+1)
    is at most `width` layers long (the longest that fits in memory at all), so each (q, u) step
    is one min over a (k, a, d) array. Memory masks are cached across thresholds."""

    def __init__(self, ar: _Arrays, qmax: int):
        self.ar, self.qmax = ar, qmax
        L = ar.L
        feasible = np.isfinite(ar.time[1:]) & (ar.fit[1:] >= 1)
        a_i, b_i = np.nonzero(feasible.any(axis=0))
        self.width = w = max(1, int((b_i - a_i).max()) if len(a_i) else 1)
        a = np.arange(L + 1)[:, None]
        d = np.arange(w)[None, :]
        self.bidx = np.minimum(a + d + 1, L + 1)  # (L+1, w) end layer b, L+1 = out of range
        inside = (a + d + 1) <= L
        self.col = np.where(inside, 1 + L - (a + d + 1), 0)  # 1 + layers after the stage
        bcl = np.minimum(self.bidx, L)
        self.time = np.where(inside[None], ar.time[:, a, bcl], INF)  # (G+1, L+1, w)
        self.fit = np.where(inside[None], ar.fit[:, a, bcl], -1)
        self._mem: dict[tuple[int, int], np.ndarray] = {}
        self.end = np.full(L + 2, INF)
        self.end[L] = 0.0
        self.end_max = np.zeros(L + 2)
        self.c_intra = np.append(ar.c_intra, INF)
        self.c_inter = np.append(ar.c_inter, INF)

    def masked(self, k: int, x: int) -> np.ndarray:
        """t(a, b, k) where the stage fits with min(x, 1 + layers after) microbatches in flight,
        x = 1 + GPUs after the stage (clamped at L + 1, beyond which the layer bound decides)."""
        key = (k, x)
        out = self._mem.get(key)
        if out is None:
            out = np.where(np.minimum(x, self.col) <= self.fit[k], self.time[k], INF)
            self._mem[key] = out
        return out

    def solve(self, tau: float, minmax: bool = False) -> tuple[np.ndarray, np.ndarray, list]:
        """For q = 0..qmax: S_tau(q) (inf where none), the bottleneck of the chosen plan, and the
        argmin tables for reconstruction. With `minmax`, the same DP in the (max, min) semiring
        (no threshold): the first array is then the least possible bottleneck per node count."""
        L, G = self.ar.L, self.ar.G
        # stages longer than any stage within tau are never admissible: crop the band
        within = (self.time[1:] <= tau).any(axis=(0, 1))
        w = int(np.nonzero(within)[0][-1]) + 1 if within.any() else 1
        # V[q, b, u]: value of state (q, u, a=b); M: the bottleneck along the chosen path.
        V = np.full((self.qmax + 1, L + 2, G + 1), INF)
        M = np.zeros((self.qmax + 1, L + 2, G + 1))
        args = []
        thr: dict[tuple[int, int], np.ndarray] = {}
        stacks: dict[tuple, np.ndarray] = {}
        rows = np.arange(L + 1)
        bidx = self.bidx[:, :w]
        c_intra = self.c_intra[:, None]
        for q in range(1, self.qmax + 1):
            row_args: list[tuple[Any, Any] | None] = [None] * (G + 1)
            if q == 1:
                last_v, last_m = self.end, self.end_max
            elif minmax:
                last_v, last_m = V[q - 1, :, G], M[q - 1, :, G]
            else:
                last_v, last_m = V[q - 1, :, G] + self.c_inter, M[q - 1, :, G]
            for u in range(1, G + 1):
                xs = tuple(min(1 + (u - k) + G * (q - 1), L + 1) for k in range(1, u + 1))
                skey = (u, xs)
                st = stacks.get(skey)
                if st is None:
                    parts = []
                    for k, x in zip(range(1, u + 1), xs):
                        tm = thr.get((k, x))
                        if tm is None:
                            base = self.masked(k, x)[:, :w]
                            tm = np.where(base <= tau, base, INF)
                            thr[(k, x)] = tm
                        parts.append(tm)
                    st = np.ascontiguousarray(np.stack(parts, axis=-1))  # (a, d, k)
                    stacks[skey] = st
                # column k-1 (k = 1..u): rest = u - k; rest > 0 stays on this node
                nv = np.empty((L + 2, u))
                nm = np.empty((L + 2, u))
                if u > 1:
                    nv[:, :u - 1] = V[q, :, u - 1:0:-1] if minmax else V[q, :, u - 1:0:-1] + c_intra
                    nm[:, :u - 1] = M[q, :, u - 1:0:-1]
                nv[:, u - 1] = last_v
                nm[:, u - 1] = last_m
                if minmax:
                    flat = np.maximum(st, nv[bidx]).reshape(L + 1, w * u)
                else:
                    flat = (st + nv[bidx]).reshape(L + 1, w * u)  # (a, d*k)
                idx = flat.argmin(axis=1)
                V[q, :L + 1, u] = flat[rows, idx]
                dd, kk = np.divmod(idx, u)
                b = bidx[rows, dd]
                M[q, :L + 1, u] = np.maximum(st[rows, dd, kk], nm[b, kk])
                row_args[u] = (kk + 1, b)
            args.append(row_args)
        return V[:, 0, G].copy(), M[:, 0, G].copy(), args


def _reconstruct(args: list, n: int, L: int, G: int) -> list[tuple[int, int, int, int, int]]:
    """(start, end, k, node, first_gpu) of the stages of the n-node optimum."""
    out = []
    q, u, a = n, G, 0
    while True:
        kk, bb = args[q - 1][u]
        k, b = int(kk[a]), int(bb[a])
        out.append((a, b, k, n - q, G - u))
        rest = u - k
        if rest > 0:
            u, a = rest, b
        elif q > 1:
            q, u, a = q - 1, G, b
        else:
            assert b == L
            return out


def make_template(profile: ModelProfile, stages: list[tuple[int, int, int, int, int]],
                  num_nodes: int, microbatches: int) -> Template:
    """A Template from (start, end, k, node, first_gpu) stages, every number from cost.py."""
    G, L = profile.machine.gpus_per_node, profile.num_layers
    specs, fwd, bwd, sends, peaks = [], [], [], [], []
    for i, (a, b, k, node, g0) in enumerate(stages):
        specs.append(StageSpec(a, b, node, tuple(range(g0, g0 + k))))
        fwd.append(cost.stage_forward_ms(profile, a, b, k))
        bwd.append(cost.stage_backward_ms(profile, a, b, k, microbatches))
        gpus_after = sum(s[2] for s in stages[i + 1:])
        peaks.append(cost.stage_memory_bytes(profile, a, b, k, cost.inflight_bound(gpus_after, L - b)))
        if i + 1 < len(stages):
            sends.append(cost.send_ms(profile, b - 1, same_node=stages[i + 1][3] == node))
    t = Template(num_nodes, G, tuple(specs), tuple(fwd), tuple(bwd), tuple(sends), tuple(peaks),
                 microbatches=microbatches)
    from dataclasses import replace

    return replace(t, iteration_ms=cost.pipeline_iteration_ms(t, microbatches))


def feasible_node_counts(profile: ModelProfile, max_nodes: int) -> list[int]:
    """Node counts 1..max_nodes on which one replica fits in memory (any stage times)."""
    qmax = min(max_nodes, profile.num_layers)
    if qmax < 1:
        return []
    ar = _arrays(profile, 1)
    if not (np.isfinite(ar.time[1:]) & (ar.fit[1:] >= 1)).any():
        return []
    S, _, _ = _Solver(ar, qmax).solve(INF)
    return [q for q in range(1, qmax + 1) if S[q] < INF]


def build_templates(profile: ModelProfile, node_counts: Iterable[int],
                    microbatches: int) -> dict[int, Template]:
    """The optimal template for each node count in `node_counts` that has one (feasible sizes
    only; counts above the layer count or whose memory does not fit are absent).

    `microbatches` is the m of the 1F1B objective: the number of microbatches one pipeline is
    expected to run. A job picks it with `template_microbatches` (planning/__init__.py): its
    global batch divided by the number of pipelines it would run on all its nodes.
    """
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    wanted = sorted({int(n) for n in node_counts if 1 <= int(n) <= profile.num_layers})
    if not wanted:
        return {}
    ar = _arrays(profile, microbatches)
    L, G = ar.L, ar.G
    usable = np.isfinite(ar.time[1:]) & (ar.fit[1:] >= 1)
    if not usable.any():
        return {}
    cands = np.unique(ar.time[1:][usable])
    solver = _Solver(ar, wanted[-1])
    w = np.array(wanted)
    scale = float(microbatches - 1)
    nw = len(wanted)

    # Per node count: known S at evaluated candidate indices, open intervals, best found.
    known: list[dict[int, float]] = [dict() for _ in range(nw)]
    best = np.full(nw, INF)
    best_key = [(INF, -1)] * nw  # (bottleneck index, evaluation index) for the tie rule
    evaluated: dict[int, list] = {}

    def evaluate(i: int) -> None:
        S, Mx, args = solver.solve(float(cands[i]))
        evaluated[i] = args
        S, Mx = S[w], Mx[w]
        for pos in range(nw):
            s = float(S[pos])
            known[pos][i] = s
            if s == INF:
                continue
            j = int(np.searchsorted(cands, Mx[pos]))  # the plan's own bottleneck (exact value)
            known[pos][j] = s  # S is constant on [bottleneck, tau]
            obj = s + scale * float(cands[j])
            key = (j, i)
            if obj < best[pos] or (obj == best[pos] and key < best_key[pos]):
                best[pos] = obj
                best_key[pos] = key

    def open_intervals(pos: int) -> list[tuple[int, int]]:
        """Intervals between consecutive known candidates that may hide a better plan."""
        pts = sorted(known[pos].items())
        out = []
        for (i, si), (j, sj) in zip(pts, pts[1:]):
            if j - i <= 1 or sj == INF or si == sj:
                continue
            if sj + scale * float(cands[i + 1]) < best[pos]:
                out.append((i, j))
        return out

    # No plan on n nodes has a bottleneck below the least possible one (the same DP in the
    # (max, min) semiring), so S is infinite below it.
    least, _, _ = solver.solve(INF, minmax=True)
    for pos, n in enumerate(wanted):
        if least[n] < INF:
            j = int(np.searchsorted(cands, least[n])) - 1
            if j >= 0:
                known[pos][j] = INF
    evaluate(len(cands) - 1)
    while True:
        # the midpoints of all open intervals; evaluate the one inside the most of them (shared
        # by the most node counts; ties: the smallest), so one DP serves many node counts
        intervals = [iv for pos in range(nw) for iv in open_intervals(pos)]
        if not intervals:
            break
        mids = sorted({(i + j) // 2 for i, j in intervals})
        cover = [sum(1 for i, j in intervals if i < x < j) for x in mids]
        evaluate(mids[int(np.argmax(cover))])

    out: dict[int, Template] = {}
    for pos, n in enumerate(wanted):
        if best[pos] == INF:
            continue
        stages = _reconstruct(evaluated[best_key[pos][1]], n, L, G)
        out[n] = make_template(profile, stages, n, microbatches)
    return out
