"""Callable entry points: ``launch(config, fn, *args)`` runs ``fn(*args)`` in every worker and returns the results.

* :mod:`.parent` (the agent's side): :func:`~.parent.write_payload` pickles the call for the workers (cloudpickle:
  functions of ``__main__`` by value, with the launcher's ``sys.path``), :func:`~.parent.bootstrap_args` is the
  worker's command line, :func:`~.parent.read_result` reads what a worker's call returned.
* :mod:`aelastic.worker._callables` (the worker's entry point, ``python -m aelastic.worker._callables <payload>
  <result>``): loads the call, runs it under :func:`~aelastic.worker._errorfile.record`, writes the result atomically
  and finishes together with the other local workers (:mod:`aelastic.agent.finish`).
"""
