"""Hang detection (``--hang-timeout``): a job whose workers all stopped making progress is named hung, the odd ranks
out are named and killed, and the attempt fails as any other (docs/howto/diagnosis.md).

* :mod:`.parent` (the agent's side): :class:`~.parent.HangWatch`, beside one attempt's workers: the workers' CPU
  time sampled, the nodes' agreement in the round's store, the dumps and the kill.
* :mod:`.verdict`: the verdict on what every node saw, pure."""
