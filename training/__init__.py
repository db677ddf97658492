"""The training side of elastic: ``State``, ``train`` and ``init_process_group``.

Imported by worker processes only; torch is imported lazily, on first use. May import
core's rooms but the agent's side (``agent``, ``launch``, ``rendezvous``: contract
``training-not-agent`` in ``pyproject.toml``); never plugins, the API or the CLI.
"""
