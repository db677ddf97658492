"""The ``elastic`` command (click): ``run``, ``plugins list``, ``status``.

The top of the product: may import everything below it (``testing``, ``api``,
``plugins``, ``training``, ``core``); nothing but ``elastic.__main__`` imports it
(``pyproject.toml``, contract ``product``)."""
