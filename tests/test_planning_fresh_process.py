"""The planner in a fresh interpreter: the same templates (no dependence on hash seeds, dict
order or state left by an earlier computation). Starts processes, so not in tests/unit/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_deterministic_across_processes():
    code = (f"import random, sys; sys.path.insert(0, {str(Path(__file__).parent / 'unit')!r});"
            "from test_planning_templates import random_profile;"
            "from oobleck_hpc.planning.templates import build_templates;"
            "from dataclasses import asdict; import json, hashlib;"
            "p = random_profile(random.Random(11), 9, 3, memory=10**9);"
            "t = build_templates(p, range(1, 5), 4);"
            "print(hashlib.sha256(json.dumps({k: asdict(v) for k, v in t.items()}, sort_keys=True).encode()).hexdigest())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, timeout=60).stdout for _ in range(2)}
    assert len(outs) == 1 and len(next(iter(outs)).strip()) == 64
