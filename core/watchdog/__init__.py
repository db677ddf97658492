"""Hang detection while workers run: progress beats (``beats``), stacks without ptrace
(``stacks``), the stall rule on one node and across the job (``stall``,
``job_channel``), torch's FileTimer protocol (``file_timer``) and the health endpoint
(``health``). ``builtin`` registers them on the agent's plugin host as built-in plugins.
Imports ``interfaces``, ``plugin`` and ``workers``."""
