"""The ``elastic`` command (click): ``run``, ``plugins list``, ``status``.

Owns ``main`` (the command group, cheap to import), one module per command (``run``,
``plugins_cmd``, ``status``), ``options`` (torchrun's flags as reusable decorators and
their parsers), ``run_config`` (from ``elastic run``'s options to a ``LaunchConfig``),
``entrypoint`` (the training script and how workers run it), ``plugin_options`` (the
options hook plugins add), ``slurm`` (what an ``srun`` step fills in) and ``dry_run``
(``--dry-run``: the launch printed, not started).

The top of the product: may import everything below it (``testing``, ``api``,
``plugins``, ``training``, ``core``); it imports ``core``'s rooms and ``elastic``'s
version; nothing but ``elastic.__main__`` imports it (``pyproject.toml``, contract
``product``)."""
