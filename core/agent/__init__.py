"""The node agent: ``loop`` (rendezvous, start, watch, decide) and the modules it hands
each decision to: failure handling and restarts, the exit barrier, departures, the
coordinated checkpoint on a preemption notice, and the job-wide state in the store.
May import any room below it; never torch."""
