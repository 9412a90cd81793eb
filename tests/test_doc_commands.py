"""Every command README.md and docs/*.md show is run by a test as written (issue 34 item 7).

``tests/doc_commands.py`` extracts the commands and names each one; the first test checks
that the names and the docs agree both ways and that some test fetches every name
(``doc_command``), so a command that changes in the docs fails here until its test runs
the new text. The tests below run the text they fetch: in this process where they can
(the real Hydra app, Lightning, stabilize-report), with only the size shrunk (steps,
cells, arms) and said so beside it; the long ones are ``slow``; the ones that need what
this machine lacks (GPUs, nodes, the hub, SLURM, docker, a W&B account) are composed:
their overrides built into a ``RunConfig`` by Hydra, their flags checked against the
script's. The ``poisoned_item`` example is run by tests/test_fault_truth.py.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from doc_commands import COMMANDS, COMPOSED_ONLY, ROOT, doc_command, shown_commands
from test_fault_truth import expand, train

from conftest import compose_run, run_cli

TESTS = Path(__file__).resolve().parent
SHRINK = ["trainer.log_every_n_steps=1", "data.batch_size=4", "trainer.final_eval_batches=2"]


def test_every_command_the_docs_show_is_registered_and_fetched_by_a_test():
    shown = {c: f"{f}:{n}" for f, n, c in shown_commands()}
    registered = set(COMMANDS.values())
    new = [f"{where}: {c!r}" for c, where in shown.items() if c not in registered]
    why = "commands the docs show that no test runs (add them to doc_commands.py):\n"
    assert not new, why + "\n".join(new)
    gone = [k for k, c in COMMANDS.items() if c not in shown]
    assert not gone, f"registered commands the docs no longer show: {gone}"
    assert set(COMPOSED_ONLY) <= set(COMMANDS)
    # each name is fetched by a test: doc_command("name"), COMMANDS["name"] or a helper's
    # argument; any quoted use of the name in a test module counts (the names are unique)
    sources = "".join(p.read_text() for p in TESTS.glob("test_*.py"))
    used = set(re.findall(r"""["']([\w.-]+)["']""", sources))
    assert not set(COMMANDS) - used, f"no test fetches: {sorted(set(COMMANDS) - used)}"


def test_the_ci_runs_the_readme_test_command():
    """The README's command 2 is the suite's own launcher: ``.ci/run`` runs it verbatim."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == doc_command("tests")


def test_the_readme_one_run_then_its_report(tmp_path, monkeypatch, capsys):
    """README "One run", as written but 4 steps instead of 50; then ``stabilize-report
    runs/main/*`` (it read ``runs/default/*``, where no run goes), and the W&B sync lines'
    globs on the offline run it left."""
    from stabilize.report import main as report_main

    cmd = shlex.split(doc_command("one-run"))
    assert cmd[0] == "stabilize-train"
    code, out, err = train([*cmd[1:], "trainer.max_steps=4", *SHRINK], tmp_path, monkeypatch,
                           capsys)  # fmt: skip
    assert code == 0, err[-3000:]
    assert "done: 4 steps (4 asked" in out
    report = shlex.split(doc_command("report-main"))
    args = expand(report[1:], tmp_path)
    assert len(args) == 1 and args[0].startswith("runs/main/")  # the run it just made
    assert report_main(args) == 0
    assert (tmp_path / args[0] / "report" / "report.md").is_file()  # one run: beside it
    # the W&B sync lines name the offline run it left (wandb runs them: the slow test below)
    for name in ("wandb-sync-runs", "wandb-sync-dry"):
        assert len(list(tmp_path.glob(doc_command(name).split()[-1]))) == 1


def _overrides(argv: list[str]) -> list[str]:
    """The Hydra overrides of a launcher's argv: after its flags (and their values)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--":
            continue
        elif a.startswith("--"):
            skip = a not in ("--dry-run", "--wandb")
        elif "=" in a and not a.startswith("$"):
            out.append(a)
    return out


def _flags(script: str) -> set[str]:
    """The options a bash script's argument loop accepts (its ``case`` labels)."""
    return set(re.findall(r"^\s+(--[\w-]+)\)", (ROOT / script).read_text(), re.M))


@pytest.mark.parametrize("name", [
    "hub-8gpu",  # composed
    "launch-8gpu",  # composed
    "launch-2nodes",  # composed
    "launch-restarts",  # composed
    "nan12k-launch",  # composed
    "nan12k-repro",  # composed
    "nan12k-2nodes",  # composed
    "docker-run-8gpu",  # composed
])  # fmt: skip
def test_commands_for_gpus_nodes_or_the_hub_compose(name, tmp_path):
    """What needs 8 GPUs, two nodes or the hub is composed: the launcher's flags are its
    own and every override is a setting Hydra and ``RunConfig`` accept (``data.name=...``,
    the docs' placeholder, stands for a hub name)."""
    assert name in COMPOSED_ONLY
    argv = shlex.split(COMMANDS[name])
    if argv[0] == "docker":  # the image's command: after the image name
        argv = argv[argv.index("stabilize") + 1 :]
    script = argv[0]
    flags = {a for a in argv if a.startswith("--") and a != "--"}
    assert flags <= _flags(script), (flags - _flags(script), script)
    overrides = [o.replace("=...", "=Salesforce/wikitext") for o in _overrides(argv[1:])]
    try:
        compose_run(tmp_path / "run", overrides)
    except ValueError as e:  # a hub tokenizer's vocabulary needs its download: offline here
        assert "the hub is off" in str(e) and "data.tokenizer='openai-community/gpt2'" in str(e)


def test_the_commands_for_docker_w_and_b_and_the_api_are_what_the_tools_take():
    """docker, a W&B account and the W&B API are not here: the Dockerfile the build reads
    exists and runs the scenario by default (tests/test_dockerfile.py checks the rest),
    ``wandb login`` and ``stabilize-report --wandb ... --group`` are options they have."""
    for name in ("docker-build", "docker-run", "wandb-login", "report-wandb"):
        assert name in COMPOSED_ONLY
    build, run = shlex.split(COMMANDS["docker-build"]), shlex.split(COMMANDS["docker-run"])
    assert build[:2] == ["docker", "build"] and build[-1] == "." and "stabilize" in run
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "repro_nan.sh" in dockerfile.split("CMD")[-1]
    assert shlex.split(COMMANDS["wandb-login"]) == ["wandb", "login"]
    assert (Path(sys.executable).parent / "wandb").is_file()  # the CLI the package installs
    from stabilize.report.cli import _parse

    args = _parse(shlex.split(COMMANDS["report-wandb"])[1:])
    assert (args.wandb, args.group) == ("ENTITY/PROJECT", "nan_repro")


def _map(name: str, tmp_path, monkeypatch, capsys, *extra: str) -> str:
    """``stabilize-map`` as ``name`` shows it, ``extra`` flags before its ``--``."""
    from stabilize.map import main as map_main

    monkeypatch.chdir(tmp_path)
    argv = shlex.split(doc_command(name))
    assert argv[0] == "stabilize-map"
    at = argv.index("--") if "--" in argv else len(argv)
    capsys.readouterr()
    assert map_main([*argv[1:at], *extra, *argv[at:]]) == 0
    return capsys.readouterr().out


def test_the_map_commands_plan_as_written(tmp_path, monkeypatch, capsys):
    """The three map commands with ``--dry-run`` (the default map's real run, shrunk, is
    the slow test below); ``my_map.yaml`` is the user's: a copy of the default spec."""
    out = _map("map", tmp_path, monkeypatch, capsys, "--dry-run")
    assert "4 recipes x 6 LRs" in out and "72 cells" in out, out
    # its estimate agrees with what the default map took: docs/map.md's measured block (its
    # commit, command and machine beside it) and the README's figure, to the minute
    took = float(re.search(r"72 cells in ([\d.]+) min", (ROOT / "docs" / "map.md").read_text())[1])
    assert f"it took {took:g} minutes (`stabilize-map --dir" in (ROOT / "README.md").read_text()
    said = int(re.search(r"72 to run, .*: ~(\d+) min", out)[1])
    assert abs(said - took) <= 1, (said, took)
    shutil.copy(ROOT / "configs" / "map" / "default.yaml", tmp_path / "my_map.yaml")
    out = _map("map-mine", tmp_path, monkeypatch, capsys, "--dry-run")
    assert "runs/map-mine" in out and "model.n_layer=4" in out, out
    assert "map-slurm" in COMPOSED_ONLY  # SLURM is not here: its plan and commands are
    out = _map("map-slurm", tmp_path, monkeypatch, capsys, "--dry-run")
    assert "submitit_slurm" in out and "hydra.launcher.partition=gpu" in out, out
    assert not (tmp_path / "runs" / "map-default").exists()  # a dry run launches nothing


def test_the_sweep_script_lists_its_four_members(tmp_path):
    """guide.md's sweep.sh line with ``--dry-run`` (its real run, shrunk: slow, below)."""
    argv = shlex.split(doc_command("sweep-sh"))
    r = run_cli(["bash", str(ROOT / argv[0]), "--dry-run", *argv[1:]], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    members = r.stdout.strip().splitlines()
    assert len(members) == 4 and all("norm=" in m and "norm.eps=" in m for m in members)


def test_the_plan_command_prints_what_memory_md_shows(capsys):
    from stabilize.plan import main as plan_main

    argv = shlex.split(doc_command("plan-1.3b"))
    assert plan_main(argv[1:]) == 0
    out = [x.rstrip() for x in capsys.readouterr().out.splitlines()]
    doc = (ROOT / "docs" / "memory.md").read_text()
    shown = doc.split("$ stabilize-plan", 1)[1].split("```", 1)[0].splitlines()[2:]
    assert [x.rstrip() for x in shown if x.strip()] == [x for x in out if x.strip()]


# ---- the long ones, shrunk ------------------------------------------------------------------
SCENARIO_SHORT = ["--", "trainer.max_steps=12", "fault.step=3", "fault.target_step=8",
                  "data.batch_size=4", "trainer.final_eval_batches=2"]  # fmt: skip


def _bash(cmd: str, cwd, timeout=1800, **env):
    """A docs line through bash, in ``cwd`` (its globs and ``VAR=value`` prefixes as a
    shell reads them), with scripts/ reachable as in the repository root."""
    if not (Path(cwd) / "scripts").exists():
        (Path(cwd) / "scripts").symlink_to(ROOT / "scripts")
        (Path(cwd) / "configs").symlink_to(ROOT / "configs")
    return run_cli(["bash", "-c", cmd], cwd=cwd, env=env, timeout=timeout)


@pytest.mark.slow  # ~4 min: five scenario commands, each with 1-2 arms of 12 steps
def test_the_scenario_commands_shrunk(tmp_path):
    py = sys.executable
    short = " " + shlex.join(SCENARIO_SHORT)
    cmd = doc_command("repro").replace(".venv/bin/python", py)  # the venv this suite runs in
    r = _bash(cmd + " --arms reference,baseline --reference-seeds 1 --out runs/nan_repro-x"
              + short, tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "runs" / "nan_repro-x" / "report.md").is_file()
    r = _bash(doc_command("repro-some-arms") + " --reference-seeds 1" + short, tmp_path)
    assert r.returncode == 0 and (tmp_path / "runs" / "mine" / "report.md").is_file(), r.stderr
    r = _bash(doc_command("repro-seeds") + " --arms baseline --out runs/seeds" + short, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(list((tmp_path / "runs" / "seeds").glob("baseline-seed*"))) == 3
    natural = ["--", "trainer.max_steps=8", "data.batch_size=4", "trainer.final_eval_batches=2"]
    r = _bash(doc_command("repro-natural") + " --arms baseline --out runs/natural "
              + shlex.join(natural), tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    one = doc_command("one-arm") + " " + shlex.join(SCENARIO_SHORT[1:])
    r = _bash(one + " hydra.run.dir=runs/nan_repro-x/large_eps", tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _bash(
        doc_command("report-arms").replace(",fp32_reduction,bf16", "").replace(",remedy", "")
        + " --out report-arms",
        tmp_path,
    )  # the arms this test ran
    assert r.returncode == 0 and (tmp_path / "report-arms" / "report.md").is_file(), r.stderr
    sync = doc_command("wandb-sync-scenario").split(" ", 2)[2]
    assert list(tmp_path.glob(sync)), sync  # the offline runs the sync line names


@pytest.mark.slow  # ~3 min: a 4-member -m sweep, a 4-member 2-rank sweep.sh, a 2-rank run
def test_the_sweep_and_launch_commands_shrunk(tmp_path):
    fast = " trainer.max_steps=2 data.batch_size=4 trainer.final_eval_batches=2"
    r = _bash(doc_command("sweep-m") + fast, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _bash(doc_command("report-multirun"), tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    sync = doc_command("wandb-sync-multirun").split(" ", 2)[2]
    assert len(list(tmp_path.glob(sync))) == 4
    r = _bash(doc_command("sweep-sh") + fast, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _bash(doc_command("report-sweep"), tmp_path)
    assert r.returncode == 0 and (tmp_path / "runs" / "eps-sweep" / "report.md").is_file()
    r = _bash(doc_command("launch-cpu") + fast, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    # W&B's dry run of the sync line finds the offline runs and uploads nothing
    r = _bash(doc_command("wandb-sync-dry"), tmp_path)
    assert r.returncode == 0 and "offline-run-" in r.stdout + r.stderr, r.stderr[-2000:]


@pytest.mark.slow  # ~2 min: the default map's 4 recipes, 2 LRs, 1 seed, 3 steps
def test_the_default_map_shrunk(tmp_path):
    r = _bash(doc_command("map") + " --steps 3 --seeds 1 --lrs 1e-3:1e-2:2", tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "runs" / "map-default" / "map.md").is_file()


@pytest.mark.slow  # ~3.5 min (206 s measured, shared cores): the data benchmark, small corpora
def test_the_data_benchmark_shrunk(tmp_path):
    py = sys.executable
    for name in ("bench-data", "bench-data-reduced"):
        cmd = doc_command(name).replace("python ", f"{py} ", 1)
        cmd = re.sub(r" --mb \S+| --small-mb \S+| --bpe-mb \S+", "", cmd)
        r = _bash(cmd + " --mb 0.4 --small-mb 0.1 --bpe-mb 0.1 --steps 2", tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow  # ~1 min: the drift of guide.md on a 12-step clock (steps / 25)
def test_the_drift_command_on_a_shorter_clock(tmp_path, monkeypatch, capsys):
    cmd = shlex.split(doc_command("drift"))
    scaled = {"fault.step": 4, "fault.target_step": 6}
    args = [f"{k}={scaled[k]}" if (k := a.split("=")[0]) in scaled else a for a in cmd[1:]]
    code, out, err = train([*args, "trainer.max_steps=12", *SHRINK], tmp_path, monkeypatch,
                           capsys)  # fmt: skip
    assert code in (0, 3), err[-3000:]  # the drift is meant to fail the fp16 reduction
    assert "overflow" in out + err


@pytest.mark.slow  # ~4 min: a fresh venv from the local wheels, then a 2-arm 12-step job
def test_the_readme_main_job_from_a_fresh_clone(tmp_path):
    repo = tmp_path / "repo"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    for f in files:
        if (ROOT / f).is_file():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, repo / f)
    cmd = doc_command("main-job") + " --arms reference,baseline --reference-seeds 1 "
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    r = run_cli(["bash", "-c", cmd + shlex.join(SCENARIO_SHORT)], cwd=repo, env=env,
                timeout=1800)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert list(repo.glob("runs/nan_repro-*/report.md"))
