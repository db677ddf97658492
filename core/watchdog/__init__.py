"""Hang detection while workers run: progress beats (``beats``), stacks without ptrace
(``stacks``), the stall rule on one node and across the job (``stall``,
``job_channel``), torch's FileTimer protocol (``file_timer``) and the health endpoint
(``health``). The agent drives them all through ``stall.StallWatchdog``'s few calls.
Imports ``interfaces`` and ``workers``."""
