"""A rendezvous node in its own process, for conformance cases that kill a node.

``python -m elastic.testing.conformance_node '<json>'`` creates the handler named by the
JSON (backend, endpoint, run_id, min_nodes, max_nodes, config), joins one round, prints
the round as one JSON line, then sleeps until killed (SIGKILL: a dead node, no cleanup).
"""

from __future__ import annotations

import json
import sys
import time

from elastic.core.interfaces.rendezvous import RendezvousParameters
from elastic.core.rendezvous.registry import get_rendezvous_handler


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    params = RendezvousParameters(
        backend=spec["backend"],
        endpoint=spec["endpoint"],
        run_id=spec["run_id"],
        min_nodes=spec["min_nodes"],
        max_nodes=spec["max_nodes"],
        local_addr=spec.get("local_addr"),
        config=dict(spec.get("config", {})),
    )
    handler = get_rendezvous_handler(params)
    info = handler.next_rendezvous()
    out = {"rank": info.rank, "world_size": info.world_size, "round": info.round}
    out["node"] = info.node_id
    print(json.dumps(out), flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
