"""This node's worker processes. Owns starting, polling and stopping them (``process``;
``child``, what a new one does first, and signalling its group; ``exits`` wakes on their
exit), warm spares a restart's workers start in (``spare``, running ``spare_main``), the
agent's signals and which it forwards (``signals``),
their logs (``logs``) and error files (``errorfile``), torchrun's worker environment
(``env``), the GPUs found without torch (``devices``), ``--numa-binding`` (``numa``), the
agent loop's pulse that liveness reads (``loop_clock``), the control file an agent uses to
ask them to checkpoint or regroup (``control_file``), and ``boot``, the directory put first
on their ``PYTHONPATH``.

Imports ``interfaces`` only; may import ``log`` too (the rooms below it). A public room
for plugins and training code."""
