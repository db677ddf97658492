import time

T0 = time.time()  # the first statement: the worker's start time, before any other import

import json  # noqa: E402 - deliberately after the timestamp
import os  # noqa: E402
import sys  # noqa: E402

# (No module docstring above: the timestamp must be the very first statement.)
# A benchmark worker: records when it started (and when it fails), then acts a mode.
#
# usage: probe.py OUT_DIR MODE   with MODE one of
#   start        exit 0 at once (launch latency)
#   sleep:SECS   sleep, then exit 0 (so the launcher's peak RSS can be sampled)
#   restart      attempt 0: local rank 1 writes its exit time and exits 1, the others
#                sleep until they are stopped; later attempts exit 0 (restart latency)
#   restart:SECS the same, local rank 1 failing SECS after its start (not 0.3 s)


def record(out_dir: str, kind: str, stamp: float) -> None:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank = os.environ.get("RANK", "?")
    payload = {"t": stamp, "kind": kind, "attempt": int(attempt), "rank": rank, "pid": os.getpid()}
    path = os.path.join(out_dir, f"{kind}-{attempt}-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f)
    os.replace(path + ".tmp", path)  # atomic: the bench never reads half a file


def main() -> int:
    out_dir, mode = sys.argv[1], sys.argv[2]
    record(out_dir, "start", T0)
    if mode == "start":
        return 0
    if mode.startswith("sleep:"):
        time.sleep(float(mode.split(":", 1)[1]))
        return 0
    if mode == "restart" or mode.startswith("restart:"):
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return 0
        if os.environ.get("LOCAL_RANK") == "1":
            # 0.3 s: let the launcher settle into monitoring first
            time.sleep(float(mode.split(":", 1)[1]) if ":" in mode else 0.3)
            record(out_dir, "fail", time.time())
            return 1
        time.sleep(120)  # a healthy sibling: the launcher must stop it
        return 0
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main())
