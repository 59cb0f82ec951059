"""Plans as plain, printable, hashable data: what every rank reads to know what it runs.

A `Template` is the best pipeline for a node count (computed once per job from the profile).
A `Plan` instantiates templates on named nodes: pipelines, each with a microbatch count.
Ranks are derived, never stored: the rank of GPU `g` of the plan's `i`-th node is `i * G + g`,
where the plan's node order is pipeline by pipeline, node by node.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import cached_property


@dataclass(frozen=True)
class StageSpec:
    """Contiguous layers [layer_start, layer_end) on GPUs `gpus` of the pipeline's node `node`.

    A stage with several GPUs is data-parallel inside its node: each GPU holds all of the stage's
    layers and takes an equal share of every microbatch's samples.
    """

    layer_start: int
    layer_end: int
    node: int
    """Index of the node inside the pipeline (0 .. template.num_nodes - 1)."""
    gpus: tuple[int, ...]
    """Local GPU indices on that node, contiguous."""

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)


@dataclass(frozen=True)
class Template:
    """The optimal pipeline for `num_nodes` nodes of `gpus_per_node` GPUs (paper section 4.1)."""

    num_nodes: int
    gpus_per_node: int
    stages: tuple[StageSpec, ...]
    stage_forward_ms: tuple[float, ...]
    """Per stage, per microbatch: compute of the stage's layers on its share of the samples."""
    stage_backward_ms: tuple[float, ...]
    """Per stage, per microbatch: backward compute plus in-stage gradient all-reduce share."""
    send_ms: tuple[float, ...]
    """Per stage boundary (len(stages) - 1): activation transfer stage i -> i+1 (gradient back
    costs the same)."""
    peak_memory_bytes: tuple[int, ...]
    """Per stage: the peak memory of one of its GPUs under 1F1B."""
    microbatches: int = 0
    """The microbatch count the template was optimised for (planning/cost.py, `m_t`)."""
    iteration_ms: float = 0.0
    """pipeline_iteration_ms(self, microbatches): the optimised objective."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layer_end


@dataclass(frozen=True)
class PipelineSpec:
    template: Template
    nodes: tuple[str, ...]
    """Names of the nodes this pipeline runs on, in stage order (len == template.num_nodes)."""
    microbatches: int
    """Microbatches of the global batch this pipeline processes each step."""


@dataclass(frozen=True)
class RankInfo:
    """Everything one rank needs to know about its place in a plan."""

    rank: int
    node: str
    local_gpu: int
    pipeline: int
    stage: int
    replica: int
    """Index of this GPU inside its stage (0 .. replicas - 1)."""
    replicas: int
    layer_start: int
    layer_end: int


@dataclass(frozen=True)
class Plan:
    pipelines: tuple[PipelineSpec, ...]
    global_microbatches: int
    predicted_iteration_ms: float
    generation: int = 0

    @cached_property
    def gpus_per_node(self) -> int:
        return self.pipelines[0].template.gpus_per_node

    @cached_property
    def num_layers(self) -> int:
        return self.pipelines[0].template.num_layers

    @cached_property
    def nodes(self) -> tuple[str, ...]:
        return tuple(n for p in self.pipelines for n in p.nodes)

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.gpus_per_node

    @cached_property
    def _node_index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.nodes)}

    def rank_of(self, node: str, local_gpu: int) -> int:
        return self._node_index[node] * self.gpus_per_node + local_gpu

    @cached_property
    def ranks(self) -> tuple[RankInfo, ...]:
        """RankInfo for every rank, indexed by rank."""
        out = []
        for pi, p in enumerate(self.pipelines):
            for si, s in enumerate(p.template.stages):
                node = p.nodes[s.node]
                for ri, g in enumerate(s.gpus):
                    out.append(RankInfo(self.rank_of(node, g), node, g, pi, si, ri, len(s.gpus),
                                        s.layer_start, s.layer_end))
        out.sort(key=lambda r: r.rank)
        assert [r.rank for r in out] == list(range(self.world_size)), "plan leaves a GPU idle"
        return tuple(out)

    def layout(self) -> list[str]:
        """One line per pipeline: its template, microbatches and stages, each stage as
        `L<first>-<last>@<node>:<gpus>`."""
        lines = []
        for i, p in enumerate(self.pipelines):
            stages = " | ".join(f"L{s.layer_start}-{s.layer_end - 1}@{p.nodes[s.node]}:"
                                f"{','.join(map(str, s.gpus))}" for s in p.template.stages)
            lines.append(f"pipeline {i}: {p.template.num_nodes}-node template, {p.microbatches} "
                         f"microbatch{'es' if p.microbatches != 1 else ''}: {stages}")
        return lines

    def layer_owners(self, layer: int) -> tuple[int, ...]:
        """Ranks holding `layer` (one or more per pipeline), sorted."""
        return tuple(r.rank for r in self.ranks if r.layer_start <= layer < r.layer_end)

    def to_dict(self) -> dict:
        return asdict(self)

    def digest(self) -> str:
        """Checksum survivors exchange to confirm they computed the same plan."""
        payload = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()[:16]
