"""The built-in error reporting: the ``errors`` hook plugin and ``elastic.record``.

Owns ``hooks`` (``ErrorsPlugin``, entry point ``errors`` in ``elastic.plugins``: a line
per worker failure, the job-wide summary, ``--error-summary``), ``summary`` (the
``FailureSummary`` rendered as the table on stderr and as JSON) and ``record`` (the
decorator a worker's entry function wears, writing torch's error-file format; it runs in
every worker and stays cheap to import).

Imports core's ``plugin``, ``interfaces``, ``workers`` (the error files) and ``log``;
may import core's public rooms only (contract ``plugins-public-core``), no torch.
"""
