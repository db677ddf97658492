"""The built-in plugins, each registered through an entry point in ``pyproject.toml`` as a
third-party package registers its own.

Owns the rendezvous backends ``rdzv_c10d``, ``rdzv_etcd_v3``, ``rdzv_etcd_v2``,
``rdzv_etcd`` (torch's ``etcd`` name, on the ``etcd-v2`` adapter) and ``rdzv_static``;
the hook plugins ``errors`` (failure records, the summary, ``elastic.record``),
``metrics`` (lifecycle metrics and the metric sinks), ``event_log`` (torchrun's console
event log) and ``checkpoint_fs`` (the ``fs`` checkpointer and its hook plugin).

May import core's public rooms: every room but ``agent``, ``launch`` and ``watchdog``
(``pyproject.toml``, contract ``plugins-public-core``); never training code, the API or
the CLI (contract ``product``), nor torch. One plugin imports another only where it
says so (``rdzv_etcd_v2`` runs on ``rdzv_etcd``'s adapter)."""
