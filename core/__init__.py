"""The launcher's core, in rooms by job. Each room may import only the rooms below it
(``tests/test_layers.py`` holds the order, so it cannot rot)::

    launch        LaunchConfig and launch(): from a configuration to a finished run
      agent       the node agent's loop, its endings, departure, preemption, job state
        watchdog    stalls, progress beats, stacks, the FileTimer server, the health port
        rendezvous  the backend registry, standalone, addresses, fingerprints, the round
        metrics, checkpoint   the metric and checkpointer APIs and their named sinks
          plugin     hook specs, the plugin host, isolation, tracing, entry points,
                     named groups, plugin options, ElasticConfig
          workers    worker processes, signals, logs, environment, error files, boot
          tcpstore   a torch-free client and server for torch's TCPStore protocol
            interfaces  rendezvous, store, coordination store, worker spec, failure
                        records, the job-wide keys: plain types, no behaviour to speak of
              log         the ``elastic`` logger: user-facing lines, their handler

Rooms at one depth do not import each other.
Nothing in core imports ``elastic.plugins`` (built-ins register through entry points like
anyone's) or torch.

``elastic.core.failures``, ``elastic.core.plugin_options`` and ``elastic.core.hookspecs``
are the paths plugin authors were taught; they name the same modules as their homes.
"""
