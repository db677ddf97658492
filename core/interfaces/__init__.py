"""The typed interfaces everything else is written against: the rendezvous handler and
the values it exchanges (``rendezvous``; its errors, under one ``RendezvousError``, in
``rendezvous_errors``), the key-value store the agent gets (``store``),
the coordination store the shared round runs over (``coordination``), the agent
(``agent``), the worker spec and result (``spec``), what a worker-watching plugin sees
(``worker_watch``), failure records (``failures``) and the job-wide store keys
(``job_keys``).

May import nothing else from ``elastic`` (only ``log`` is below it, and it needs none)."""
