"""Plugin mechanics: the hook specifications (``hookspecs``), the pluggy host that loads
``elastic.plugins`` entry points (``host``), per-plugin isolation and tracing, entry-point
metadata and the loader for pick-by-name groups (``named``), the options plugins add to
``elastic run`` (``options``) and what every plugin is told about a launch (``config``).
Imports only ``interfaces``."""
