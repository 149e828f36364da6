"""A worker that records what its launcher gave it: argv and environment, one JSON file per rank.

Run under ``torchrun`` and ``aelastic run`` by the CLI tests; the directory is ``$PROBE_OUT``. With
``$PROBE_HOLD`` (``HOST:PORT`` of the test's listener) it then connects there and blocks until the test closes
the connection: the test learns the worker runs, and holds the job in its running state as long as it wants.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

if __name__ == "__main__":
    out = Path(os.environ["PROBE_OUT"])
    record = {"argv": sys.argv, "env": dict(os.environ)}
    path = out / f"rank{os.environ['RANK']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    tmp.replace(path)  # readers never see a half-written file
    hold = os.environ.get("PROBE_HOLD")
    if hold:
        host, port = hold.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as conn:
            conn.recv(1)  # returns when the test closes the connection
