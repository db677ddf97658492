"""The typed interfaces everything else is written against: the rendezvous handler and
the values it exchanges, the key-value store the agent gets, the coordination store the
shared round runs over, the worker spec and result, failure records, and the job-wide
store keys. Imports nothing else from ``elastic``."""
