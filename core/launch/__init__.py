"""From a launch configuration to a finished run: ``config`` (``LaunchConfig``, the one
description of a launch that the CLI, the Python API and the agent share, and where it is
validated) and ``launcher`` (pick the rendezvous, build the worker spec, run the agent).
The top room of core."""
