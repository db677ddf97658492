"""The kit for plugin authors, shipped in the wheel: the rendezvous backend conformance
suite (``conformance``, ``conformance_runner``, ``conformance_node``), the pytest plugin
(``pytest_plugin``: ``elastic_agent_runner``, ``elastic_conformance``; ``agent_runner``),
real etcd servers as fixtures (``etcd``), and the ``ports`` and ``waits`` they use.
The suite's own harness (simulated hosts, SLURM, the fault jobs) is ``elastic.harness``,
which is not shipped."""
