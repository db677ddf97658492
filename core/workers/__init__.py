"""This node's worker processes. Owns starting, polling and stopping them (``process``),
the agent's signals and which it forwards (``signals``), their logs (``logs``) and error
files (``errorfile``), torchrun's worker environment (``env``), the control file an agent
uses to ask them to checkpoint or regroup (``control_file``), and ``boot``, the directory
put first on their ``PYTHONPATH``.

May import ``interfaces`` and ``log`` (the rooms below it); a public room for plugins and
training code."""
