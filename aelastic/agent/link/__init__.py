"""The link between the agent and each worker it starts: a private socket pair, one per worker process.

The agent side (:mod:`.parent`) makes the pair when it starts a worker and serves the worker's requests in its
event loop; the worker side (:mod:`aelastic.worker._link`) opens its end on first use. Features that need the worker to
ask the agent something (:mod:`aelastic.agent.checkpoint`) or the agent to learn something before the kernel would tell
it (the exit status of a worker whose interpreter is still tearing down) speak over it.
"""
