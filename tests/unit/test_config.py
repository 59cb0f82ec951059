"""The job file: strict loading, and errors that name the file, the key, the value and the fix."""

from pathlib import Path

import pytest
import yaml

from oobleck_hpc.config import JobConfig, load_job
from oobleck_hpc.errors import ConfigError

EXAMPLES = sorted(Path(__file__).parents[2].joinpath("examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_bundled_examples_load(path):
    if "simulation" in yaml.safe_load(path.read_text()):  # a simulator scenario, not a job
        from oobleck_hpc.sim.scenario import load_scenario

        assert load_scenario(path).name
        return
    if path.name.startswith("fleet-"):  # a fleet of jobs (oobleck_hpc/fleet), each a job file
        from oobleck_hpc.fleet.config import load_fleet

        fleet, jobs = load_fleet(path)
        assert len(jobs) == len(fleet.jobs) >= 1
        return
    job = load_job(path)
    assert isinstance(job, JobConfig) and job.source == str(path)


@pytest.mark.parametrize("text, key, words", [
    ("cluster:\n  nodez: 3\n", "cluster.nodez", "valid keys here are: launch, nodes, gpus_per_node, device"),
    ("train:\n  lr: fast\n", "train.lr", "not a number"),
    ("cluster:\n  launch: k8s\n", "cluster.launch", "use one of: local, slurm"),
    ("cluster:\n  nodes: 0\n", "cluster.nodes", "at least 1"),
    ("train:\n  steps: 2.5\n", "train.steps", "not an integer"),
    ("faults:\n  - {node: 9, step: 1}\n", "faults[0].node", "use an index in 0..3"),
    ("faults:\n  - {step: 1}\n", "faults[0].node", "required but missing"),
    ("faults:\n  - {node: 1, step: 1, kind: explode}\n", "faults[0].kind", "kill, hang, exit"),
    ("fault_tolerance:\n  heartbeat_s: 2\n  lease_s: 1\n", "fault_tolerance.lease_s", "must exceed heartbeat_s"),
    ("model:\n  factory: mypkg.build\n", "model.factory", "package.module:function"),
    ("model:\n  name: gpt-nonexistent\n", "model.name", "use one of: gpt-tiny, gpt-mini"),
    ("model:\n  hf: no/such/dir\n", "model.hf", "no/such/dir/config.json cannot be read"),
    ("model:\n  hf: examples/models/llama3-8b\n  factory: a.b:c\n", "model.hf",
     "beside model.factory"),
    ("model:\n  hf: examples/models/llama3-8b\n", "model.name", "names a built-in GPT, but"),
    ("train: [1, 2]\n", "train", "not a mapping"),
    ("- just\n- a list\n", "<top>", "not a mapping"),
])
def test_bad_job_files_are_explained(tmp_path, text, key, words):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_job(path)
    message = str(info.value)
    assert message.startswith(f"{path}: key '{key}'"), message
    assert words in message and "Fix:" in message


@pytest.mark.parametrize("text, where, problem, fix", [
    # a key indented deeper than its siblings: the caret under the colon YAML stopped at
    ("name: x\ntrain:\n  steps: 5\n   lr: 1e-3\n", "4:6", "mapping values are not allowed here",
     "indent this line like the keys beside it"),
    ("name: x\n\tcluster: {}\n", "2:1", "found character '\\t' that cannot start any token",
     "indent with spaces"),
    ('name: "x\ntrain: {}\n', "3:1", "(while scanning a quoted scalar that begins at 1:7)",
     "close the quote opened at 1:7"),
    ("cluster: {nodes: [1, 2}\n", "1:23", "(while parsing a flow sequence that begins at 1:18)",
     "close the bracket opened at 1:18"),
])
def test_yaml_syntax_errors_name_the_file_line_and_column(tmp_path, text, where, problem, fix):
    """Issue 27: a syntax error was told as `key '<file>': is not valid YAML (... "<unicode
    string>", line 13 ...)`. It is FILE:LINE:COLUMN, the problem, the line and the fix."""
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_job(path)
    first, *rest = str(info.value).split("\n")
    assert first.startswith(f"{path}:{where}: not valid YAML: "), first
    assert problem in first and "<unicode string>" not in str(info.value)
    line, column = map(int, where.split(":"))
    source_line = (text.splitlines() + [""])[line - 1]
    assert rest[0].strip() == source_line.strip() and rest[1].index("^") == 4 + column - 1
    assert rest[2].startswith(f"Fix: {fix}"), rest
    assert info.value.exit_code == 2


def test_missing_file_is_explained(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        load_job(tmp_path / "nope.yaml")


def test_scientific_notation_and_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("train:\n  lr: 3e-4\n")  # YAML 1.1 reads this as a string
    job = load_job(path, overrides={"cluster.nodes": 7})
    assert job.train.lr == 3e-4 and job.cluster.nodes == 7


def test_defaults_are_valid():
    JobConfig().validate()


@pytest.mark.parametrize("config, words", [
    ({"model_type": "t5"}, "model_type 't5', which is not supported. Fix: use a model of one of "
                           "the supported types: llama, mistral, qwen2, gpt2, gpt_neox"),
    ({"model_type": "llama", "hidden_size": "big"}, "hidden_size = 'big', not a positive integer"),
    ({"model_type": "llama", "tie_word_embeddings": 1}, "tie_word_embeddings = 1, not true/false"),
    ({"model_type": "gpt2", "n_embd": 30, "n_head": 4}, "hidden size of 30, not divisible by "
                                                        "its 4 attention heads"),
    ({"model_type": "mistral"}, "sliding-window attention (sliding_window = 4096 < "
                                "max_position_embeddings = 131072)"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16},
     "sliding-window attention"),
    ([1, 2], "is not a JSON object"),
])
def test_a_hugging_face_config_is_checked_when_the_job_is_read(tmp_path, config, words):
    """model.hf: the config.json is read as plain JSON (no torch, no transformers) when the job
    is loaded; what the adapter cannot build is refused then, before anything starts."""
    import json

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    path = tmp_path / "job.yaml"
    path.write_text(f"model:\n  name: mine\n  hf: {tmp_path / 'm'}\n")
    with pytest.raises(ConfigError) as info:
        load_job(path)
    message = str(info.value)
    assert message.startswith(f"{path}: key 'model.hf'") and words in message, message
    assert "Fix:" in message


def test_transformers_older_than_5_is_refused_with_the_fix():
    from oobleck_hpc.models.hf_config import check_transformers_version

    check_transformers_version("5.24.0", "job.yaml")
    with pytest.raises(ConfigError, match="needs transformers 5 or later, not 4.45.2"):
        check_transformers_version("4.45.2", "job.yaml")
