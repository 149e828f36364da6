"""Starting a worker so that it never outlives the agent: the parent-death signal.

* :mod:`.parent` (the agent's side): :func:`~.parent.spawn_process` starts a command the way every worker, standby
  and sidecar of the agent starts: from the event-loop thread, the leader of a session of its own, exec'd through
  util-linux ``setpriv --pdeathsig KILL --`` or, where ``setpriv`` is missing, through :mod:`.child`;
  :func:`~.parent.wait_process` awaits an exit through a pidfd; the pipe reader and output streams of a worker.
* :mod:`.child` (run by path in the worker's place before it execs): ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, then
  ``execvp`` of the worker's command, so the worker keeps the pid the agent sees.

Why the event-loop thread: the kernel ties the parent-death signal to the *thread* that forked (see
:mod:`aelastic.agent.processes`).
"""
