"""Hook plugins as pluggy calls them: order (tryfirst, trylast, both wrapper kinds),
isolation of a plugin that raises, strict hooks, tracing and the options a plugin owns.
Plugins come from throwaway distributions on PYTHONPATH (real entry points) or are
registered in-process. Names and conflicts across groups: ``test_plugin_names.py``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pluggy
import pytest
from elastic.core.plugin.config import ElasticConfig
from elastic.core.plugin.hookspecs import hookimpl
from elastic.core.plugin.host import PluginHost
from elastic.core.plugin.options import PluginOptionParser
from elastic.harness.commands import cli_env, run_elastic
from elastic.harness.distributions import make_distribution

ORDER_PLUGINS = """
from elastic.core.plugin.hookspecs import hookimpl


class Recorder:
    name = "?"

    def __init__(self):
        self.log = None

    def write(self, what):
        with open(self.log, "a") as f:
            f.write(f"{self.name}:{what}\\n")

    @hookimpl
    def elastic_agent_start(self, spec, config):
        self.log = config.option("order_log")


class Plain(Recorder):
    name = "plain"

    @hookimpl
    def elastic_addoption(self, parser):
        parser.addoption("--order-log", metavar="PATH", help="Where the order plugins write.")

    @hookimpl
    def elastic_worker_env(self, config):
        self.write("env")
        return {"ORDER": "plain", "PLAIN": "1"}


class First(Recorder):
    name = "first"

    @hookimpl(tryfirst=True)
    def elastic_worker_env(self, config):
        self.write("env")
        return {"ORDER": "first"}


class Last(Recorder):
    name = "last"

    @hookimpl(trylast=True)
    def elastic_worker_env(self, config):
        self.write("env")
        return {"ORDER": "last", "LAST": "1"}


class Wrapper(Recorder):
    name = "wrapper"

    @hookimpl(wrapper=True)
    def elastic_worker_env(self, config):
        self.write("before")
        results = yield
        self.write(f"after {len(results)}")
        return [*results, {"WRAPPED": str(len(results))}]


class OldWrapper(Recorder):
    name = "oldwrapper"

    @hookimpl(hookwrapper=True)
    def elastic_worker_env(self, config):
        self.write("before")
        outcome = yield
        self.write(f"after {len(outcome.get_result())}")
"""

ORDER_ENTRY_POINTS = """
[elastic.plugins]
order-first = order_plugins:First
order-last = order_plugins:Last
order-oldwrapper = order_plugins:OldWrapper
order-plain = order_plugins:Plain
order-wrapper = order_plugins:Wrapper
"""

# pluggy's order: wrappers around everything, the last registered outermost (entry
# points register by name, so order-wrapper after order-oldwrapper); then tryfirst,
# plain, trylast. The old-style wrapper sees the inner results, the new-style one
# returns them with its own added.
EXPECTED_ORDER = [
    "wrapper:before",
    "oldwrapper:before",
    "first:env",
    "plain:env",
    "last:env",
    "oldwrapper:after 3",
    "wrapper:after 3",
]

SHOW_ENV = """
import os
print("ENV", os.environ["ORDER"], os.environ["PLAIN"], os.environ["LAST"],
      os.environ["WRAPPED"], flush=True)
"""


@pytest.fixture
def order_site(tmp_path: Path) -> Path:
    return make_distribution(
        tmp_path / "site", "order_plugins", ORDER_ENTRY_POINTS, {"order_plugins": ORDER_PLUGINS}
    )


def test_hook_order_through_pluggy_in_a_real_run(order_site: Path, tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(order_site), "ELASTIC_TRACE_PLUGINS": "1"}
    helped = run_elastic("run", "--help", env=env, timeout=60)
    assert "Options from plugin 'order-plain':" in helped.stdout
    assert "--order-log, --order_log PATH" in helped.stdout

    script = tmp_path / "show.py"
    script.write_text(SHOW_ENV)
    log = tmp_path / "order.log"
    result = run_elastic("run", "--standalone", f"--order-log={log}", str(script), env=env)
    assert result.returncode == 0, result.stderr
    assert log.read_text().splitlines() == EXPECTED_ORDER
    # Merged answers: the first implementation called wins a key; the wrapper's is kept.
    assert "ENV first 1 1 3" in result.stdout
    # The trace lists the implementations in the order pluggy calls them.
    trace = next(
        line for line in result.stderr.splitlines() if "trace: elastic_worker_env(" in line
    )
    called = [p for p in trace.split(" -> ")[1].split(", ") if p.startswith("order-")]
    assert called == [
        "order-wrapper (wrapper)",
        "order-oldwrapper (hookwrapper)",
        "order-first",
        "order-plain",
        "order-last",
    ], trace
    assert "trace: elastic_worker_env returned [" in result.stderr


def test_plugin_option_from_the_environment(order_site: Path, tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text(SHOW_ENV)
    log = tmp_path / "from-env.log"
    env = {"PYTHONPATH": str(order_site), "ELASTIC_ORDER_LOG": str(log)}
    result = run_elastic("run", "--standalone", str(script), env=env)
    assert result.returncode == 0, result.stderr
    assert log.read_text().splitlines() == EXPECTED_ORDER


def test_help_does_not_load_plugins(order_site: Path) -> None:
    code = (
        "import sys\nfrom elastic.cli.main import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'order_plugins' not in sys.modules and 'pluggy' not in sys.modules\n"
        "assert 'torch' not in sys.modules\n"
    )
    env = cli_env({"PYTHONPATH": str(order_site)})
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


# --- isolation, in-process ------------------------------------------------------------


class Good:
    def __init__(self) -> None:
        self.calls = 0

    @hookimpl
    def elastic_worker_env(self, config: ElasticConfig) -> dict[str, str]:
        self.calls += 1
        return {"GOOD": "1"}


class Raising:
    def __init__(self) -> None:
        self.calls = 0

    @hookimpl(tryfirst=True)
    def elastic_worker_env(self, config: ElasticConfig) -> dict[str, str]:
        self.calls += 1
        raise RuntimeError("boom")

    @hookimpl
    def elastic_run_end(self, result: Any, duration: float) -> None:
        raise AssertionError("a dropped plugin must not be called again")


class BadTeardown:
    @hookimpl(wrapper=True)
    def elastic_worker_env(self, config: ElasticConfig) -> Any:
        results = yield
        raise ValueError(f"teardown saw {len(results)}")


class BadOldSetup:
    @hookimpl(hookwrapper=True)
    def elastic_worker_env(self, config: ElasticConfig) -> Any:
        raise KeyError("setup")
        yield  # pragma: no cover - makes it a generator


class StrictReporter:
    @hookimpl
    def elastic_run_failed(self, summary: Any) -> None:
        raise OSError("disk full")


def bare_host() -> PluginHost:
    return PluginHost(autoload=False)


def test_a_raising_plugin_is_reported_once_and_dropped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    host = bare_host()
    good, raising = Good(), Raising()
    host.register(good, "good")
    host.register(raising, "raising")
    host.register(BadTeardown(), "bad-teardown")
    host.register(BadOldSetup(), "bad-setup")
    config = ElasticConfig()
    assert host.worker_env(config) == {"GOOD": "1"}
    err = capsys.readouterr().err.splitlines()
    assert sorted(err) == [
        "elastic: plugin 'bad-setup' failed in elastic_worker_env (KeyError: 'setup'); "
        "it is disabled for the rest of this run",
        "elastic: plugin 'bad-teardown' failed in elastic_worker_env "
        "(ValueError: teardown saw 1); it is disabled for the rest of this run",
        "elastic: plugin 'raising' failed in elastic_worker_env (RuntimeError: boom); "
        "it is disabled for the rest of this run",
    ]
    assert host.plugin_names() == ["good"]
    assert host.worker_env(config) == {"GOOD": "1"}
    host.notify("elastic_run_end", result=None, duration=0.0)
    assert (good.calls, raising.calls) == (2, 1)
    assert capsys.readouterr().err == ""
    record = next(r for r in host.records if r.name == "raising")
    assert record.status == "error" and "RuntimeError: boom" in (record.error or "")


def test_strict_hook_raises() -> None:
    host = bare_host()
    host.register(StrictReporter(), "reporter")
    with pytest.raises(OSError, match="disk full"):
        host.call_strict("elastic_run_failed", summary=None)
    assert host.plugin_names() == ["reporter"]  # not dropped: the caller decides


def test_an_interrupt_is_never_swallowed() -> None:
    class Interrupting:
        @hookimpl
        def elastic_run_end(self, result: Any, duration: float) -> None:
            raise KeyboardInterrupt

    host = bare_host()
    host.register(Interrupting(), "interrupting")
    with pytest.raises(KeyboardInterrupt):
        host.notify("elastic_run_end", result=None, duration=0.0)


def test_a_misspelled_hook_fails_at_registration() -> None:
    class Misspelled:
        @hookimpl
        def elastic_agent_strat(self, spec: Any) -> None: ...

    with pytest.raises(pluggy.PluginValidationError, match="elastic_agent_strat"):
        bare_host().register(Misspelled(), "misspelled")


def test_private_names_are_never_hooks() -> None:
    """The host never reads a plugin's ``_private`` or dunder names (pluggy would read each
    through the class's MRO at every start): a marked private helper is not a hook."""
    called: list[str] = []

    class WithHelper:
        @hookimpl
        def _elastic_agent_start(self, spec: Any, config: Any) -> None:
            called.append("helper")

        @hookimpl
        def elastic_agent_start(self, spec: Any, config: Any) -> None:
            called.append("hook")

    host = bare_host()
    host.register(WithHelper(), "with-helper")
    assert not hasattr(host.pm.hook, "_elastic_agent_start")  # never read as a hook
    host.notify("elastic_agent_start", spec=None, config=None)
    assert called == ["hook"]


def test_option_conflicts_drop_the_plugin(capsys: pytest.CaptureFixture[str]) -> None:
    class Owner:
        @hookimpl
        def elastic_addoption(self, parser: PluginOptionParser) -> None:
            parser.addoption("--shared", help="first")

    class Clash:
        @hookimpl
        def elastic_addoption(self, parser: PluginOptionParser) -> None:
            parser.addoption("--mine", help="fine")
            parser.addoption("--nnodes", help="taken by elastic run")

    host = bare_host()
    host.register(Owner(), "owner")
    host.register(Clash(), "clash")
    options = host.add_options(PluginOptionParser(reserved=["--nnodes", "dest:nnodes"]))
    assert [(o.plugin, o.names) for o in options] == [("owner", ("--shared",))]
    assert "plugin 'clash' failed in elastic_addoption (OptionConflictError: the option " in (
        capsys.readouterr().err
    )


def test_each_host_gets_its_own_plugin_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_PLUGINS", "errors,event_log")
    one, two = PluginHost(), PluginHost()
    one.load()
    two.load()
    assert type(one.get_plugin("errors")).__name__ == "ErrorsPlugin"
    assert one.get_plugin("errors") is not two.get_plugin("errors")
    assert {r.name: r.status for r in one.records}["metrics"] == "disabled"


def test_hookspecs_are_documented() -> None:
    from elastic.core.plugin import hookspecs

    names = [n for n in dir(hookspecs) if n.startswith("elastic_")]
    assert {"elastic_addoption", "elastic_agent_start", "elastic_worker_env"} <= set(names)
    for name in names:
        doc = textwrap.dedent(getattr(hookspecs, name).__doc__ or "")
        assert len(doc.split()) >= 8, f"{name} needs a docstring saying when it is called"
