"""The path plugin authors were taught: the same module as ``elastic.core.plugin.hookspecs``."""

import sys

from elastic.core.plugin import hookspecs as _home

sys.modules[__name__] = _home
