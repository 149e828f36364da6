"""Starting a worker so that it never outlives the agent: the parent-death signal.

* :mod:`.parent` (the agent's side): :func:`~.parent.spawn_process` starts a command the way every worker, standby
  and sidecar of the agent starts: from the event-loop thread, the leader of a session of its own, exec'd through
  util-linux ``setpriv --pdeathsig KILL --`` or, where ``setpriv`` is missing, through :mod:`.child`;
  :func:`~.parent.wait_process` awaits an exit through a pidfd; the pipe reader and output streams of a worker.
* :mod:`.child` (run by path in the worker's place before it execs): ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, then
  ``execvp`` of the worker's command, so the worker keeps the pid the agent sees.

Why the event-loop thread: the kernel ties the parent-death signal to the *thread* that forked. trio's
``open_process`` forks from a cached worker thread that exits after 10 idle seconds, which would kill every worker;
so workers are started with ``subprocess.Popen`` called from the event-loop thread (a fork/exec of a few
milliseconds, as torch does), their exit awaited through a pidfd (``anyio.wait_readable``, then ``Popen.poll``
reaps) and their pipes read with ``anyio.wait_readable`` + ``os.read``: the same code on asyncio and trio, no
threads, no polling. Run the event loop on a thread that lives as long as the workers (the main thread, or the
blocking portal's thread for the whole launch).
"""
