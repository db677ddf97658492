"""The node agent. Owns ``loop`` (rendezvous, start, watch, decide), built over ``base``
(``AgentBase``: the agent's state and the calls its rooms make of one another) and its
rooms: ``crew`` (starting and stopping the workers), ``endings`` (success, failure, a closed
rendezvous), ``in_place`` (the in-place regroup of an attempt) and ``signals`` (a signal to
the agent). The modules it hands each step to: ``start`` (workers for a round), ``monitor``
(watching an attempt, with ``job_watch``), ``outcome`` (how an attempt ended), ``failure``
and ``restarts`` (records, the restart budget, giving up), ``exit_barrier``, ``departure``
(a failure a leaving node caused costs nothing), ``joining`` (has this node joined the
job?), ``regroup`` (keeping workers through a membership change), ``checkpoint_on_notice``
(preemption) and ``store_call`` (store calls bounded by the handler's fencing); ``fence`` (a
fenced node's workers stopped from the handler's thread) and ``exit_code`` (what a node
exits with).

May import the rooms below it: ``watchdog``, ``rendezvous``, ``metrics``, ``checkpoint``,
``plugin``, ``workers``, ``tcpstore``, ``interfaces``, ``log``; never torch. Plugins and
training code never import it."""
