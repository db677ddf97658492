"""The shared round: the one rendezvous algorithm every dynamic backend runs over a small
coordination store."""
