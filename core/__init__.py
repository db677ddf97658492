"""The agent's core: typed interfaces, the plugin registry and worker supervision.

Nothing here imports torch or any plugin module at import time.
"""
