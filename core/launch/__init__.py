"""From a launch configuration to a finished run: ``LaunchConfig`` (the one description of
a launch that the CLI, the Python API and the agent share) and ``launcher`` (pick the
rendezvous, build the worker spec, run the agent). The top room of core."""
