"""The path plugin authors were taught: the same module as ``elastic.core.plugin.options``."""

import sys

from elastic.core.plugin import options as _home

sys.modules[__name__] = _home
