"""The ``etcd`` rendezvous backend's ``--rdzv-conf`` keys and settings, validated without I/O: an external etcd's
endpoints, TLS files and user, or the job's own etcd (``--rdzv-endpoint embedded[:HOST,...]``: its layout, port,
size and token), and the timing defaults of each."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final

from ...errors import ConfigurationError
from ...etcd.auth import root_password
from ...etcd.config import EtcdConfig, parse_endpoints
from ...etcd.embedded import client_config
from ...etcd.layout import DEFAULT_CLIENT_PORT, DEFAULT_SIZE, Layout, parse_embedded
from ...etcd.server import find_etcd_binary
from ...store.auth import resolve_auth_token
from ..api import RendezvousParameters
from ..settings import AUTH_TOKEN, DYNAMIC_KEYS, READ_TIMEOUT, ConfKey, TimingSettings, key_names
from ..values import RendezvousSettings

__all__ = ["DEFAULT_KEY_PREFIX", "ETCD_KEYS", "EtcdRendezvousSettings", "etcd_settings", "etcd_setup"]

DEFAULT_KEY_PREFIX: Final = "/aelastic/rendezvous"

# The job's own etcd finds a lost node in seconds by default: its members run inside the job, on the nodes' own
# network, where a beat takes milliseconds; etcd expires a node's lease (TTL: interval x attempts = 3 s) on its own
# clock, and the neighbour sees it at its next check. Torch's defaults (5 s x 3) stay for an external etcd, which
# may be a shared service further away.
JOB_ETCD_TIMING: Final = {"keep_alive_interval": 1.0, "keep_alive_max_attempt": 3, "heartbeat_timeout": 2.0}


def _with_job_etcd_default(key: ConfKey) -> ConfKey:
    default = JOB_ETCD_TIMING.get(key.name)
    if default is None:
        return key
    return replace(key, doc=f"{key.doc}; the job's own etcd (--rdzv-endpoint embedded): {default:g} by default")


ETCD_KEYS: Final = (
    *map(_with_job_etcd_default, DYNAMIC_KEYS),
    ConfKey("key_prefix", "text", DEFAULT_KEY_PREFIX, "where the rendezvous keys live in etcd; must start with '/'"),
    ConfKey("protocol", "text", "http", "http or https, for endpoints given without a scheme"),
    ConfKey("cacert", "text", None, "a CA bundle (PEM) to verify etcd's certificate", aliases=("ca_cert",)),
    ConfKey("cert", "text", None, "a client certificate (PEM), with key", aliases=("ssl_cert",)),
    ConfKey("key", "text", None, "the client certificate's private key (PEM)", aliases=("ssl_cert_key",)),
    ConfKey("username", "text", None, "etcd's user, with password"),
    ConfKey("password", "text", None, "the etcd user's password"),
    AUTH_TOKEN,
    ETCD_PORT := ConfKey(
        "etcd_port",
        "integer",
        DEFAULT_CLIENT_PORT,
        "the job's own etcd (--rdzv-endpoint embedded:...): its members' client port, 1..65534 (the peer port is the "
        "next one)",
    ),
    ETCD_MEMBERS := ConfKey(
        "etcd_members",
        "integer",
        DEFAULT_SIZE,
        "the job's own etcd: how many members it keeps, odd (the first hosts of the list start them; a lost one is "
        "replaced on another node)",
    ),
)
_ALIASES: Final = {alias: key.name for key in ETCD_KEYS for alias in key.aliases}
_TLS_KEYS: Final = ("cacert", "cert", "key", "username", "password")  # an external etcd's; the job's own has none


@dataclass(frozen=True, slots=True)
class EtcdRendezvousSettings:
    """The ``--rdzv-conf`` keys of the etcd backend besides the timing keys, validated."""

    etcd: EtcdConfig
    key_prefix: str
    read_timeout: float
    embedded: Layout | None = None  # the job's own etcd (--rdzv-endpoint embedded:...), else an external one

    @classmethod
    def from_parameters(cls, params: RendezvousParameters) -> EtcdRendezvousSettings:
        conf = params.config
        for alias, name in _ALIASES.items():
            if alias in conf and name in conf and conf[alias] != conf[name]:
                raise ConfigurationError(f"--rdzv-conf {alias} and {name} name the same setting: give one")

        def text(name: str) -> str | None:
            value = conf.get(name)
            if value is None:
                value = next((conf[a] for a, n in _ALIASES.items() if n == name and a in conf), None)
            return None if value is None else str(value)

        key_prefix = text("key_prefix") or DEFAULT_KEY_PREFIX
        if not key_prefix.startswith("/"):
            raise ConfigurationError(f"--rdzv-conf key_prefix={key_prefix!r}: must start with '/'")
        read_timeout = READ_TIMEOUT.read(params)
        hosts = parse_embedded(params.endpoint)
        if hosts is not None:
            layout = _layout(params, hosts)
            for name in _TLS_KEYS:
                if text(name) is not None:
                    raise ConfigurationError(
                        f"--rdzv-conf {name}: the job's own etcd (--rdzv-endpoint {params.endpoint!r}) speaks plain "
                        "HTTP inside the job; TLS and users are for an external etcd"
                    )
            token = resolve_auth_token(AUTH_TOKEN.read(params))
            password = None if token is None else root_password(token, params.run_id)
            return cls(client_config(layout, password), key_prefix, read_timeout, layout)
        for name in (ETCD_PORT.name, ETCD_MEMBERS.name, AUTH_TOKEN.name):
            if name in conf:
                raise ConfigurationError(
                    f"--rdzv-conf {name}: only for the job's own etcd (--rdzv-endpoint embedded); an external etcd "
                    "takes username and password"
                )
        endpoints = parse_endpoints(params.endpoint or "localhost", protocol=text("protocol") or "http")
        config = EtcdConfig(
            endpoints, ca_cert=text("cacert"), cert=text("cert"), key=text("key"),
            username=text("username"), password=text("password"),
        )  # fmt: skip
        return cls(config, key_prefix, read_timeout)


def _layout(params: RendezvousParameters, hosts: tuple[str, ...]) -> Layout:
    """The job's own etcd that ``--rdzv-endpoint embedded:...`` and its keys describe; the etcd binary found."""
    if not hosts:
        raise ConfigurationError(
            f"--rdzv-endpoint {params.endpoint!r}: name the job's hosts, the same list on every node "
            "(embedded:HOST,HOST,...; under Slurm, srun fills in the step's nodes)"
        )
    find_etcd_binary()  # a node without it could neither start nor replace a member: refused now, in one line
    port = ETCD_PORT.read(params)
    return Layout(hosts, port, ETCD_MEMBERS.read(params), token=f"aelastic-{params.run_id}")


def etcd_setup(params: RendezvousParameters) -> tuple[TimingSettings, EtcdRendezvousSettings]:
    """The etcd backend's timing and connection settings, validated without I/O."""
    params.warn_unknown(key_names(ETCD_KEYS))
    settings = EtcdRendezvousSettings.from_parameters(params)
    defaults = JOB_ETCD_TIMING if settings.embedded is not None else None
    return TimingSettings.from_parameters(params, defaults), settings


def etcd_settings(params: RendezvousParameters) -> RendezvousSettings:
    """The protocol settings the nodes of ``params`` derive (node counts, windows)."""
    return etcd_setup(params)[0].rendezvous
