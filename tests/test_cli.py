"""The CLI as a user meets it: bad input, plugins list, import cost, PET_* settings."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from elastic.harness.commands import REPO, cli_env, run_elastic
from elastic.harness.distributions import make_distribution

BAD_INPUTS = [
    (["--nnodes=4:2"], "MIN (4) must not exceed MAX (2)"),
    (["--nnodes=0"], "at least 1"),
    (["--nnodes=a:b"], "expected N or MIN:MAX"),
    (["--nproc-per-node=-1"], "positive integer"),
    (["--nproc-per-node=abc"], "expected a positive integer, auto, cpu or gpu"),
    (["--rdzv-backend=c10d", "--rdzv-endpoint=host:notaport"], "'notaport' is not a port"),
    (["--rdzv-backend=nope"], "unknown rendezvous backend 'nope'; known backends: c10d, etcd"),
    (["--max-restarts=-1"], "expected 0 or more"),
    (["--rdzv-conf=foo"], "is not KEY=VALUE"),
    (["-r", "7"], "expected one of 0 (none)"),
    (["--local-ranks-filter=a"], "comma-separated list of local ranks"),
    (["--signals-to-handle=SIGFOO"], "SIGFOO"),
    (["--metrics-sink=console,statsd"], "unknown metrics sink 'statsd'; known sinks: console"),
    (["--checkpoint=s3:bucket"], "unknown checkpointer 's3'; known checkpointers: fs"),
]


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "hello.py"
    path.write_text("print('hello')\n")
    return path


@pytest.mark.parametrize(("flags", "expected"), BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_2(flags: list[str], expected: str, script: Path) -> None:
    result = run_elastic("run", *flags, str(script), timeout=30)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("elastic run: error:")
    assert expected in lines[0]
    assert "Traceback" not in result.stderr


def test_missing_script_is_one_line(tmp_path: Path) -> None:
    result = run_elastic("run", "--standalone", str(tmp_path / "nope.py"), timeout=30)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"elastic run: error: Invalid value for 'training_script': "
        f"'{tmp_path / 'nope.py'}' does not exist; give the path of a Python script"
    ]


def test_unknown_option_is_not_taken_for_the_script(script: Path) -> None:
    result = run_elastic("run", "--bogus", str(script), timeout=30)
    assert result.returncode == 2
    assert "no such option: --bogus" in result.stderr


def test_every_run_option_reaches_the_launch() -> None:
    """An option left out of run's table would be parsed and then silently dropped."""
    from dataclasses import fields

    from elastic.cli.run import run_command
    from elastic.cli.run_config import (
        COMMAND_OPTIONS,
        ENTRYPOINT_OPTIONS,
        OPTIONS,
        REJECTED_OPTIONS,
        RENDEZVOUS_OPTIONS,
    )
    from elastic.core.launch.config import LaunchConfig

    handled = {*OPTIONS, *RENDEZVOUS_OPTIONS, *ENTRYPOINT_OPTIONS, *REJECTED_OPTIONS}
    handled |= {*COMMAND_OPTIONS}
    assert {p.name for p in run_command.params} == handled
    targets = {name for to in OPTIONS.values() for name in to.fields}
    assert targets <= {f.name for f in fields(LaunchConfig)}


def test_version() -> None:
    result = run_elastic("--version", timeout=30)
    assert result.returncode == 0
    assert result.stdout.strip() == "elastic, version 0.1.0"


def test_pet_variable_is_read_and_a_flag_wins(script: Path) -> None:
    bad_from_env = run_elastic("run", str(script), env={"PET_NNODES": "3:1"}, timeout=30)
    assert bad_from_env.returncode == 2
    assert "'3:1'" in bad_from_env.stderr
    flag_wins = run_elastic("run", "--nnodes=4:2", str(script), env={"PET_NNODES": "3:1"})
    assert "'4:2'" in flag_wins.stderr


def modules_after(argv: list[str]) -> set[str]:
    """The modules a CLI invocation imported, read in a fresh interpreter."""
    code = textwrap.dedent(
        f"""
        import sys, json
        from elastic.cli.main import main
        try:
            main({argv!r})
        except SystemExit:
            pass
        sys.stderr.write("MODULES=" + json.dumps(sorted(sys.modules)) + "\\n")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=cli_env()
    )
    line = [ln for ln in result.stderr.splitlines() if ln.startswith("MODULES=")][-1]
    return set(json.loads(line.removeprefix("MODULES=")))


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["plugins", "list"]])
def test_cli_never_imports_torch(argv: list[str]) -> None:
    modules = modules_after(argv)
    assert "torch" not in modules
    if argv == ["--help"]:
        assert not any(m.startswith("elastic.plugins.") for m in modules)


def test_an_agent_does_not_load_what_only_workers_use(script: Path) -> None:
    """Every agent loads the hook plugins; the ``fs`` checkpointer (its hashing, its
    paths) is the workers' to load, and only theirs that use it. A standalone agent
    serves no store (its workers' rank 0 hosts theirs) and has nobody to compare a
    fingerprint with: no store client or server, no hashing."""
    modules = modules_after(["run", "--standalone", "--nproc-per-node=1", str(script)])
    assert "elastic.plugins.checkpoint_fs.hooks" in modules  # the plugin was loaded
    assert "elastic.plugins.checkpoint_fs.directory" not in modules
    assert "elastic.core.tcpstore.dial" in modules  # its free port, from the package
    assert "elastic.core.tcpstore.client" not in modules
    assert "elastic.core.tcpstore.server" not in modules
    assert "hashlib" not in modules


def test_plugins_list_shows_builtins_and_third_party(tmp_path: Path) -> None:
    site = make_distribution(
        tmp_path,
        "thirdparty",
        """
        [elastic.rendezvous]
        fake = fake_backend:create_handler
        [elastic.plugins]
        broken = broken_plugin
        """,
        {
            "fake_backend": "def create_handler(params):\n    raise NotImplementedError\n",
            "broken_plugin": "raise ImportError('needs libfoo')\n",
        },
    )
    result = run_elastic("plugins", "list", "--json", env={"PYTHONPATH": str(site)}, timeout=30)
    assert result.returncode == 0, result.stderr
    records = {(r["group"], r["name"]): r for r in json.loads(result.stdout)}
    assert records[("elastic.rendezvous", "fake")]["status"] == "ok"
    assert records[("elastic.rendezvous", "fake")]["distribution"] == "thirdparty"
    broken = records[("elastic.plugins", "broken")]
    assert broken["status"] == "error"
    assert broken["error"] == "ImportError: needs libfoo"
    for builtin in ("c10d", "etcd", "etcd-v2", "static"):
        assert records[("elastic.rendezvous", builtin)]["distribution"] == "elastic-launch"
    table = run_elastic("plugins", "list", env={"PYTHONPATH": str(site)}, timeout=30)
    assert "error: ImportError: needs libfoo" in table.stdout


def test_selecting_a_broken_backend_is_one_line(tmp_path: Path, script: Path) -> None:
    site = make_distribution(
        tmp_path / "site",
        "brokenrdzv",
        "[elastic.rendezvous]\nbad = bad_backend:create_handler\n",
        {"bad_backend": "import not_installed_module\n"},
    )
    result = run_elastic(
        "run",
        "--rdzv-backend=bad",
        "--rdzv-endpoint=127.0.0.1:1",
        str(script),
        env={"PYTHONPATH": str(site)},
        timeout=30,
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "rendezvous backend 'bad' from brokenrdzv==0.1 (bad_backend:create_handler)" in line
    assert "ModuleNotFoundError" in line


def test_backend_name_claimed_twice_names_both(tmp_path: Path, script: Path) -> None:
    one = make_distribution(
        tmp_path / "one",
        "one",
        "[elastic.rendezvous]\ndup = dup_one:create_handler\n",
        {"dup_one": "def create_handler(p): ...\n"},
    )
    two = make_distribution(
        tmp_path / "two",
        "two",
        "[elastic.rendezvous]\ndup = dup_two:create_handler\n",
        {"dup_two": "def create_handler(p): ...\n"},
    )
    result = run_elastic(
        "run",
        "--rdzv-backend=dup",
        "--rdzv-endpoint=127.0.0.1:1",
        str(script),
        env={"PYTHONPATH": f"{one}:{two}"},
        timeout=30,
    )
    assert result.returncode == 2
    assert (
        "one==0.1 (dup_one:create_handler) and two==0.1 (dup_two:create_handler)" in result.stderr
    )


def test_readme_test_command_is_what_ci_runs() -> None:
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    command = ci.strip().splitlines()[-1]
    assert command in readme


def test_every_torchrun_flag_is_a_core_flag_of_run() -> None:
    """torchrun 2.13's parser is the peer: each of its flags exists in ``elastic run``
    whatever plugins load (those we do not provide are refused with a reason)."""
    from elastic.cli.run import run_command
    from torch.distributed.run import get_args_parser

    ours = {name for p in run_command.params for name in (*p.opts, *p.secondary_opts)}
    theirs = {
        name
        for action in get_args_parser()._actions
        for name in action.option_strings
        if name not in ("-h", "--help")
    }
    assert theirs <= ours, sorted(theirs - ours)


def test_event_log_handler_exists_without_its_plugin(script: Path) -> None:
    env = {"ELASTIC_DISABLE_PLUGIN_AUTOLOAD": "1"}
    result = run_elastic("run", "--standalone", "--event-log-handler=console", str(script), env=env)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "elastic: --event-log-handler=console: the event_log plugin is disabled, "
        "so no events are written"
    ]
    quiet = run_elastic("run", "--standalone", "--event_log_handler", "null", str(script), env=env)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


def test_nproc_per_node_xpu_counts_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic.cli import options

    monkeypatch.setattr(options, "count_xpus", lambda: 3)
    assert options.parse_nproc_per_node("xpu") == 3
    monkeypatch.setattr(options, "count_xpus", lambda: pytest.fail("counted XPUs"))
    assert options.parse_nproc_per_node("auto") >= 1


def test_nproc_per_node_xpu_without_an_xpu_is_one_line(script: Path) -> None:
    result = run_elastic("run", "--nproc-per-node=xpu", str(script), timeout=120)
    if result.returncode == 0:
        pytest.skip("this machine has an XPU")
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "elastic run: error: Invalid value for '--nproc-per-node': "
        "'xpu' was asked for but this machine has no visible XPU"
    ]
