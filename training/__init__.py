"""The training side of elastic: ``State``, ``train`` and ``init_process_group``.

Owns ``state`` (``elastic.State``: sync, snapshot, persist), ``loop`` (``elastic.train``:
steps with rollback and periodic checkpoints), ``dist`` (``elastic.init_process_group``),
``tenure`` (the sync from one rank after a start or a regroup), ``heartbeat``
(``elastic.heartbeat``: progress the watchdog reads), ``preemption``
(``checkpoint_requested``/``checkpoint_saved``: the worker's side of a coordinated save),
``regroup`` (``membership_changed``/``regroup``: the worker's side of a regroup in
place), ``rounds`` (the rounds the agent hands over; one taken by a worker still
starting), ``bounded`` (waits for peers that end once the agent hands over a newer round),
``sever`` (the script's own collectives freed by cutting the old group's connections),
``control`` (the worker's end of the control file) and ``agent_file`` (mapping a file
the agent shares).

Imported by worker processes only; torch is imported lazily, on first use. Imports
core's ``workers`` (the control file), ``watchdog`` (the progress layout), ``metrics``
and ``checkpoint``; may import any of core's rooms but the agent's side (``agent``,
``launch``, ``rendezvous``: contract ``training-not-agent`` in ``pyproject.toml``);
never plugins, the API or the CLI (contract ``product``).
"""
