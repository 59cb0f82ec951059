"""The YAML job file as typed dataclasses.

One dataclass per concern; every field is documented where it is declared. Loading is strict:
an unknown key is answered with the list of valid keys, a value of the wrong type or out of range
with the file, the key, the value and the fix -- before any process is started or node allocated.

    job = load_job("examples/gpt-tiny-local.yaml")
    job.cluster.nodes, job.train.global_microbatches, ...

A job can also be built in Python (`JobConfig(model=ModelConfig(name="gpt-tiny"), ...)`) and
checked with `job.validate()`. The strict loading itself (types, unknown keys) is schema.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from oobleck_hpc.errors import ConfigError, YamlSyntaxError
from oobleck_hpc.schema import Where as _Where
from oobleck_hpc.schema import build as _build
from oobleck_hpc.schema import walk as _walk

# The control plane's defaults, here once: the job file's fault_tolerance, the agent's flags
# (control/agent_options.py), control/plane.py's constructor and the protocol simulator
# (testing/netsim.py) take them from here. (Importing this module imports no torch.)
HEARTBEAT_S = 0.5
"""Interval of the agents' heartbeats on the control plane."""
LEASE_S = 3.0
"""A node whose heartbeat is older than this is declared lost."""
STARTUP_S = 60.0
"""How long the agents wait for each other's first connection at start."""
FENCED_GRACE_S = 2.0
"""How long a fenced node's workers get to exit before its agent kills them."""


@dataclass
class ModelConfig:
    name: str = "gpt-tiny"
    """A model of the built-in GPT family (gpt-tiny, gpt2-small, gpt3-350m ... gpt3-175b),
    or a label for the user's own model when `factory` or `hf` is set."""
    factory: str | None = None
    """`package.module:function` returning the user's own layer list (see oobleck_hpc/models)."""
    hf: str | None = None
    """A directory holding a Hugging Face config.json (llama, mistral, qwen2, gpt2, gpt_neox:
    models/hf_config.py), cut into layers with transformers' own modules (`pip install
    'oobleck_hpc[hf]'`); dropout off, so a step is a pure function of weights and batch."""
    weights: str | None = None
    """Pretrained weights of the model.hf model: a directory holding `model.safetensors` or
    shards with `model.safetensors.index.json` (as save_pretrained writes them). A layer built
    fresh at the start of a run is read from them (each rank reads only its layers' tensors);
    a checkpoint's or a surviving replica's state still wins (models/hf_weights.py)."""
    seed: int = 0
    """Every layer is built from (seed, layer index): replicas start bit-identical."""
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    """float32: parameters and compute in fp32; bfloat16: fp32 parameters, autocast to bf16 for
    the compute; float64: the model is built in fp64 -- for exact comparisons with the fp64
    single-process reference (`engine.reference_run`; tests, `oobleck-hpc chaos`). A float64 job
    is profiled and planned as its float32 twin (`profile_dtype`): same profile, same plan."""

    @property
    def profile_dtype(self) -> str:
        """The dtype the job's profile is measured in and looked up by (float64 -> float32)."""
        return "float32" if self.dtype == "float64" else self.dtype

    def check(self, where: _Where) -> None:
        from oobleck_hpc.models.configs import check_model  # pure data, no torch

        check_model(self, where)


@dataclass
class DataConfig:
    corpus: str = "stdlib"
    """'stdlib' (the Python standard library's source files: real text on every machine, no
    download) or a path to a UTF-8 text file or a directory of them."""
    tokenizer: str | None = None
    """A directory holding a Hugging Face tokenizer.json (and optionally tokenizer_config.json,
    whose eos_token joins the corpus's files): the corpus is tokenised with it (needs `pip
    install 'oobleck_hpc[hf]'`). Unset: byte-level, 256 ids. Its vocabulary must not be larger
    than the model's."""
    tokens: str | None = None
    """Pre-tokenized data used in place instead of `corpus` (memory-mapped, never copied):
    FILE.bin (a flat token file as nanoGPT writes it; set `dtype`), FILE.npy (a 1-D integer
    array), or PREFIX.idx of a Megatron-LM indexed dataset (PREFIX.bin beside it). Every id
    must be below the model's vocabulary size (oobleck_hpc/data/pretokenized.py)."""
    dtype: Literal["uint16", "uint32"] | None = None
    """The token type of a flat .bin in `tokens` (it has no header to say it): uint16 (nanoGPT,
    GPT-2's vocabulary) or uint32. .npy and Megatron files state their own."""
    seq_len: int | None = None
    """Tokens per sample; defaults to the model's context length."""
    cache_dir: str = ".cache/oobleck_hpc"
    """Where the tokenised corpus is memory-mapped from (tokenised once, reused by every node),
    and where the id range of a pre-tokenized file is remembered once scanned."""

    def check(self, where: _Where) -> None:
        if self.seq_len is not None and self.seq_len < 2:
            where.fail("seq_len", self.seq_len, "must be at least 2", "use e.g. 64")
        suffix = Path(self.tokens).suffix if self.tokens is not None else None
        if suffix is not None and suffix not in (".bin", ".npy", ".idx"):
            where.fail("tokens", self.tokens, "has none of the suffixes .bin, .npy, .idx",
                       "give FILE.bin (with dtype), FILE.npy, or the PREFIX.idx of a Megatron "
                       "indexed dataset")
        if suffix is not None and self.corpus != "stdlib":
            where.fail("tokens", self.tokens, f"is given beside corpus {self.corpus!r}",
                       "keep one: tokens (pre-tokenized) or corpus (text)")
        if suffix == ".bin" and self.dtype is None:
            where.fail("dtype", None, "is required for a flat .bin in tokens (no header says "
                       "its type)", "write dtype: uint16 (as nanoGPT writes) or uint32")
        if suffix != ".bin" and self.dtype is not None:
            where.fail("dtype", self.dtype, "applies to a flat .bin in tokens only",
                       "remove it (.npy and Megatron files state their own type)")


@dataclass
class TrainConfig:
    steps: int = 20
    """Optimizer steps to run (the job's end; a resumed job continues to this same number)."""
    microbatch_size: int = 2
    """Samples per microbatch (the unit the pipelines schedule and the profile was measured at)."""
    global_microbatches: int = 16
    """Global batch in microbatches; fixed for the whole job, re-split across pipelines on failure."""
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 5
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    """Clip by the global gradient norm over all layers (0 disables)."""
    log_every: int = 5
    """Outside a TTY: one log line every this many steps."""
    save_final_params: bool = False
    """After the last step the lowest holder of each layer writes that layer's parameters to
    RUN_DIR/final/layer-<i>.pt (a dict name -> tensor), to compare a run with a reference."""
    recompute: bool = False
    """Activation recomputation: each layer keeps only its input for the backward pass and runs
    its forward again there (torch.utils.checkpoint): less activation memory, about one more
    forward per step. The planner accounts for both (planning/cost.py, `with_recompute`)."""

    def check(self, where: _Where) -> None:
        for key in ("steps", "microbatch_size", "global_microbatches"):
            if getattr(self, key) < 1:
                where.fail(key, getattr(self, key), "must be at least 1", "use a positive integer")
        if self.lr <= 0:
            where.fail("lr", self.lr, "must be positive", "use e.g. 3e-4")
        if not 0 <= self.min_lr <= self.lr:
            where.fail("min_lr", self.min_lr, f"must lie in [0, lr={self.lr}]", "lower it")
        if self.warmup_steps < 0:
            where.fail("warmup_steps", self.warmup_steps, "must be >= 0", "use 0 for no warm-up")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            where.fail("betas", list(self.betas), "must be two numbers in [0, 1)", "use [0.9, 0.95]")
        if self.grad_clip < 0:
            where.fail("grad_clip", self.grad_clip, "must be >= 0", "use 0 to disable clipping")
        if self.log_every < 1:
            where.fail("log_every", self.log_every, "must be at least 1", "use e.g. 5")


@dataclass
class ClusterConfig:
    launch: Literal["local", "slurm"] = "local"
    """'local': node agents are processes on this machine (the embedded default);
    'slurm': one agent per allocated node, started by srun (see `oobleck-hpc submit`)."""
    nodes: int = 4
    """Nodes to start with (under Slurm: nodes to allocate)."""
    gpus_per_node: int = 2
    """Worker processes per node: one per GPU (on CPU: one per pretend GPU)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """'auto' picks cuda when GPUs are visible, else cpu."""
    spares: int = 0
    """Extra nodes that start idle (workers ready, no layers) and are swapped in by the round
    of a loss, so the job goes on at full size (control/membership.py, step 7). Under Slurm
    the job allocates nodes + spares; the last ones of the allocation are the spares."""
    kill_grace_s: float = 20.0
    """Local launcher: how long the nodes still running get to exit once the run finished (its
    last step committed) or after a forwarded stop signal; a node that leaves early never."""

    def check(self, where: _Where) -> None:
        if self.nodes < 1:
            where.fail("nodes", self.nodes, "must be at least 1", "use a positive integer")
        if self.spares < 0:
            where.fail("spares", self.spares, "must be >= 0", "use the number of idle spare nodes")
        if self.gpus_per_node < 1:
            where.fail("gpus_per_node", self.gpus_per_node, "must be at least 1",
                       "use the number of GPUs of one node (CPU runs: worker processes per node)")
        if self.kill_grace_s <= 0:
            where.fail("kill_grace_s", self.kill_grace_s, "must be > 0",
                       "use the seconds the last nodes get to exit (default 20)")


@dataclass
class FaultToleranceConfig:
    f: int = 1
    """Simultaneous node losses survived in place (at least f+1 pipelines are kept)."""
    collective_timeout_s: float = 5.0
    """torch.distributed timeout: bounds how long a hung peer can stall a collective."""
    heartbeat_s: float = HEARTBEAT_S
    """Interval of the agents' heartbeats on the control plane."""
    lease_s: float = LEASE_S
    """A node whose heartbeat is older than this is declared lost (catches hangs, partitions)."""
    replace: bool = False
    """Under Slurm: after a loss the job submits a replacement job (its partition, account, QOS
    and constraints, the time it has left) whose agents join the running job; replacements end
    with the job (launch/slurm.py). Locally, `oobleck-hpc grow` adds nodes by hand."""
    straggler: Literal["auto", "none", "rebalance", "exclude"] = "auto"
    """A node persistently slower than the others (recovery/straggler.py): auto takes what the
    planner predicts fastest (keep, re-split the batch, exclude the node); rebalance or
    exclude force that action; none turns detection off."""
    straggler_ratio: float = 1.5
    """A node is a straggler when its computations take at least this many times the median
    node's (relative to what the profile predicts for each) ..."""
    straggler_steps: int = 5
    """... in the median over its last this many committed steps (recovered: <= 1.2) ..."""
    straggler_window_s: float = 10.0
    """... and over at least this many seconds of steps: a slowdown is persistent only if it
    lasts both (short steps on a shared machine vary by far more than long ones)."""
    drain_poll_s: float = 30.0
    """Under Slurm: how often each node's agent asks slurmctld whether an administrator set its
    node to DRAIN (`scontrol update nodename=... state=drain`); the node then leaves the job at
    a step boundary, nothing replayed (control/drain.py). 0: never ask."""

    def check(self, where: _Where) -> None:
        if self.straggler_ratio <= 1:
            where.fail("straggler_ratio", self.straggler_ratio, "must exceed 1",
                       "use e.g. 1.5: a node 50 % slower than the median node")
        if self.straggler_window_s < 0:
            where.fail("straggler_window_s", self.straggler_window_s, "must be >= 0",
                       "use e.g. 10: a slowdown must last that long to count")
        if self.straggler_steps < 1:
            where.fail("straggler_steps", self.straggler_steps, "must be >= 1",
                       "use a few steps, e.g. 5, so that one noisy step decides nothing")
        if self.drain_poll_s < 0:
            where.fail("drain_poll_s", self.drain_poll_s, "must be >= 0",
                       "use a few tens of seconds, or 0 not to watch the node's Slurm state")
        if self.f < 0:
            where.fail("f", self.f, "must be >= 0", "use 0 to disable in-place recovery")
        for key in ("collective_timeout_s", "heartbeat_s", "lease_s"):
            if getattr(self, key) <= 0:
                where.fail(key, getattr(self, key), "must be positive", "use a few seconds")
        if self.lease_s <= self.heartbeat_s:
            where.fail("lease_s", self.lease_s, f"must exceed heartbeat_s={self.heartbeat_s}",
                       "use a lease of several heartbeats, e.g. 6x")


@dataclass
class ProfileConfig:
    library: str = "profiles"
    """Directory of the HDF5 profile library (profiles/<model>/<device>/<dtype>-mb<k>.h5)."""
    path: str | None = None
    """An explicit profile file; overrides the library lookup."""
    device: str | None = None
    """Device name in the library (e.g. 'cpu', 'A100-80G'); defaults to the job's device."""
    analytic: bool = False
    """Use an analytic profile (FLOP and byte counts) when no measured one is in the library."""


@dataclass
class CheckpointConfig:
    dir: str | None = None
    """Shared directory for checkpoints; none: no checkpoints (fallback impossible)."""
    every_steps: int = 0
    """Save every this many steps (0: not by steps)."""
    every_minutes: float = 0.0
    """Save every this many minutes of wall time (0: not by time)."""
    keep: int = 3
    """Checkpoints kept; older ones are deleted after a newer one is published."""

    def check(self, where: _Where) -> None:
        if self.every_steps < 0 or self.every_minutes < 0:
            where.fail("every_steps", self.every_steps, "intervals must be >= 0", "use 0 to disable")
        if self.keep < 1:
            where.fail("keep", self.keep, "must be at least 1", "keep at least the latest")


@dataclass
class SlurmConfig:
    partition: str | None = None
    account: str | None = None
    time_min: int = 60
    """Wall-time limit in minutes (sbatch --time)."""
    gpus_per_node: int | None = None
    """GPUs to request per node (--gpus-per-node); none on CPU clusters."""
    signal_delay_s: int = 90
    """The pre-timeout signal arrives this long before the time limit (checkpoint + requeue)."""
    signal: str = "USR2"
    """The pre-timeout signal sent to every agent (sbatch --signal=SIGNAL@signal_delay_s)."""
    mpi: str = "pmix"
    """srun --mpi plugin of the discovery step: 'pmix' for Open MPI (the default wheel),
    'pmi2' for MPICH builds; must be listed by `srun --mpi=list` on the cluster."""
    agent_command: str | None = None
    """The per-node command; placeholders {python} {job} {run_dir} {roster}. Default:
    '{python} -m oobleck_hpc.control.agent --job {job} --run-dir {run_dir}'."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run in the batch script before anything else (module load, conda activate)."""
    extra: dict[str, str] = field(default_factory=dict)
    """Further sbatch flags, e.g. {qos: high, constraint: a100}."""

    def check(self, where: _Where) -> None:
        if self.time_min < 1:
            where.fail("time_min", self.time_min, "must be at least 1", "give the limit in minutes")
        if self.signal_delay_s < 0 or self.signal_delay_s >= 60 * self.time_min:
            where.fail("signal_delay_s", self.signal_delay_s,
                       f"must lie in [0, time_min*60={60 * self.time_min})",
                       "leave enough time for a checkpoint, e.g. 90")
        name = self.signal.upper().removeprefix("SIG")
        if name not in _SIGNALS:
            where.fail("signal", self.signal, "is not a signal name", "use e.g. USR2 or TERM")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            where.fail("gpus_per_node", self.gpus_per_node, "must be >= 0", "use the GPUs of one node")
        if self.agent_command is not None:
            try:
                self.agent_command.format(python="python", job="j.yaml", run_dir="runs/x",
                                          roster="runs/x/roster.json")
            except (KeyError, IndexError, ValueError) as e:
                where.fail("agent_command", self.agent_command, f"has a bad placeholder ({e})",
                           "use only {python}, {job}, {run_dir} and {roster}")
        for key in self.extra:
            if key.replace("_", "-") in _MANAGED_SBATCH_FLAGS:
                where.fail(f"extra.{key}", self.extra[key], "is set by oobleck_hpc itself",
                           f"remove it (managed flags: {', '.join(sorted(_MANAGED_SBATCH_FLAGS))})")


_SIGNALS = {"HUP", "INT", "QUIT", "USR1", "USR2", "TERM", "CONT", "URG", "WINCH", "ALRM"}
_MANAGED_SBATCH_FLAGS = {"nodes", "no-kill", "requeue", "signal", "time", "job-name", "output",
                         "error", "ntasks-per-node"}


@dataclass
class FaultConfig:
    node: int
    """Index of the node (0-based, in the job's initial node order) that fails."""
    step: int
    """The training step during which the fault fires, numbered from 1 as on the console and
    in the metrics file (1 = the first step); for rendezvous and restore, the first step the run
    is about to train; for checkpoint, the step after which the save runs."""
    phase: Literal["forward", "backward", "gradient_sync", "reduce", "prepared", "vote",
                   "optimizer", "commit", "checkpoint", "reconfiguration", "transfer",
                   "rendezvous", "restore"] = "forward"
    """Where in the step (or around it) the fault fires; control/faults.py lists every window:
    forward, backward, gradient_sync (the per-layer gradient all-reduces); reduce (inside the
    step's final statistics all-reduce, after this rank posted it); prepared (after that
    all-reduce, before the commit vote); vote (this rank's vote sent, the outcome not known);
    optimizer (the vote passed, before the update); commit (this rank applied the update, its
    peers may not have yet); checkpoint (inside a periodic save); reconfiguration (survivors
    agreed, before the groups are rebuilt); transfer (during the layer-state transfer);
    rendezvous (the generation-0 rendezvous, `step` = the step the run starts at); restore
    (loading the checkpoint, same `step`)."""
    kind: Literal["kill", "hang", "exit", "crash", "drain", "slow", "grow"] = "kill"
    """kill: SIGKILL of the node (agent + workers); hang: SIGSTOP of the node; exit: the node
    leaves cleanly; crash: one worker process of a live node dies; drain: the node is asked to
    drain (as by `oobleck-hpc drain`: it leaves at the next step boundary, nothing replayed);
    slow: the node's workers run `factor` times slower from then on (its agent stops and
    continues them on a duty cycle); grow: the node asks the local launcher for one more node
    (as `oobleck-hpc grow RUN_DIR --nodes 1` does), which joins after a loss or waits as a
    spare -- `node` only says whose worker asks."""
    factor: float = 2.0
    """slow: how many times slower (> 1)."""

    def check(self, where: _Where) -> None:
        if self.factor <= 1:
            where.fail("factor", self.factor, "must exceed 1", "use e.g. 2.0: twice as slow")


@dataclass
class JobConfig:
    name: str = "job"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    faults: list[FaultConfig] = field(default_factory=list)
    """Injected failures, for tests and demos."""
    run_dir: str | None = None
    """Where events, metrics and logs go; default runs/<name>."""
    group_access: bool = False
    """The run's files (RUN_DIR, checkpoints, logs) are the user's alone (0700 / 0600); true (a
    team's run): its group may read them too (0750 / 0640), not RUN_DIR/secret (records/runs.py)."""
    source: str = field(default="<python>", compare=False, repr=False)
    """The file this job was read from (for error messages); not a YAML key."""

    def check(self, where: _Where) -> None:
        if self.fault_tolerance.replace and self.cluster.launch != "slurm":
            where.fail("fault_tolerance.replace", True, "needs cluster.launch: slurm (it submits "
                       "replacement jobs)", "set it to false; grow a local job by hand with "
                       "`oobleck-hpc grow RUN_DIR --nodes K`")
        for i, fault in enumerate(self.faults):
            if fault.kind == "grow" and self.cluster.launch != "local":
                where.fail(f"faults[{i}].kind", "grow", "needs cluster.launch: local (the local "
                           "launcher starts the node)", "under Slurm grow with "
                           "fault_tolerance.replace or `oobleck-hpc grow JOB_ID --nodes K`")
            if not 0 <= fault.node < self.cluster.nodes:
                where.fail(f"faults[{i}].node", fault.node,
                           f"is not a node of this job (cluster.nodes={self.cluster.nodes})",
                           f"use an index in 0..{self.cluster.nodes - 1}")
            if not 1 <= fault.step <= self.train.steps:
                where.fail(f"faults[{i}].step", fault.step,
                           f"is not a step of this job (train.steps={self.train.steps}; steps "
                           "are numbered from 1)", f"use a step in 1..{self.train.steps}")

    def validate(self) -> JobConfig:
        _walk(self, _Where(self.source, ""))
        return self

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir or f"runs/{self.name}")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("source")
        return out


# ----------------------------------------------------------------------------- loading


def load_job(path: str | Path, overrides: dict[str, Any] | None = None) -> JobConfig:
    """Read and validate a YAML job file. `overrides` maps dotted keys to values
    (e.g. {"cluster.nodes": 8}) and is applied before validation."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(str(path), "<file>", f"cannot be read ({e.strerror})",
                          "pass the path of an existing YAML job file") from e
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        raise YamlSyntaxError.of(str(path), e) from e
    except yaml.YAMLError as e:
        raise ConfigError(str(path), "<file>", f"is not valid YAML ({e})",
                          "correct the YAML (spaces for indentation, 'key: value' with a space "
                          "after the colon, brackets and quotes closed)") from e
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(str(path), "<top>", f"is a {type(data).__name__}, not a mapping",
                          "write the job as 'key: value' lines")
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return job_from_dict(data, source=str(path))


def job_from_dict(data: dict[str, Any], source: str = "<dict>") -> JobConfig:
    job = _build(JobConfig, data, _Where(source, ""))
    job.source = source
    return job.validate()
