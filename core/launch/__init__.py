"""From a launch configuration to a finished run. Owns ``config`` (``LaunchConfig``, the
one description of a launch that the CLI, the Python API and the agent share, validated
there, and where a standalone launch is named), ``views`` (the one table of where each of
its fields flows, and the workers', rendezvous's and plugins' views built from it) and
``launcher`` (pick the rendezvous, build the agent, run it).

The top room of core: may import every room below it (``agent``, ``rendezvous``,
``plugin``, ``workers``, ``interfaces``, ...); never torch."""
