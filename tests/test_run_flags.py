"""torchrun flags beyond the basics, run for real: --virtual-local-rank, duplicate filters,
and a launch configured only through PET_* variables (as Kubeflow's PyTorchJob does)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from elastic.harness.commands import run_elastic

# The harness runs Python unbuffered, where print() writes each of its arguments with a
# write call of its own; two workers sharing the console would then interleave inside a
# record. One write per record keeps each record whole (a pipe writes it atomically).
SHOW = """
import os, sys
env = os.environ
sys.stdout.write(f"LR {env['LOCAL_RANK']} CVD {env.get('CUDA_VISIBLE_DEVICES')} "
                 f"RANK {env['RANK']} WS {env['WORLD_SIZE']}\\n")
sys.stdout.write("loss=0.5 at step 1\\n")
sys.stdout.write("noise\\n")
"""


def write_script(tmp_path: Path) -> Path:
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    return script


def test_virtual_local_rank_gives_each_worker_one_gpu(tmp_path: Path) -> None:
    script = write_script(tmp_path)
    result = run_elastic(
        "run",
        "--standalone",
        "--nproc-per-node=2",
        "--virtual-local-rank",
        str(script),
        env={"CUDA_VISIBLE_DEVICES": "3,5"},
    )
    assert result.returncode == 0, result.stderr
    # Both workers write to the console unbuffered: match records, not lines.
    lines = sorted(re.findall(r"LR \d+ CVD \S+ RANK \d+ WS \d+", result.stdout))
    assert lines == ["LR 0 CVD 3 RANK 0 WS 2", "LR 0 CVD 5 RANK 1 WS 2"]


def test_duplicate_filters_copy_matching_teed_lines(tmp_path: Path) -> None:
    script = write_script(tmp_path)
    log_dir = tmp_path / "logs"
    result = run_elastic(
        "run",
        "--standalone",
        "--nproc-per-node=2",
        f"--log-dir={log_dir}",
        "-t",
        "3",
        "--duplicate-stdout-filters=loss,nothing",
        str(script),
    )
    assert result.returncode == 0, result.stderr
    (filtered,) = log_dir.glob("*/attempt_0/filtered_stdout.log")
    assert sorted(filtered.read_text().splitlines()) == [
        "[default0]:loss=0.5 at step 1",
        "[default1]:loss=0.5 at step 1",
    ]
    assert "[default1]:noise" in result.stdout


def test_launch_configured_only_through_pet_variables(tmp_path: Path) -> None:
    script = write_script(tmp_path)
    result = run_elastic(
        "run",
        str(script),
        env={"PET_STANDALONE": "1", "PET_NPROC_PER_NODE": "3", "PET_TEE": "1"},
    )
    assert result.returncode == 0, result.stderr
    ranks = sorted(ln for ln in result.stdout.splitlines() if "LR" in ln)
    assert len(ranks) == 3
    assert all(ln.startswith("[default") and "WS 3" in ln for ln in ranks)


def test_flag_overrides_its_pet_variable(tmp_path: Path) -> None:
    script = write_script(tmp_path)
    result = run_elastic(
        "run",
        "--nproc-per-node=1",
        str(script),
        env={"PET_STANDALONE": "1", "PET_NPROC_PER_NODE": "3"},
    )
    assert result.returncode == 0, result.stderr
    assert [ln for ln in result.stdout.splitlines() if ln.startswith("LR")] == [
        "LR 0 CVD None RANK 0 WS 1"
    ]


def test_event_log_handler_console_prints_agent_events(tmp_path: Path) -> None:
    script = write_script(tmp_path)
    quiet = run_elastic("run", "--standalone", "--nproc-per-node=2", str(script))
    assert "torchelastic." not in quiet.stderr
    result = run_elastic(
        "run", "--standalone", "--nproc-per-node=2", "--event-log-handler=console", str(script)
    )
    assert result.returncode == 0, result.stderr
    events = [json.loads(ln) for ln in result.stderr.splitlines() if ln.startswith('{"name"')]
    names = [e["name"] for e in events]
    assert names[0] == "torchelastic.agent.start"
    assert "torchelastic.rendezvous.complete" in names
    started = next(e for e in events if e["name"] == "torchelastic.workers.started")
    assert len(started["metadata"]["pids"]) == 2
    assert events[-1]["name"] == "torchelastic.run.end"
    assert events[-1]["metadata"]["state"] == "SUCCEEDED"
    assert all(e["source"] == "AGENT" and e["timestamp"] > 0 for e in events)
