"""elastic on the (fictional) Acme cluster: the ``acme`` rendezvous backend and the
``acme-report`` hook plugin. See elastic's ``docs/plugins.md`` for the walk-through."""
