"""The training side of elastic: ``State``, ``train`` and ``init_process_group``.

Imported by worker processes only; torch is imported lazily, on first use.
"""
