"""Hang detection while workers run. Owns progress beats (``beats``), stacks without ptrace
(``stacks``), the stall rule on one node and across the job (``stall``,
``job_channel``), torch's FileTimer protocol (``file_timer``, ``file_timer_plugin``) and
the health endpoint (``health``). They reach the agent as built-in plugins (``builtin``
registers them), sharing what they know of the workers through ``watch.WorkerWatch``.

May import the rooms below it: ``plugin``, ``workers``, ``tcpstore``, ``interfaces`` and
``log``. Not a public room for plugins; training code imports ``beats`` (progress)."""
