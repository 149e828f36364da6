"""Signals forwarded to the workers while they run on (a scheduler's notice), exactly once per worker.

Agent side (:mod:`.parent`): the running workers' process groups, and the witness that tells whether the sender of
a signal the agent received signalled the workers directly too. Child side (:mod:`.child`): the witness itself.
"""
