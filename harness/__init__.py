"""The internal test harness: simulated hosts on network namespaces, clusters, SLURM,
the jobs the fault tests run, bench reporting, and the helpers every test module shares.

Only ``tests/`` and ``bench/`` import it, as ``elastic.harness`` through the editable
install (``pip install -e .``); it is not in the wheel. What plugin authors use ships as
``elastic.testing``.
"""
