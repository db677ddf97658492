"""Names in every plugin group: a name claimed by two distributions is an error naming
both (rendezvous, metrics, checkpoint and hook plugins alike), in-process registration
never shadows an installed name, load failures are listed, and the launcher reuses the
backend factory the CLI resolved."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from elastic.harness.commands import run_elastic
from elastic.harness.distributions import make_distribution

DUP = "[elastic.rendezvous]\ndup = {m}:create\n[elastic.metrics]\ndup = {m}:Sink\n" + (
    "[elastic.checkpoint]\ndup = {m}:create\n[elastic.plugins]\ndup = {m}\n"
)


@pytest.fixture
def dup_site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    for dist in ("dup_one", "dup_two"):
        make_distribution(site, dist, DUP.format(m=dist), {dist: "create = Sink = None\n"})
    return site


def test_a_name_claimed_twice_names_both_in_every_group(dup_site: Path, tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(dup_site)}
    listed = run_elastic("plugins", "list", "--json", env=env, timeout=60)
    records = [r for r in json.loads(listed.stdout) if r["name"] == "dup"]
    assert sorted(r["group"] for r in records) == sorted(
        2 * ["elastic.rendezvous", "elastic.metrics", "elastic.checkpoint", "elastic.plugins"]
    )
    for record in records:
        assert record["status"] == "error", record
        assert "'dup' is claimed by dup_one==0.1 (dup_one" in record["error"], record
        assert " and dup_two==0.1 (dup_two" in record["error"], record

    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    for flags, what in [
        (["--rdzv-backend=dup", "--rdzv-endpoint=127.0.0.1:1"], "rendezvous backend"),
        (["--standalone", "--metrics-sink=dup"], "metrics sink"),
        (["--standalone", "--checkpoint=dup:x"], "checkpointer"),
    ]:
        result = run_elastic("run", *flags, str(script), env=env, timeout=60)
        assert result.returncode == 2, result.stderr
        line = result.stderr.strip().splitlines()[-1]
        assert line.startswith("elastic run: error:") and "Traceback" not in result.stderr
        assert f"{what} 'dup' is claimed by dup_one==0.1 (dup_one:" in line
        assert "and dup_two==0.1 (dup_two:" in line
        # The hook plugin named twice is loaded by neither, said once.
        assert result.stderr.count("hook plugin 'dup' is claimed by") == 1


def test_in_process_registration_never_shadows_an_installed_name() -> None:
    from elastic.core.checkpoint import register_checkpointer
    from elastic.core.metrics import register_sink
    from elastic.core.rendezvous.registry import register_rendezvous_handler

    for register, name in [
        (register_rendezvous_handler, "c10d"),
        (register_sink, "jsonl"),
        (register_checkpointer, "fs"),
    ]:
        with pytest.raises(ValueError, match=rf"'{name}' is already provided by elastic-launch=="):
            register(name, lambda arg: None)  # type: ignore[arg-type, return-value]


def test_the_launcher_reuses_the_factory_it_is_given() -> None:
    from elastic.core.launch.config import LaunchConfig
    from elastic.core.launch.launcher import create_handler
    from elastic.core.rendezvous.local import LocalRendezvousHandler

    made: list[Any] = []

    def factory(params: Any) -> LocalRendezvousHandler:
        made.append(params)
        return LocalRendezvousHandler(params.run_id)

    # No backend has this name: it is never looked up again, the factory is used.
    config = LaunchConfig(1, 1, 1, run_id="r", rdzv_backend="resolved-by-the-cli")
    handler = create_handler(config, factory)
    assert handler.get_run_id() == "r" and made[0].backend == "resolved-by-the-cli"


def test_broken_sink_is_listed_with_its_error(tmp_path: Path) -> None:
    site = make_distribution(
        tmp_path / "site",
        "broken_sink",
        "[elastic.metrics]\nbroken = broken_sink:Sink\n",
        {"broken_sink": "raise ImportError('needs statsd')\n"},
    )
    listed = run_elastic("plugins", "list", "--json", env={"PYTHONPATH": str(site)}, timeout=60)
    (record,) = [r for r in json.loads(listed.stdout) if r["name"] == "broken"]
    assert (record["status"], record["error"]) == ("error", "ImportError: needs statsd")
    assert record["distribution"] == "broken_sink"
