"""The pytest plugin for plugin authors (entry point ``pytest11: elastic``), used the way
an author uses it: a test file in a fresh directory, run by pytest in a subprocess, with
the fixtures found through the installed entry point."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

AUTHOR_TESTS = """
import pytest
from elastic import hookimpl
from elastic.core.rendezvous.local import LocalRendezvousHandler
from elastic.core.rendezvous.registry import BACKENDS, register_rendezvous_handler
from elastic.testing.conformance import RendezvousTarget
from elastic.testing.ports import free_port


class Labeller:
    def __init__(self):
        self.label = None
        self.rounds = 0

    @hookimpl
    def elastic_addoption(self, parser):
        parser.addoption("--label", default="none", help="A label for the workers.")

    @hookimpl
    def elastic_agent_start(self, spec, config):
        self.label = config.option("label")

    @hookimpl
    def elastic_rendezvous_complete(self, info, duration):
        self.rounds += 1

    @hookimpl(tryfirst=True)
    def elastic_worker_env(self, config):
        return {"LABEL": self.label}


def test_hooks_recorded(elastic_agent_runner, tmp_path):
    script = tmp_path / "w.py"
    script.write_text("import os, sys\\nsys.exit(0 if os.environ['LABEL'] == 'x' else 5)\\n")
    run = elastic_agent_runner.run(
        str(script), nproc=2, plugins=[Labeller], options={"label": "x"}
    )
    assert run.exit_code == 0
    assert run.hook_names == [
        "elastic_addoption",
        "elastic_agent_start",
        "elastic_worker_env",
        "elastic_rendezvous_complete",
        "elastic_workers_started",
        "elastic_run_end",
    ]
    (env,) = run.calls_to("elastic_worker_env")
    assert env.plugins == ["Labeller"] and env.result == [{"LABEL": "x"}]
    assert run.host.get_plugin("Labeller").rounds == 1
    assert run.config.option("label") == "x"


def test_restart_recorded_with_an_installed_plugin(elastic_agent_runner, tmp_path):
    script = tmp_path / "flaky.py"
    script.write_text(
        "import os, sys\\n"
        "sys.exit(7 if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' else 0)\\n"
    )
    run = elastic_agent_runner.run(str(script), plugins=["errors", Labeller], max_restarts=1)
    assert run.exit_code == 0
    assert [c.kwargs["reason"] for c in run.calls_to("elastic_restart")] == ["failure"]
    (failed,) = run.calls_to("elastic_worker_failed")
    assert failed.kwargs["record"].exit_code == 7
    assert failed.plugins == ["errors"]
    (start,) = run.calls_to("elastic_agent_start")
    assert start.plugins == ["Labeller", "errors"]  # registered last, called first


def test_an_unknown_installed_plugin_is_an_error(elastic_agent_runner):
    with pytest.raises(LookupError, match="no-such-plugin"):
        elastic_agent_runner.run("x.py", plugins=["no-such-plugin"])


def always_alone(params):
    params.check_keys([])  # rejects unknown keys, as the suite requires ...
    return LocalRendezvousHandler(params.run_id)  # ... but never forms a group


def test_conformance_finds_a_broken_backend(elastic_conformance):
    register_rendezvous_handler("always-alone", always_alone)
    try:
        report = elastic_conformance(
            RendezvousTarget("always-alone", "unused"),
            cases=["test_fixed_size_round", "test_unknown_conf_key_rejected"],
        )
    finally:
        BACKENDS.unregister("always-alone")
    assert report.passed == ["test_unknown_conf_key_rejected"]
    assert list(report.failed) == ["test_fixed_size_round"]
    with pytest.raises(AssertionError, match="failed 1 conformance case"):
        report.assert_passed()


def test_conformance_of_c10d(elastic_conformance):
    quick = {"last_call_timeout": "1", "heartbeat_interval": "0.5", "heartbeat_timeout": "3"}
    target = RendezvousTarget("c10d", f"127.0.0.1:{free_port()}", quick)
    report = elastic_conformance(
        target, cases=["test_fixed_size_round", "test_closed_rendezvous", "test_store_semantics"]
    )
    report.assert_passed()
    assert len(report.passed) == 3
"""


def test_fixtures_from_the_installed_pytest_plugin(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_author=AUTHOR_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", timeout=300)
    result.assert_outcomes(passed=5)


def test_a_failing_assertion_in_an_author_test_fails(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_wrong="""
        def test_wrong_order(elastic_agent_runner, tmp_path):
            script = tmp_path / "w.py"
            script.write_text("pass\\n")
            run = elastic_agent_runner.run(str(script))
            assert run.hook_names[0] == "elastic_run_end"
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", timeout=300)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*assert 'elastic_addoption' == 'elastic_run_end'*"])
