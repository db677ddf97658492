"""The errors plugin end to end: ``elastic run`` with real workers failing in every way
(decorated by us or torch, undecorated, killed by signals, broken at start-up, on two
nodes), and a throwaway third-party plugin receiving the hooks."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from elastic.harness.commands import cli_env, run_elastic
from elastic.harness.distributions import make_distribution

e2e = pytest.mark.slow  # multi-process end-to-end tests

WORKER = """\
import os, signal, sys, time
{imports}

{decorator}
def main():
    if os.environ["RANK"] == "1":
        {failure}
    time.sleep(60)  # rank 0 waits to be stopped by the agent: not a failure

if __name__ == "__main__":
    main()
"""
RAISE = "raise ValueError('rank one is broken')"


def worker(
    tmp_path: Path,
    failure: str = RAISE,
    imports: str = "import elastic",
    decorator: str = "@elastic.record",
) -> Path:
    script = tmp_path / "train.py"
    script.write_text(WORKER.format(imports=imports, decorator=decorator, failure=failure))
    return script


def launch(
    tmp_path: Path, script: Path | str, *flags: str, env: dict[str, str] | None = None
) -> tuple[int, str, dict]:
    summary = tmp_path / "summary.json"
    proc = run_elastic(
        "run",
        "--standalone",
        "--nproc-per-node=2",
        "--monitor-interval=0.05",
        f"--error-summary={summary}",
        *flags,
        str(script),
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode != 0, proc.stderr
    assert summary.exists(), proc.stderr
    return proc.returncode, proc.stderr, json.loads(summary.read_text())


def assert_rank1_root_only(data: dict) -> dict:
    root = data["root_cause"]
    assert root["rank"] == 1 and root["local_rank"] == 1
    assert data["others"] == []  # rank 0 was stopped by the agent, not a failure
    return root


@e2e
@pytest.mark.parametrize(
    ("imports", "decorator"),
    [
        ("import elastic", "@elastic.record"),
        ("from torch.distributed.elastic.multiprocessing.errors import record", "@record"),
    ],
    ids=["elastic-record", "torch-record"],
)
def test_e2e_decorated_raise(tmp_path: Path, imports: str, decorator: str) -> None:
    code, err, data = launch(tmp_path, worker(tmp_path, imports=imports, decorator=decorator))
    assert code == 1 and data["exit_code"] == 1
    root = assert_rank1_root_only(data)
    assert root["message"] == "ValueError: rank one is broken"
    assert "in main" in root["traceback"] and "Traceback" in root["traceback"]
    assert "Root cause" in err and "ValueError: rank one is broken" in err
    assert "raise ValueError('rank one is broken')" in err
    assert abs(root["timestamp"] - time.time()) < 60


@e2e
def test_e2e_undecorated_stderr_tail(tmp_path: Path) -> None:
    script = worker(tmp_path, imports="", decorator="")
    logs = tmp_path / "logs"
    code, err, data = launch(tmp_path, script, f"--log-dir={logs}", "-r", "3")
    root = assert_rank1_root_only(data)
    assert "ValueError: rank one is broken" in root["traceback"]  # from the stderr tail
    assert "ValueError: rank one is broken" in err
    assert root["exit_code"] == 1 and code == 1


@e2e
@pytest.mark.parametrize(("sig", "code"), [("SIGSEGV", 139), ("SIGKILL", 137)])
def test_e2e_killed_by_signal(tmp_path: Path, sig: str, code: int) -> None:
    script = worker(tmp_path, failure=f"os.kill(os.getpid(), signal.{sig})")
    rc, err, data = launch(tmp_path, script, "--log-dir", str(tmp_path / "logs"), "-r", "3")
    root = assert_rank1_root_only(data)
    assert root["signal_name"] == sig and data["exit_code"] == code
    assert f"{sig} (signal" in err
    if sig == "SIGKILL":
        assert "possible OOM kill" in err
    else:  # @elastic.record enabled faulthandler: the crash's Python stack is in stderr
        assert "Segmentation fault" in root["traceback"] and "in main" in root["traceback"]
    assert rc != 0


@e2e
def test_e2e_restarts_then_reports_last_round(tmp_path: Path) -> None:
    """Every attempt fails: the summary is about the last round, not the first failure
    of a round that was already restarted past."""
    env, out = make_plugin(tmp_path)
    _, err, data = launch(tmp_path, worker(tmp_path), "--max-restarts=1", env=env)
    root = assert_rank1_root_only(data)
    assert root["attempt"] == 1
    names = [c["hook"] for c in hook_calls(out)]
    assert names.count("elastic_restart") == 1 and names.count("elastic_worker_failed") == 2
    assert err.count("Root cause") == 1


PLUGIN = """\
import json, os
from elastic.core.plugin.hookspecs import hookimpl

def _write(hook, payload):
    with open(os.environ["MYPLUG_OUT"], "a") as f:
        f.write(json.dumps({"hook": hook, "payload": payload}) + "\\n")

@hookimpl
def elastic_agent_start(spec, config):
    _write("elastic_agent_start", {"role": spec.role, "options": {
        k: v for k, v in config.plugin_options.items() if isinstance(v, (str, int, type(None)))}})

@hookimpl
def elastic_worker_failed(record):
    _write("elastic_worker_failed", json.loads(record.to_json()))

@hookimpl
def elastic_restart(group, reason):
    _write("elastic_restart", reason)

@hookimpl
def elastic_run_failed(summary):
    _write("elastic_run_failed", summary.to_dict())
"""


def make_plugin(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A throwaway installed distribution with an ``elastic.plugins`` entry point, as pip
    would leave it, and the environment that puts it on the subprocess's path."""
    site = make_distribution(
        tmp_path / "site",
        "myplug",
        "[elastic.plugins]\nmyplug = myplug_mod\n",
        {"myplug_mod": PLUGIN},
    )
    out = tmp_path / "hooks.jsonl"
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "MYPLUG_OUT": str(out)}, out


def hook_calls(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


@e2e
def test_e2e_third_party_plugin_receives_hooks(tmp_path: Path) -> None:
    env, out = make_plugin(tmp_path)
    _, _, data = launch(tmp_path, worker(tmp_path), env=env)
    calls = hook_calls(out)
    names = [c["hook"] for c in calls]
    assert names[0] == "elastic_agent_start" and names[-1] == "elastic_run_failed"
    assert calls[0]["payload"]["options"]["error_summary"] == str(tmp_path / "summary.json")
    failed = [c["payload"] for c in calls if c["hook"] == "elastic_worker_failed"]
    assert [f["rank"] for f in failed] == [1]  # the stopped rank 0 is not reported
    assert failed[0]["message"] == "ValueError: rank one is broken"
    summary = calls[-1]["payload"]
    assert summary["root_cause"]["rank"] == 1 and summary["exit_code"] == data["exit_code"]


@e2e
def test_e2e_missing_script_rejected_before_start(tmp_path: Path) -> None:
    """The CLI itself refuses a script that does not exist: one line, no agent started."""
    env, out = make_plugin(tmp_path)
    proc = run_elastic(
        "run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=3",
        str(tmp_path / "no_such_train.py"),
        env=env,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "no_such_train.py" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()  # not even elastic_agent_start: nothing was launched


@e2e
@pytest.mark.parametrize(
    ("target", "expected", "capture"),
    [
        ("syntax.py", "SyntaxError", False),  # stderr on the console: compiled by the agent
        ("syntax.py", "SyntaxError", True),
        ("-m no_such_module_zz", "No module named no_such_module_zz", True),
    ],
    ids=["syntax-console", "syntax-logged", "missing-module-logged"],
)
def test_e2e_startup_failure_spends_no_restarts(
    tmp_path: Path, target: str, expected: str, capture: bool
) -> None:
    env, out = make_plugin(tmp_path)
    (tmp_path / "syntax.py").write_text("def main(:\n    pass\n")
    flags = ["--max-restarts=3"]
    if capture:
        flags += ["--log-dir", str(tmp_path / "logs"), "-r", "3"]
    *flags_m, script = [*flags, *target.split()]
    start = time.monotonic()
    code, err, data = launch(tmp_path, script, *flags_m, env=env)
    assert time.monotonic() - start < 30
    root = data["root_cause"]
    assert expected in root["message"] and root["attempt"] == 0
    assert expected in err
    names = [c["hook"] for c in hook_calls(out)]
    assert "elastic_restart" not in names and names[-1] == "elastic_run_failed"


TWO_NODE_WORKER = """\
import os, pathlib, time
import elastic

@elastic.record
def main():
    sync = pathlib.Path(os.environ["SYNC_DIR"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    (sync / f"ready{rank}").touch()
    while len(list(sync.glob("ready*"))) < world:  # both nodes' workers are up
        time.sleep(0.01)
    if rank == 1:
        raise RuntimeError("rank 1 fails first")
    time.sleep(0.3)
    raise RuntimeError("rank 0 fails later")

main()
"""


@e2e
def test_e2e_two_nodes_agree_on_root_cause(tmp_path: Path, procs, port: int) -> None:  # noqa: ANN001
    """Two agents (c10d rendezvous) each see failures; both report the job-wide first one,
    rank 1 on the other node, not their own, as torchrun's per-node summary would."""
    script = tmp_path / "train.py"
    script.write_text(TWO_NODE_WORKER)
    (tmp_path / "sync").mkdir()
    env = cli_env({"SYNC_DIR": str(tmp_path / "sync"), "RES_OPTIONS": "timeout:1 attempts:1"})
    nodes = []
    for n in range(2):
        nodes.append(
            procs.elastic(
                "run",
                "--nnodes=2",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=two-node-errors",
                "--rdzv-conf=close_timeout=5",
                "--monitor-interval=0.05",
                f"--error-summary={tmp_path / f'summary{n}.json'}",
                str(script),
                env=env,
            )
        )
    outputs = [p.communicate(timeout=60) for p in nodes]
    summaries = []
    for n, p in enumerate(nodes):
        assert p.returncode == 1, outputs[n][1]
        summaries.append(json.loads((tmp_path / f"summary{n}.json").read_text()))
    roots = [s["root_cause"] for s in summaries]
    assert roots[0] == roots[1]
    assert roots[0]["rank"] == 1 and roots[0]["message"] == "RuntimeError: rank 1 fails first"
    for s, (_, err) in zip(summaries, outputs, strict=True):
        assert "rank 1 fails first" in err.split("Root cause")[1]
        # rank 0's later failure, when collected in time, is listed after the root cause
        assert all(o["timestamp"] >= s["root_cause"]["timestamp"] for o in s["others"])
    seen_later = [o for s in summaries for o in s["others"]]
    assert {o["rank"] for o in seen_later} <= {0}
    assert {r["node_id"] for r in roots} == {roots[0]["node_id"]}
