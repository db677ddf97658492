"""The built-in plugins, each registered through an entry point in ``pyproject.toml`` as a
third-party package registers its own.

May import core's public rooms: every room but ``agent``, ``launch`` and ``watchdog``
(``pyproject.toml``, contract ``plugins-public-core``); never training code, the API or
the CLI (contract ``product``), nor torch."""
