"""The node check (``--node-check``): every node is tested before the round that admits it, and a node that fails,
or is slower than ``--node-check-slowdown`` times the median, is left out with the reason (docs/howto/node-check.md).

The agent side is :mod:`.parent` (the check of a round, through the round's store, and the check process), over
:mod:`.plan` (the groups of each check round, the messages, the verdict: pure). The check process is
:mod:`aelastic.worker._nodecheck`: a matmul on the node's device and gloo all-reduces with its peers (it imports torch,
as the workers do; the agent never does).
"""
