"""Put on the workers' ``PYTHONPATH`` by the agent: ``sitecustomize.py`` runs at every
worker's interpreter start (see ``elastic.core.watchdog.stacks``). Nothing else lives here, since
the whole directory is on the workers' import path."""
