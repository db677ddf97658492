"""The internal test harness: simulated hosts on network namespaces, clusters, SLURM,
the jobs the fault tests run, bench reporting, and the helpers every test module shares.

Owns simulated hosts (``netns``: ip/tc, namespaces' processes, the sweep; ``cluster``:
hosts on a switch; ``multihost``: real agents and etcd on them), a real SLURM
(``slurm``), the fault jobs (``preemption_job``, ``regroup_job``, and ``accumulator``:
the regroup workers' state), the launchers a test starts and their processes
(``processes``), an environment with the checkout installed from a wheel for benches
(``installed_copy``), workers' JSON records (``records``), bench reports (``benchmarking``),
and the helpers test modules import: ``commands`` (the CLI run for real),
``distributions`` (throwaway installed plugins), ``worker_specs``, ``store_sockets`` (a
misbehaving store peer), ``c10d_handlers`` (c10d handlers as threads),
``shared_rendezvous`` (several agents on one in-memory job store) and
``prometheus_names`` (the naming conventions every exported metric follows).

Only ``tests/`` and ``bench/`` import it, as ``elastic.harness`` through the editable
install (``pip install -e .``); it is not in the wheel. What plugin authors use ships as
``elastic.testing``. It sits at the top of contract ``product`` beside ``__main__``: it
may import anything of the product (it imports ``core``, the ``c10d`` plugin and
``elastic.testing``), and nothing of the product imports it."""
