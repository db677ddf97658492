"""The kit for plugin authors, shipped in the wheel: the rendezvous backend conformance
suite (``conformance``: the cases; ``conformance_target``: the target, the nodes and the
round helpers they run against; ``conformance_runner``, ``conformance_node``), the pytest
plugin (``pytest_plugin``: ``elastic_agent_runner``, ``elastic_conformance``;
``agent_runner``), real etcd servers as fixtures (``etcd``), and the ``ports`` and
``waits`` they use. The suite's own harness (simulated hosts, SLURM, the fault jobs) is
``elastic.harness``, which is not shipped.

Imports ``api`` and core's ``launch``, ``plugin``, ``rendezvous`` and ``interfaces``; may
import everything below it in contract ``product`` (``api``, ``plugins``, ``training``,
``core``), never the CLI or the harness."""
