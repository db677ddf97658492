"""Plugin mechanics. Owns the hook specifications (``hookspecs``), the pluggy host that
loads ``elastic.plugins`` entry points (``host``), per-plugin isolation (``isolation``)
and tracing (``trace``), entry-point metadata read without importing (``entry_points``)
and kept on disk between starts (``installed``), the loader for pick-by-name groups
(``named``), the one line a feature missing its extra prints (``extras``), the options
plugins add to ``elastic run`` (``options``) and what every plugin is told about a
launch (``config``: ``ElasticConfig``).

May import ``interfaces`` and ``log`` (the rooms below it), and pluggy; a public room
for plugins."""
