"""torch's legacy etcd rendezvous URL (the seed's configuration, issue 14 item 8):
``etcd://host:port/job_id?min_workers=1&max_workers=3&timeout=..&last_call_timeout=..&etcd_prefix=..`` mapped onto
the v3 etcd backend, from Python and as ``--rdzv-endpoint`` with ``--rdzv-backend etcd``, against a real etcd."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import pytest

from aelastic.errors import ConfigurationError
from aelastic.etcd import EtcdConfig, open_etcd_client, parse_endpoints
from aelastic.rendezvous import RendezvousParameters
from aelastic.rendezvous.registry import check_parameters

TESTS = Path(__file__).parent
SEED_URL = "etcd://localhost:2379/1234?min_workers=1&max_workers=3&timeout=600&last_call_timeout=30&etcd_prefix=/te/p2p"


def test_the_seeds_url_maps_onto_the_v3_backend() -> None:
    params = RendezvousParameters.from_url(SEED_URL)
    assert (params.backend, params.endpoint, params.run_id) == ("etcd", "localhost:2379", "1234")
    assert (params.min_nodes, params.max_nodes) == (1, 3)
    assert dict(params.config) == {"join_timeout": "600", "last_call_timeout": "30", "key_prefix": "/te/p2p"}
    check_parameters(params)  # every key is one the etcd backend knows, every value valid


def test_defaults_port_2379_and_max_workers_min_workers() -> None:
    params = RendezvousParameters.from_url("etcd://etcd.cluster/job-7?min_workers=2&protocol=https")
    assert (params.endpoint, params.run_id, params.min_nodes, params.max_nodes) == ("etcd.cluster:2379", "job-7", 2, 2)
    assert dict(params.config) == {"protocol": "https"}


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("http://h:2379/job?min_workers=1", "must start with etcd://"),
        ("etcd://h:2379/?min_workers=1", "etcd://HOST[:PORT]/JOB_ID"),
        ("etcd://h:port/job?min_workers=1", "port must be an integer"),
        ("etcd://h:2379/job", "min_workers must be an integer >= 1"),
        ("etcd://h:2379/job?min_workers=0", "min_workers must be an integer >= 1"),
        ("etcd://h:2379/job?min_workers=1&max_workers=x", "max_workers must be an integer >= 1"),
        ("etcd://h:2379/job?min_workers=1&min_workers=2", "each query key once"),
        ("etcd://h:2379/job?min_workers=1&timeout=", "each query key once, each with a value"),
    ],
)
def test_a_bad_url_is_one_configuration_error_naming_it_and_the_rule(url: str, rule: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        RendezvousParameters.from_url(url)
    message = str(caught.value)
    assert "\n" not in message
    assert repr(url) in message
    assert rule in message


def test_the_url_as_rdzv_endpoint_runs_a_job_on_etcd_under_its_prefix(etcd_endpoint: str, tmp_path: Path) -> None:
    parts = urlsplit(etcd_endpoint)
    prefix, job = f"/legacy-{uuid.uuid4().hex[:8]}", f"job-{uuid.uuid4().hex[:8]}"
    url = (
        f"etcd://{parts.hostname}:{parts.port}/{job}?min_workers=1&max_workers=1&timeout=60&last_call_timeout=1"
        f"&etcd_prefix={prefix}"
    )
    result = subprocess.run(
        [sys.executable, "-m", "aelastic", "run", "--rdzv-backend", "etcd", "--rdzv-endpoint", url,
         str(TESTS / "cli_probe.py")],
        env={"PATH": "/usr/bin:/bin", "PROBE_OUT": str(tmp_path)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert record["env"]["TORCHELASTIC_RUN_ID"] == job
    assert record["env"]["WORLD_SIZE"] == "1"

    async def state_written() -> bool:
        async with open_etcd_client(EtcdConfig(parse_endpoints(etcd_endpoint))) as client:
            value, _ = await client.get(f"{prefix}/{job}/state".encode())
            return value is not None

    assert anyio.run(state_written)  # the rendezvous ran on etcd, under the URL's etcd_prefix


def test_the_url_with_another_backend_or_a_different_run_id_is_refused() -> None:
    for flags, expected in [
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", SEED_URL], "needs --rdzv-backend etcd"),
        (["--rdzv-backend", "etcd", "--rdzv-endpoint", SEED_URL, "--rdzv-id", "other"], "names the run '1234'"),
    ]:
        result = subprocess.run(
            [sys.executable, "-m", "aelastic", "run", *flags, str(TESTS / "cli_probe.py")],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert expected in result.stderr
