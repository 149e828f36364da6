"""Rendezvous: how the nodes of one run agree on who is in the next round, and on everyone's rank.

``state`` is the pure state machine (torch's ``DynamicRendezvousHandler`` semantics, no I/O, no clocks);
``dynamic`` runs it against a backend driver (``backends``); ``api`` is the handler interface the agent uses.
"""
