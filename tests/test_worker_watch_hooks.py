"""The hooks the built-in watchdog runs on are everyone's: a plugin that watches workers
(``elastic_worker_process_env``, ``elastic_check_workers``, ``elastic_annotate_failures``)
ends an attempt the way the stall detector does, and the built-ins appear on the agent's
plugin host only for the run that asked for them."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from elastic.core.agent.loop import LocalElasticAgent
from elastic.core.interfaces.worker_watch import WorkerVerdict
from elastic.core.plugin.hookspecs import hookimpl
from elastic.core.plugin.host import PluginHost
from elastic.core.rendezvous.local import LocalRendezvousHandler
from elastic.harness.commands import write_script as script
from elastic.harness.worker_specs import make_spec

SLEEPER = """
import os, sys, time
with open(os.path.join(sys.argv[1], f"env_{os.environ['LOCAL_RANK']}"), "w") as f:
    f.write(os.environ.get("WATCHER_TAG", ""))
time.sleep(60)
"""


class Watcher:
    """Gives each worker a variable; after a second, kills local rank 1 and says so."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.annotated: list[int] = []

    @hookimpl
    def elastic_worker_process_env(self, local_rank: int, error_file: str) -> dict[str, str]:
        return {"WATCHER_TAG": f"rank{local_rank}:{os.path.basename(error_file)}"}

    @hookimpl
    def elastic_check_workers(self, workers: list[Any]) -> WorkerVerdict | None:
        if time.monotonic() - self.started < 1.0:
            return None
        victim = next(w for w in workers if w.local_rank == 1)
        os.killpg(victim.pid, signal.SIGKILL)
        return WorkerVerdict({1: (-signal.SIGKILL, time.time())})

    @hookimpl
    def elastic_annotate_failures(self, records: list[Any]) -> None:
        for record in records:
            record.extra["watcher"] = "hung on purpose"
            self.annotated.append(record.local_rank)


def test_a_plugin_ends_an_attempt_like_the_stall_detector(tmp_path: Path) -> None:
    host = PluginHost(autoload=False)
    watcher = Watcher()
    host.register(watcher, "watcher")
    spec = make_spec(
        LocalRendezvousHandler("job"),
        ("-u", script(tmp_path, "sleeper.py", SLEEPER), str(tmp_path)),
        2,
        log_dir=str(tmp_path / "logs"),
    )
    result = LocalElasticAgent(spec, plugin_host=host).run()
    assert result.is_failed() and result.exit_code != 0
    assert list(result.failures) == [1]  # the worker the plugin stopped, not its sibling
    assert result.failures[1].extra["watcher"] == "hung on purpose"
    assert watcher.annotated == [1]
    tags = {r: (tmp_path / f"env_{r}").read_text() for r in range(2)}
    assert tags == {0: "rank0:error.json", 1: "rank1:error.json"}


def test_builtins_are_registered_for_their_run_only(tmp_path: Path) -> None:
    host = PluginHost(autoload=False)
    seen: dict[str, list[str]] = {}

    class Spy:
        @hookimpl
        def elastic_workers_started(self) -> None:
            seen["during"] = host.plugin_names()

    host.register(Spy(), "spy")
    spec = make_spec(
        LocalRendezvousHandler("job"),
        ("-c", "pass"),
        1,
        log_dir=str(tmp_path / "logs"),
        stall_timeout=30.0,
    )
    agent = LocalElasticAgent(spec, plugin_host=host)
    assert agent.run().exit_code == 0
    assert seen["during"] == ["spy", "stall", "watchdog"]
    assert host.plugin_names() == ["spy"]
    plain = LocalElasticAgent(make_spec(LocalRendezvousHandler("j"), ("-c", "pass"), 1))
    assert plain.run().exit_code == 0  # no feature asked: no built-in, no host needed
    assert json.dumps(seen)  # what the spy saw is plain data
