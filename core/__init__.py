"""The launcher's core, in rooms by job. Each room may import only the rooms below it;
rooms on one line do not import each other. The order is held in ``pyproject.toml``
(``[tool.importlinter]``, contract ``core-rooms``, exhaustive: a new room is refused until
it is given its place there); ``tests/test_layers.py`` runs it::

    failures, plugin_options, hookspecs   the paths plugin authors were taught
      launch      LaunchConfig, its views, create_agent(): from a configuration to an agent
        agent       the node agent's loop, its endings, departure, preemption, job state
          watchdog    stalls, progress beats, stacks, the FileTimer server, the health port
          rendezvous  the backend registry, standalone, addresses, fingerprints, the round
          metrics, checkpoint   the metric and checkpointer APIs and their named sinks
            plugin     hook specs, the plugin host, isolation, tracing, entry points,
                       named groups, plugin options, ElasticConfig
            workers    worker processes, signals, logs, environment, error files, boot
            tcpstore   a torch-free client and server for torch's TCPStore protocol
              interfaces  rendezvous, store, coordination store, agent, worker spec and
                          watch, failure records, the job-wide keys: plain types
                log         the ``elastic`` logger: user-facing lines, their handler

``elastic.core.failures``, ``elastic.core.plugin_options`` and ``elastic.core.hookspecs``
name the same modules as their homes (``interfaces.failures``, ``plugin.options``,
``plugin.hookspecs``); they sit above every room, so no room imports them.

Plugins (``elastic.plugins``, and anyone's) import only core's public rooms: every room
but ``agent``, ``launch`` and ``watchdog`` (contract ``plugins-public-core``); training
code never imports ``agent``, ``launch`` or ``rendezvous``. Nothing in core imports
``elastic.plugins`` (built-ins register through entry points like anyone's), the CLI, the
API, training or testing code (contract ``product``), or torch (``no-torch``).
"""
