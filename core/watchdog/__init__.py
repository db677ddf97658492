"""Hang detection while workers run: progress beats (``beats``), stacks without ptrace
(``stacks``), the stall rule on one node and across the job (``stall``,
``job_channel``), torch's FileTimer protocol (``file_timer``) and the health endpoint
(``health``). They reach the agent as built-in plugins (``builtin`` registers them),
sharing what they know of the workers through ``watch.WorkerWatch``. Imports
``interfaces``, ``plugin`` and ``workers``."""
