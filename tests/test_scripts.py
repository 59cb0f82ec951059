"""The set-up scripts as a user meets them: `source scripts/env.sh` in an interactive shell."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sourcing_env_sh_leaves_the_shell_options_alone():
    """README: `source scripts/env.sh` puts oobleck-hpc on PATH. A failing command afterwards
    must not close the user's interactive shell (no `set -e` leaking from the script), and the
    virtual environment comes first on PATH. (The environment exists when the tests run, so
    this only checks it.)"""
    out = subprocess.run(["bash", "-ic", f"source {ROOT}/scripts/env.sh; false; echo still-here; "
                          "echo \"opts=$-\"; command -v oobleck-hpc"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = out.stdout.splitlines()
    assert "still-here" in lines, out
    opts = next(x for x in lines if x.startswith("opts="))
    assert "e" not in opts.removeprefix("opts="), opts
    assert lines[-1] == str(ROOT / ".venv" / "bin" / "oobleck-hpc"), out


def test_env_sh_tells_each_phase_of_a_set_up_and_nothing_once_current(tmp_path):
    """Issue 27: on a fresh machine the demo printed nothing for 38 s while .venv was set up.
    env.sh says each phase on stderr, and nothing at all when the environment is current.
    Run on a copy of the project whose `python3 -m venv` makes a venv of stand-ins (its pip
    and python log their arguments and succeed), so nothing is installed."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "env.sh").write_text((ROOT / "scripts" / "env.sh").read_text())
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    log = tmp_path / "calls.log"
    fake_python = tmp_path / "fake-python3"
    fake_python.write_text(f"""#!/usr/bin/env bash
[ "$1 $2" = "-m venv" ] || exit 9
mkdir -p "$3/bin"
for tool in pip python; do
    printf '#!/usr/bin/env bash\\necho "%s $*" >>{log}\\n' "$tool" >"$3/bin/$tool"
    chmod +x "$3/bin/$tool"
done
""")
    fake_python.chmod(0o755)

    def source() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", "source scripts/env.sh && command -v python"],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path,
                              env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake_python)})

    first = source()
    assert first.returncode == 0, first
    assert first.stdout.strip() == str(tmp_path / ".venv" / "bin" / "python"), first
    phases = [line.split("]: ", 1)[1] for line in first.stderr.splitlines()]
    assert [p.split(" ")[0] for p in phases] == ["creating", "installing", "installing",
                                                 "checking", str(tmp_path / ".venv")], first.stderr
    assert phases[1] == "installing torch==2.13.0 (the largest step)"
    calls = log.read_text().splitlines()
    assert calls[1] == "pip install -q torch==2.13.0" and calls[-1].startswith("python -c import")

    again = source()
    assert again.returncode == 0 and again.stderr == "", again  # current: not a word
    assert log.read_text().splitlines() == calls                 # and nothing run again

    # a CUDA build of torch (slurm/README.md): the version and the index it comes from
    (tmp_path / "pyproject.toml").write_text("# changed\n" + (ROOT / "pyproject.toml").read_text())
    url = "https://download.pytorch.org/whl/cu128"
    cuda = subprocess.run(["bash", "-c", "source scripts/env.sh"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake_python),
                               "TORCH_VERSION": "2.13.0", "TORCH_INDEX_URL": url})
    assert cuda.returncode == 0 and "updating" in cuda.stderr, cuda
    assert f"installing torch==2.13.0 from {url}" in cuda.stderr, cuda.stderr
    assert f"pip install -q torch==2.13.0 --index-url {url}" in log.read_text().splitlines()
