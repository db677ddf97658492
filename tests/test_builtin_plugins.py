"""The watchdog's built-in plugins and the plugin-selection variables: the variables
choose among installed hook plugins; a built-in runs exactly when its own flag asks for
it, whatever they say (the reason: core/watchdog/builtin.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from elastic.harness.commands import run_elastic, write_script

SELECTIONS = [
    pytest.param(
        {"ELASTIC_DISABLE_PLUGIN_AUTOLOAD": "1", "ELASTIC_PLUGINS": ""}, id="autoload-off"
    ),
    pytest.param({"ELASTIC_PLUGINS": "errors"}, id="allowlist"),
]


def called(trace: str, hook: str) -> list[str]:
    """The plugins ``ELASTIC_TRACE_PLUGINS`` says ``hook`` was called on, first call."""
    match = re.search(rf"trace: {hook}\(.*\) -> (.+)$", trace, re.MULTILINE)
    assert match, trace[-3000:]
    names = match.group(1).strip()
    return [] if names == "no implementation" else [n.strip() for n in names.split(",")]


@pytest.mark.parametrize("selection", SELECTIONS)
def test_a_flag_runs_its_builtin_whatever_the_selection(
    tmp_path: Path, selection: dict[str, str]
) -> None:
    script = write_script(tmp_path, "worker.py", "print('done')\n")
    env = {**selection, "ELASTIC_TRACE_PLUGINS": "1"}

    asked = run_elastic("run", "--standalone", "--stall-timeout=30", script, env=env)
    assert asked.returncode == 0, asked.stderr[-3000:]
    assert called(asked.stderr, "elastic_workers_started") == ["watchdog", "stall"]
    # the installed ones the selection leaves out stay out: metrics, event_log, checkpoint
    installed = set(called(asked.stderr, "elastic_agent_start")) - {"watchdog", "stall"}
    assert installed <= {"errors"}, asked.stderr[-3000:]

    plain = run_elastic("run", "--standalone", script, env=env)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "watchdog" not in called(plain.stderr, "elastic_agent_start")
