"""The requeue exit path with real processes: a training job that exceeds its fault-tolerance
guarantee, or receives USR2 (Slurm's pre-timeout signal), checkpoints and exits with 75; started
again (as the local launcher does on 75) it resumes, and its losses equal an uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from oobleck_hpc.errors import EXIT_REQUEUE

ROOT = Path(__file__).resolve().parents[1]

JOB = textwrap.dedent("""
    import json, os, sys, time
    import torch
    from oobleck_hpc.checkpoint import (Checkpointer, StopSignals, TrainState, capture_rng,
        checkpoint_and_requeue, find_latest, layer_state, load_layers, restore_rng)
    from oobleck_hpc.errors import GuaranteeExceeded
    from oobleck_hpc.models.configs import GPT_CONFIGS
    from oobleck_hpc.models.gpt import GPT

    out, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    stop = StopSignals.install()
    torch.manual_seed(0)
    model = GPT(GPT_CONFIGS["gpt-tiny"], seed=1)
    layers = {i: model.build_layer(i) for i in range(model.num_layers)}
    opt = torch.optim.AdamW([p for m in layers.values() for p in m.parameters()], lr=3e-3)
    cp = Checkpointer(os.path.join(out, "ckpt"), rank=0, num_layers=model.num_layers, keep=2)
    start, first_run = 0, True
    latest = find_latest(cp.root).checkpoint
    if latest is not None:
        load_layers(latest, layers, opt)
        state = latest.train_state()
        restore_rng(state.rng)
        start, first_run = state.step, False

    def train_state(step):
        return TrainState(step=step, samples_seen=4 * step, rng=capture_rng())

    def shards():
        return {i: layer_state(m, opt) for i, m in layers.items()}

    for step in range(start, steps):
        try:
            if mode == "guarantee" and first_run and step == 3:
                raise GuaranteeExceeded("nodes n1 and n2 lost: layer 2 has no replica left")
            batch = torch.randint(0, 256, (4, 17))
            x = batch[:, :-1]
            for i in range(model.num_layers):
                x = layers[i](x)
            loss = model.loss(x, batch[:, 1:]).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        except GuaranteeExceeded as e:  # the failed step committed nothing: save `step` steps
            sys.exit(checkpoint_and_requeue(str(e), cp, step, shards(), train_state(step),
                                            requeue_rank=True, log=lambda m: None))
        with open(os.path.join(out, "losses.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "loss": loss.item(), "pid": os.getpid()}) + "\\n")
        if mode == "usr2" and first_run and step == 2:
            print("ready", flush=True)
            deadline = time.monotonic() + 30  # the test sends USR2 now; the handler only
            while not stop and time.monotonic() < deadline:  # sets the flag (sleep resumes)
                time.sleep(0.01)
        if stop:  # step boundary
            sys.exit(checkpoint_and_requeue(stop.reason, cp, step + 1, shards(),
                                            train_state(step + 1), requeue_rank=True,
                                            log=lambda m: None))
    cp.wait()
""")


def _run_until_done(tmp_path: Path, mode: str, steps: int = 7
                    ) -> tuple[list[int], dict[int, float], dict[int, int]]:
    """The local launcher's role: start the job again while it exits with 75."""
    out = tmp_path / mode
    out.mkdir()
    script = tmp_path / "job.py"
    script.write_text(JOB)
    codes = []
    for _ in range(3):
        p = subprocess.Popen([sys.executable, str(script), str(out), mode, str(steps)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "SLURM_JOB_ID": ""})
        try:
            if mode == "usr2" and not codes:
                assert p.stdout.readline().strip() == "ready"
                time.sleep(0.2)
                p.send_signal(signal.SIGUSR2)
            codes.append(p.wait(timeout=120))
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        if codes[-1] != EXIT_REQUEUE:
            break
    losses = {}
    pids = {}
    for line in (out / "losses.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert rec["step"] not in losses, f"step {rec['step']} ran twice: the resume is not exact"
        losses[rec["step"]] = rec["loss"]
        pids[rec["step"]] = rec["pid"]
    assert sorted(losses) == list(range(steps))
    return codes, losses, pids


@pytest.mark.timeout(240)
def test_guarantee_exceeded_and_usr2_checkpoint_requeue_and_resume_exactly(tmp_path):
    codes, ref, _ = _run_until_done(tmp_path, "none")
    assert codes == [0]
    for mode, resumed_at in (("guarantee", 3), ("usr2", 3)):
        codes, losses, pids = _run_until_done(tmp_path, mode)
        assert codes == [EXIT_REQUEUE, 0], (mode, codes)
        # Two processes: steps before the stop in the first, the rest after the resume.
        assert len({pids[s] for s in range(resumed_at)}) == 1
        assert len({pids[s] for s in range(resumed_at, 7)}) == 1 and pids[0] != pids[6]
        diff = max(abs(losses[s] - ref[s]) for s in ref)
        assert diff <= 1e-5, (mode, losses, ref)
