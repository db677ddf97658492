"""This node's worker processes: starting, polling and stopping them and forwarding
signals (``process``), their logs and error files, torchrun's worker environment
(``env``), the control file an agent uses to ask them to checkpoint, and ``boot``, the
directory put first on their ``PYTHONPATH``. Imports only ``interfaces``."""
