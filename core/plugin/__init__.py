"""Plugin mechanics. Owns the hook specifications (``hookspecs``), the pluggy host that loads
``elastic.plugins`` entry points (``host``), per-plugin isolation and tracing, entry-point
metadata and the loader for pick-by-name groups (``named``), the options plugins add to
``elastic run`` (``options``) and what every plugin is told about a launch (``config``:
``ElasticConfig``).

May import ``interfaces`` and ``log`` (the rooms below it); a public room for plugins."""
