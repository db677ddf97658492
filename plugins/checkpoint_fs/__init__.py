"""The ``fs`` checkpointer and its hook plugin.

Holds ``directory`` (the checkpointer: numbered checkpoint files in one directory, entry
point ``fs`` in ``elastic.checkpoint``) and ``hooks`` (the ``checkpoint`` hook plugin:
``--checkpoint``, and the name workers are given). Every agent loads ``hooks``, so this
package imports nothing: the checkpointer, its hashing and paths, stay in the workers that
use it. Imports core's ``checkpoint``, ``plugin`` and ``log``; may import core's public
rooms only (contract ``plugins-public-core``), no torch.
"""
