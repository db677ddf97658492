"""Hook plugin ``checkpoint``: ``--checkpoint NAME[:ARG]`` picks the ``elastic.checkpoint``
checkpointer for the State API (``fs:DIR`` is the built-in one).

The name is checked against the group's metadata when the command line is parsed (an
unknown name is one line and exit 2) and reaches workers as ``ELASTIC_CHECKPOINT``,
where ``elastic.core.checkpoint.checkpointer_from_env`` loads just that one. Stateless,
so the plugin is this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.core.checkpoint import ENV_CHECKPOINT, validate_checkpoint_spec
from elastic.core.plugin.hookspecs import hookimpl

if TYPE_CHECKING:
    from elastic.core.plugin.config import ElasticConfig
    from elastic.core.plugin.options import PluginOptionParser


@hookimpl
def elastic_addoption(parser: PluginOptionParser) -> None:
    parser.addoption(
        "--checkpoint",
        metavar="NAME[:ARG]",
        type=validate_checkpoint_spec,
        help="Checkpointer for the State API, e.g. fs:DIR (workers get ELASTIC_CHECKPOINT).",
    )


@hookimpl
def elastic_worker_env(config: ElasticConfig) -> dict[str, str] | None:
    spec = config.option("checkpoint")
    return {ENV_CHECKPOINT: spec} if spec else None
