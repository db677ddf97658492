"""elastic logs like a library: its lines go through the ``elastic`` logger, the command
installs the handler that shows them, a host program's own logging is left as it was,
and a bad ``LOGLEVEL`` is one line."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

import pytest
from elastic.harness.commands import REPO, cli_env, run_elastic

# A failing worker under a bare agent: the agent says "elastic: run failed: ..." (no
# errors plugin on a bare agent), through the ``elastic`` logger.
AGENT = """
import sys
from elastic import LocalElasticAgent, WorkerSpec

spec = WorkerSpec(role="t", local_world_size=1, entrypoint=sys.executable,
                  args=("-c", "raise SystemExit(3)"), monitor_interval=0.05)
result = LocalElasticAgent(spec).run()
print("EXIT", result.exit_code, flush=True)
"""


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
    )


def test_a_host_programs_logging_is_left_alone_and_sees_our_lines() -> None:
    code = (
        textwrap.dedent(
            """
        import logging, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format="HOST %(name)s %(levelname)s %(message)s")
        root = logging.getLogger()
        before = (list(root.handlers), root.level, [h.formatter for h in root.handlers])
        seen = []
        class Keep(logging.Handler):
            def emit(self, record):
                seen.append(record.getMessage())
        logging.getLogger("elastic").addHandler(Keep())
        """
        )
        + AGENT
        + textwrap.dedent(
            """
        after = (list(root.handlers), root.level, [h.formatter for h in root.handlers])
        assert after == before, (before, after)
        assert any(m.startswith("elastic: run failed") for m in seen), seen
        print("UNCHANGED", flush=True)
        """
        )
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "EXIT 3" in result.stdout and "UNCHANGED" in result.stdout
    # shown once, by the host's handler in its format; nothing of ours on stderr
    assert "HOST elastic ERROR elastic: run failed: " in result.stdout, result.stdout
    assert "run failed" not in result.stderr, result.stderr


def test_a_program_that_configures_nothing_still_sees_the_lines() -> None:
    result = run_python(AGENT)
    assert result.returncode == 0, result.stderr
    assert "EXIT 3" in result.stdout
    assert result.stderr.count("elastic: run failed: ") == 1, result.stderr


@pytest.mark.parametrize("value", ["verbose", "10"])
def test_a_bad_loglevel_is_one_line_and_exit_2(value: str) -> None:
    result = run_elastic("plugins", "list", env={"LOGLEVEL": value}, timeout=30)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"elastic: error: LOGLEVEL={value!r} is not a log level; "
        "expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL"
    ]


def test_loglevel_is_read_as_torchrun_reads_it() -> None:
    assert run_elastic("plugins", "list", env={"LOGLEVEL": "debug"}, timeout=30).returncode == 0


# Output that is not a log line: the ``console`` metrics sink writes the metric stream the
# user asked for to stderr, as the ``jsonl`` sink writes it to a file.
NOT_LOG_LINES = {"plugins/metrics/sinks.py"}


def test_no_print_to_stderr_and_no_basic_config_in_the_launcher() -> None:
    offenders = []
    for room in ("cli", "core", "plugins"):
        for path in sorted((REPO / room).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if not isinstance(node, ast.Call):
                    continue
                func = ast.unparse(node.func)
                to_stderr = any(
                    k.arg == "file" and ast.unparse(k.value) == "sys.stderr" for k in node.keywords
                )
                if (
                    func.endswith("basicConfig")
                    or func == "sys.stderr.write"
                    or (func in ("print", "click.echo") and to_stderr)
                    or (func == "click.echo" and any(k.arg == "err" for k in node.keywords))
                ) and rel not in NOT_LOG_LINES:
                    offenders.append(f"{rel}:{node.lineno} {func}")
    assert not offenders, offenders
