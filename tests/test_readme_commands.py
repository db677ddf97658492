"""The README's two commands are the ones users and CI run: ``.ci/run`` runs exactly the
second, and both make the virtual environment Debian's own Python needs (PEP 668)."""

from __future__ import annotations

import re

from elastic.harness.commands import REPO


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Two commands", 1)[1].split("\n##", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section, flags=re.S)


def test_the_ci_script_runs_exactly_the_readmes_test_command() -> None:
    example, suite = readme_commands()
    script = (REPO / ".ci" / "run").read_text().splitlines()
    assert suite in script, f".ci/run does not run the README's command:\n{suite}"
    assert "pytest" in suite and "pytest" not in example


def test_both_commands_install_into_a_venv_the_tools_leave_alone() -> None:
    for command in readme_commands():
        steps = [step.strip() for step in command.split("&&")]
        venv = steps.index("python3 -m venv .venv")
        activate = steps.index(". .venv/bin/activate")
        first_pip = next(i for i, step in enumerate(steps) if step.startswith("pip "))
        assert venv < activate < first_pip, steps
        assert "python3-venv" in steps[1], "Debian's python3 has no venv without python3-venv"
    assert ".venv/" in (REPO / ".gitignore").read_text().splitlines()
