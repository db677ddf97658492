"""The path plugin authors were taught: the same module as ``elastic.core.interfaces.failures``."""

import sys

from elastic.core.interfaces import failures as _home

sys.modules[__name__] = _home
