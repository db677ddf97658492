"""The node agent: ``loop`` (rendezvous, start, watch, decide) and the modules it hands
each step to: ``start`` (workers for a round), ``monitor`` (watching an attempt, with
``job_watch``), ``outcome`` (how an attempt ended), ``failure`` and ``restarts`` (records,
the restart budget, giving up), ``exit_barrier``, ``departure`` (a failure a leaving node
caused costs nothing) and ``checkpoint_on_notice`` (preemption). May import any room
below it; never torch."""
