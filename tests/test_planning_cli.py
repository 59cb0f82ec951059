"""`oobleck-hpc plan`: tables, --json with the documented keys, on the 1,024-node example and
the local example; errors exit 2 with the file and the fix."""

from __future__ import annotations

import json
from pathlib import Path

from oobleck_hpc.cli import main

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_plan_json_on_the_1024_node_example(capsys):
    assert main(["plan", str(EXAMPLES / "gpt3-175b-1024nodes.yaml"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"templates", "plan", "survivability", "planning_seconds"} <= set(out)
    plan = out["plan"]
    assert plan["nodes"] == 1024 and plan["f"] == 3
    assert sum(p["template_nodes"] for p in plan["pipelines"]) == 1024
    assert sum(p["microbatches"] for p in plan["pipelines"]) == 1536
    assert len(plan["pipelines"]) >= 4
    sizes = [t["nodes"] for t in out["templates"]]
    assert sizes == list(range(plan["n0"], max(sizes) + 1))
    surv = out["survivability"]
    assert [r["lost"] for r in surv] == [0, 1, 2, 3]
    assert surv[0]["relative_throughput"] == 1.0
    assert all(0 < r["relative_throughput"] <= 1.0 + 1e-12 for r in surv)
    assert out["planning_seconds"] < 60


def test_plan_table_with_node_override(capsys, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text((EXAMPLES / "gpt3-175b-1024nodes.yaml").read_text().replace("f: 3", "f: 1"))
    assert main(["plan", str(job), "--nodes", "64"]) == 0
    text = capsys.readouterr().out
    assert "64 nodes x 8 GPUs" in text and "templates (" in text and "survivability" in text
    assert "samples/s" in text


def test_too_few_nodes_exits_2_with_the_numbers(capsys):
    code = main(["plan", str(EXAMPLES / "gpt3-175b-1024nodes.yaml"), "--nodes", "20"])
    assert code == 2
    err = capsys.readouterr().err
    assert "cannot hold f + 1 = 4 replicas" in err and "n0 =" in err


def test_bad_yaml_exits_2(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster:\n  nodez: 3\n")
    assert main(["plan", str(bad)]) == 2
    assert "cluster.nodez" in capsys.readouterr().err


def test_planning_imports_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys, oobleck_hpc.planning, oobleck_hpc.planning.cli, oobleck_hpc.planning.reconfigure,"
            " oobleck_hpc.profiling.analytic;"
            "heavy = [m for m in ('torch', 'h5py', 'mpi4py', 'submitit') if m in sys.modules];"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60).stdout.strip()
    assert out == "[]"


def test_a_hugging_face_config_is_planned_without_torch_or_transformers():
    """`oobleck-hpc plan` on Llama 2 70B (its config.json only) at 128 nodes x 8 GPUs: the
    templates, the plan and the survivability table for f = 2, in a process that never imports
    torch or transformers. (Its time is a benchmark, not checked here: `took` on the console.)"""
    import subprocess
    import sys

    code = ("import json, sys, contextlib, io; from oobleck_hpc.cli import main;\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            f"    code = main(['plan', {str(EXAMPLES / 'llama2-70b-1024gpu.yaml')!r}, '--json'])\n"
            "rep = json.loads(out.getvalue())\n"
            "print(json.dumps([code, rep['profile']['layers'], rep['plan']['nodes'],"
            " [r['lost'] for r in rep['survivability'] if 'error' not in r],"
            " [m for m in ('torch', 'transformers') if m in sys.modules]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120, cwd=EXAMPLES.parent).stdout
    assert json.loads(out) == [0, 82, 128, [0, 1, 2], []]


def test_survivability_covers_every_loss_pattern_of_the_issues_case(capsys):
    # 6 nodes, n0 = 3, f = 1: the 5 survivors of any single loss run one 5-node pipeline
    assert main(["plan", str(EXAMPLES / "gpt3-6.7b-paper.yaml"), "--nodes", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [t["nodes"] for t in out["templates"]] == [3, 4, 5, 6]
    surv = out["survivability"]
    assert [r["lost"] for r in surv] == [0, 1] and all("error" not in r for r in surv)
    assert surv[1]["pipelines"] == [5] and surv[1]["patterns"] == 1


def test_plan_shows_what_spares_buy(capsys, tmp_path):
    """With cluster.spares: 1 the single loss is replaced by the same recovery: the job is back
    on 6 nodes, at the throughput of the plan it started with (not the 5-node plan's)."""
    job = tmp_path / "job.yaml"
    text = (EXAMPLES / "gpt3-6.7b-paper.yaml").read_text()
    assert "  gpus_per_node:" in text
    job.write_text(text.replace("  gpus_per_node:", "  spares: 1\n  gpus_per_node:", 1))
    assert main(["plan", str(job), "--nodes", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["spares"] == 1
    shrunk, swapped = out["survivability"][1], out["survivability"][1]["with_spares"]
    assert swapped["spares_in"] == 1 and abs(swapped["relative_throughput"] - 1.0) < 1e-9
    assert shrunk["relative_throughput"] < 1.0
    assert main(["plan", str(job), "--nodes", "6"]) == 0
    assert "with 1 spare: up to 1 loss over the run is replaced" in capsys.readouterr().out


def test_wide_prints_every_layout_whole_and_the_phases_are_timed(capsys, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text((EXAMPLES / "gpt3-175b-1024nodes.yaml").read_text().replace("f: 3", "f: 1"))
    assert main(["plan", str(job), "--nodes", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    layouts = [t["layout"] for t in out["templates"]]
    long = [x for x in layouts if len(x) > 70]
    assert long, "the case needs a layout the table cuts"
    assert set(out["seconds"]) == {"profile", "planning", "survivability"}
    assert out["seconds"]["planning"] == out["planning_seconds"]
    assert main(["plan", str(job), "--nodes", "64"]) == 0
    cut = capsys.readouterr().out
    assert not any(x in cut for x in long) and "--wide prints them whole" in cut
    assert "relative: samples/s over the no-loss plan's" in cut
    assert "took " in cut and "survivability table" in cut
    assert main(["plan", str(job), "--nodes", "64", "--wide"]) == 0
    wide = capsys.readouterr().out
    assert all(x in wide for x in layouts) and "--wide prints them whole" not in wide


def test_a_factory_that_cannot_be_imported_is_the_error_plan_and_run_report(capsys, tmp_path,
                                                                             monkeypatch):
    """Not 'no profile': the factory's own import error, with the file, the key and the fix,
    exit 2, the same words `oobleck-hpc run` says before it starts anything. Three ways to
    fail: no such module, a module whose own import fails, no such function."""
    from oobleck_hpc.config import load_job
    from oobleck_hpc.errors import ConfigError
    from oobleck_hpc.launch.cli import check_local_inputs

    (tmp_path / "mymodels_broken.py").write_text("import a_dependency_not_installed_xyz\n")
    (tmp_path / "mymodels_ok.py").write_text("def build(cfg):\n    raise AssertionError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = {"absent_pkg_xyz.models:build": "ModuleNotFoundError: No module named 'absent_pkg_xyz'",
             "mymodels_broken:build":
                 "ModuleNotFoundError: No module named 'a_dependency_not_installed_xyz'",
             "mymodels_ok:make": "has no function 'make'"}
    for factory, why in cases.items():
        job = tmp_path / "job.yaml"
        job.write_text(f"model:\n  name: mine\n  factory: {factory}\ntrain:\n  microbatch_size: 1\n"
                       f"  global_microbatches: 8\ncluster:\n  nodes: 2\n  gpus_per_node: 1\n"
                       f"  device: cpu\n")
        assert main(["plan", str(job)]) == 2
        err = capsys.readouterr().err
        assert f"{job}: key 'model.factory'" in err and why in err and "Fix: " in err, err
        assert "no profile" not in err
        try:
            check_local_inputs(load_job(str(job)))
        except ConfigError as e:
            assert f"oobleck-hpc plan: error: {e}\n" == err
        else:
            raise AssertionError("run's check accepted an unimportable factory")
