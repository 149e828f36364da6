"""``aelastic etcd``: a local etcd a user starts for a single-host etcd rendezvous, stopped by Ctrl-C."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit

from helpers.etcd import client as etcd_client


def test_etcd_command_serves_until_interrupted() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "aelastic", "etcd"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once etcd serves clients
        assert line.startswith("aelastic etcd ready: --rdzv-backend etcd --rdzv-endpoint http://127.0.0.1:"), line
        url = urlsplit(line.split()[-1])
        assert url.hostname is not None
        assert url.port is not None
        client = etcd_client(url.hostname, url.port)
        client.put("k", "v")
        assert client.range("k").kvs[0].value == b"v"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        with socket.socket() as s:  # etcd went with it
            assert s.connect_ex((url.hostname, url.port)) != 0
    finally:
        proc.kill()
        proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()
        proc.stdout.close()  # type: ignore[union-attr]


def test_etcd_command_rejects_zero_members() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "aelastic", "etcd", "--members", "0"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "aelastic etcd: error: argument --members: '0' is not a positive integer"
    ]


def test_etcd_command_killed_outright_takes_its_etcd_with_it() -> None:
    """SIGKILL to ``aelastic etcd`` (no handler of its runs): its member's guard sees it gone, stops etcd and removes
    the data; the port closes (an etcd left orphaned would answer on it for good)."""
    proc = subprocess.Popen([sys.executable, "-m", "aelastic", "etcd"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("aelastic etcd ready:"), line
        url = urlsplit(line.split()[-1])
        assert url.hostname is not None
        assert url.port is not None
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    deadline = time.monotonic() + 60  # the guard's grace is 3 s; generous on a busy machine
    while True:
        with socket.socket() as s:
            if s.connect_ex((url.hostname, url.port)) != 0:
                break
        assert time.monotonic() < deadline, "etcd still serves after its aelastic etcd was SIGKILLed"
        time.sleep(0.1)
