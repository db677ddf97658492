"""The static backend's workers on node 0's store, as under torchrun: they connect to
``--master-addr:--master-port`` as clients (``TORCHELASTIC_USE_AGENT_STORE=True``), so a
script's ``init_method="tcp://host:<--master-port>"`` works, and node 0 clears their keys
before every round, so no attempt reads what an earlier one left."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from elastic.core.interfaces.rendezvous import RendezvousParameters
from elastic.core.tcpstore import TCPStoreClient, TCPStoreServer
from elastic.plugins.rdzv_static import create_handler


def test_server_clear_keeps_the_prefix_and_runs_between_requests() -> None:
    server = TCPStoreServer("127.0.0.1", 0)
    client = TCPStoreClient("127.0.0.1", server.port, 10.0)
    try:
        for key in ("job/a", "job/b", "default_pg/0", "init/"):
            client.set(key, "1")
        stop = threading.Event()

        def hammer() -> None:  # requests in flight while clear() runs
            while not stop.is_set():
                client.add("job/n", 1)

        with ThreadPoolExecutor(1) as pool:
            busy = pool.submit(hammer)
            assert server.clear(keep_prefix=b"/job/") == 2
            stop.set()
            busy.result(timeout=10)
        assert client.check(["job/a", "job/b", "job/n"])
        assert not client.check(["default_pg/0"]) and not client.check(["init/"])
        assert server.clear(keep_prefix=b"/job/") == 0
    finally:
        client.close()
        server.close()
    with pytest.raises(RuntimeError, match="closed"):
        server.clear()


def params(rank: int, port: int) -> RendezvousParameters:
    return RendezvousParameters(
        backend="static",
        endpoint=f"127.0.0.1:{port}",
        run_id="job1",
        min_nodes=2,
        max_nodes=2,
        config={"rank": str(rank), "timeout": "30"},
    )


def test_a_round_clears_the_workers_keys_and_keeps_the_jobs(port: int) -> None:
    handlers = [create_handler(params(r, port)) for r in (0, 1)]
    worker: TCPStoreClient | None = None

    def round_() -> list[Any]:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(h.next_rendezvous) for h in handlers]
            return [f.result(timeout=60) for f in futures]

    try:
        first, _ = round_()
        worker = TCPStoreClient("127.0.0.1", port, 10.0)  # as torch's workers do
        worker.set("default_pg/0//cpu//0/0", "a dead attempt's address")
        first.store.set("agent/restarts", json.dumps(1))  # job state is the agents'
        second, _ = round_()
        assert not worker.check(["default_pg/0//cpu//0/0"])
        assert json.loads(second.store.get("agent/restarts")) == 1
        assert second.store.check(["rdzv/job"])
    finally:
        if worker is not None:
            worker.close()
        with ThreadPoolExecutor(2) as pool:
            assert all(f.result(timeout=60) for f in [pool.submit(h.shutdown) for h in handlers])


# -- end to end: two agents on loopback, 2 workers each, gloo ----------------------------

WORKER = """\
import json, os, sys
from datetime import timedelta
import torch
import torch.distributed as dist

out, mode, method, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if mode == "fail_before" and attempt == 0 and rank == 3:
    sys.exit(3)  # node 1's second worker fails once, before joining; all must restart
if method == "tcp":  # as torch's launcher tests do: the port given to the launcher
    addr = os.environ["MASTER_ADDR"]
    dist.init_process_group(
        "gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world
    )
else:
    dist.init_process_group("gloo")
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
# A key of this attempt, next to the ones gloo left: a later attempt must not see it.
store = dist.TCPStore(os.environ["MASTER_ADDR"], port, is_master=False,
                      timeout=timedelta(seconds=30))
stale = store.check([f"seen/{rank}"])
store.set(f"seen/{rank}", str(attempt))
dist.barrier()
if mode == "fail_after" and attempt == 0 and rank == 3:
    sys.exit(3)  # after a whole attempt's keys are in the store
record = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                                     "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                                     "TORCHELASTIC_USE_AGENT_STORE")}
record["sum"], record["stale"] = value.item(), stale
record["secrets"] = sorted(k for k in os.environ if k.startswith("ELASTIC_RDZV_"))
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(record, f)
dist.destroy_process_group()
"""


def run_two_nodes(  # noqa: ANN201
    procs,  # noqa: ANN001
    tmp_path: Path,
    port: int,
    mode: str,
    method: str,
    *flags: str,
    env_extra: dict[str, str] | None = None,
):
    """``elastic run --nnodes=2 --node-rank=R --master-port=PORT ... worker.py`` for both
    nodes; every rank's record of its last attempt, checked for what every job shares
    (``env_extra``: more of the agents' environment)."""
    from elastic.harness.commands import cli_env

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    # A lost reverse-DNS query would stall a TCPStore connection 5 s (see design notes).
    env = cli_env({"RES_OPTIONS": "timeout:1 attempts:1", **(env_extra or {})})
    nodes = [
        procs.elastic(
            "run",
            "--nnodes=2",
            f"--node-rank={rank}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "--nproc-per-node=2",
            *flags,
            str(script),
            str(out),
            mode,
            method,
            str(port),
            env=env,
        )
        for rank in (0, 1)
    ]
    for rank, node in enumerate(nodes):
        stdout, stderr = node.communicate(timeout=100)
        assert node.returncode == 0, f"node {rank}:\n{stdout}\n{stderr}"
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert [int(r["RANK"]) for r in records] == [0, 1, 2, 3]
    assert {r["WORLD_SIZE"] for r in records} == {"4"}
    assert [int(r["GROUP_RANK"]) for r in records] == [0, 0, 1, 1]
    assert {r["sum"] for r in records} == {10.0}  # 1 + 2 + 3 + 4 over gloo
    # torchrun's static backend: the agent's store, on the launcher's address and port.
    assert {r["MASTER_ADDR"] for r in records} == {"127.0.0.1"}
    assert {r["MASTER_PORT"] for r in records} == {str(port)}
    assert {r["TORCHELASTIC_USE_AGENT_STORE"] for r in records} == {"True"}
    assert not any(r["stale"] for r in records)
    return records


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["env", "tcp"])
def test_e2e_two_node_static_job_allreduce(procs, tmp_path, port: int, method: str) -> None:  # noqa: ANN001
    records = run_two_nodes(procs, tmp_path, port, "ok", method)
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in records} == {"0"}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("mode", "method"), [("fail_before", "env"), ("fail_after", "tcp")])
def test_e2e_a_restart_starts_on_a_clean_store(procs, tmp_path, port: int, mode, method) -> None:  # noqa: ANN001
    # fail_before: node 0's workers are blocked in init_process_group (their gloo keys
    # written); node 1 restarting shows up as a waiting node, so node 0 stops them and
    # joins the next round. fail_after: every key of attempt 0 is there, node 0's workers
    # finished, and its exit barrier sends it back. Either way attempt 1 must form its
    # gloo group without meeting attempt 0's keys (``stale``: checked in run_two_nodes).
    records = run_two_nodes(procs, tmp_path, port, mode, method, "--max-restarts=1")
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in records} == {"1"}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_e2e_a_token_job_keeps_its_token_from_the_workers(procs, tmp_path, port: int) -> None:  # noqa: ANN001
    """The agents coordinate with the token (node 0's store admits them by it) while the
    workers, torch's clients, use the same store without it; no worker inherits the
    token from its agent's environment."""
    env = {"ELASTIC_RDZV_TOKEN": "a-job-token-of-more-than-16-bytes"}
    records = run_two_nodes(procs, tmp_path, port, "ok", "env", env_extra=env)
    assert [r["secrets"] for r in records] == [[]] * 4
