"""The shared round: the one rendezvous algorithm c10d, etcd-v2 and etcd-v3 run over a
small coordination store. Owns, top to bottom (its own order, contract ``round`` in
``pyproject.toml``; modules on one line do not import each other)::

    handler                  RoundRendezvousHandler, what a backend hands its stores to
      status                 describe(): the read-only view ``elastic status`` prints
        protocol             the loop that joins rounds until one forms with us
          coordinating       the lowest slot decides the round and publishes it
            joining          admission, a join slot, the wait for the outcome
              publishing     the round key, outcomes, rosters, the closed mark
                monitor, progress_lines   the background thread (departures, scale-up,
                                          closing, job keys); the lines a person reads
                  liveness         who died: heartbeat values, presence, lost lists
                    links, lease   connections to rank 0 and its deputy; keep-alives, fencing
                      presence_client   a member's end of a presence connection
                        presence, probe   a dead agent seen at once (the serving port);
                                          asking a port that never connected
                          records, judges   keys and JSON records; the thread that judges leases
                            signing, settings   the HMAC rule; the ``--rdzv-conf`` keys

Imports, outside the round, ``tcpstore`` (``presence``: the listening limits),
``interfaces``, ``log`` and its siblings ``net``, ``fingerprint`` and ``secrets``; it may
import what ``rendezvous`` may, nothing above it."""
