"""Optional TLS and mutual TLS between the services, from PEM files.

Off unless files are given. Every service takes the same flags (env fallbacks
`TTS_<SERVICE>_TLS_*`; in Kubernetes the files are mounted from a `kubernetes.io/tls` Secret):

- `--tls-cert` / `--tls-key`: this service's certificate chain and private key. A server serves
  TLS with them; a client presents them when the server asks for a client certificate.
- `--tls-ca`: the CA bundle the peers' certificates are checked against. A client verifies the
  servers with it (without it: the system's roots); a server with it requires every client to
  present a certificate it signed (mutual TLS) unless `--tls-client-auth none`.
- `--tls-server-name`: the name the servers' certificates must carry, instead of the host of the
  address dialled. The gateway reaches talker pods by IP and the talker reaches code2wav pods
  by per-pod DNS names, so one name on one certificate stands for all of them.

With TLS on, a client dials every internal service with TLS: the stack is TLS throughout or not at
all. Health checks need the same credentials (the chart's probes run `python -m qtts.serving.probe`).
Certificates are read at start-up: after a renewal, restart (roll) the pods.
"""

from __future__ import annotations

import argparse
import dataclasses
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from qtts.request.errors import InvalidArgument
from qtts.serving.service_config import EnvLookup
from qtts.serving.settings import setting

# What --tls-client-auth accepts: a server with --tls-ca requires client certificates (mutual
# TLS), or accepts any client over TLS.
CLIENT_AUTH = ("require", "none")


@dataclass(frozen=True)
class TlsConfig:
    """PEM file paths (empty: not given) and how a server treats client certificates."""

    # Help texts: {what} is what the TLS is on, {prefix} the flag prefix (qtts/serving/settings.py, group).
    cert: str = setting("", "PEM certificate chain for TLS on {what} (default: plaintext)")
    key: str = setting("", "its PEM private key")
    ca: str = setting(
        "",
        "PEM CA bundle the peers' certificates are checked against; a server with it requires "
        "client certificates it signed (mutual TLS)",
    )
    client_auth: str = setting(
        "require",
        "with --{prefix}-ca: require a client certificate (require, mutual TLS) or not (none)",
        choices=CLIENT_AUTH,
    )
    server_name: str = setting(
        "", "name the servers' certificates must carry (default: the host of each address)"
    )
    # The flag prefix these came from ("tls", "public-tls"), for error messages.
    flag: str = "tls"

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.ca)

    @property
    def mutual(self) -> bool:
        """Whether a server with this config requires client certificates."""
        return bool(self.ca) and self.client_auth == "require"

    def validate(self, *, serves: bool = True) -> TlsConfig:
        """Raise `InvalidArgument` naming the flag for a missing, unreadable or mismatched file.

        `serves`: this config is used for a listening port, so a CA (client verification) needs
        the server's own certificate."""
        f = f"--{self.flag}"
        if self.client_auth not in CLIENT_AUTH:
            raise InvalidArgument(
                f"{f}-client-auth must be one of {', '.join(CLIENT_AUTH)}, got {self.client_auth!r}"
            )
        if bool(self.cert) != bool(self.key):
            raise InvalidArgument(f"{f}-cert and {f}-key go together: give both or neither")
        if serves and self.ca and not self.cert:
            raise InvalidArgument(f"{f}-ca on a server needs {f}-cert and {f}-key (its own certificate)")
        if self.server_name and not self.enabled:
            raise InvalidArgument(f"{f}-server-name needs TLS ({f}-ca, or {f}-cert and {f}-key)")
        for name, path in (("cert", self.cert), ("key", self.key), ("ca", self.ca)):
            if path:
                _read(path, f"{f}-{name}")
        # The standard library parses the PEM and checks that the key is the certificate's.
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if self.cert:
            try:
                context.load_cert_chain(self.cert, self.key)
            except ssl.SSLError as exc:
                raise InvalidArgument(
                    f"{f}-cert {self.cert} and {f}-key {self.key} are not a certificate and its "
                    f"private key in PEM ({exc.reason or exc})"
                ) from None
        if self.ca:
            try:
                context.load_verify_locations(cafile=self.ca)
            except ssl.SSLError as exc:
                raise InvalidArgument(
                    f"{f}-ca {self.ca} holds no PEM certificate ({exc.reason or exc})"
                ) from None
        return self

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """Credentials for `add_secure_port`; None without a certificate (plaintext)."""
        if not self.cert:
            return None
        return grpc.ssl_server_credentials(
            [(_read(self.key, f"--{self.flag}-key"), _read(self.cert, f"--{self.flag}-cert"))],
            root_certificates=_read(self.ca, f"--{self.flag}-ca") if self.ca else None,
            require_client_auth=self.mutual,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """Credentials for `secure_channel`; None when TLS is off (plaintext)."""
        if not self.enabled:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, f"--{self.flag}-ca") if self.ca else None,
            private_key=_read(self.key, f"--{self.flag}-key") if self.key else None,
            certificate_chain=_read(self.cert, f"--{self.flag}-cert") if self.cert else None,
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        if self.enabled and self.server_name:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []

    def flags(self, *, server_name: bool = True) -> list[str]:
        """This config as command-line flags (the launcher passes it on to each service);
        `server_name` False for a service that only serves (it has no --tls-server-name)."""
        f = f"--{self.flag}"
        out = []
        for name, value in (("cert", self.cert), ("key", self.key), ("ca", self.ca)):
            if value:
                out += [f"{f}-{name}", value]
        if server_name and self.server_name:
            out += [f"{f}-server-name", self.server_name]
        if self.client_auth != "require":
            out += [f"{f}-client-auth", self.client_auth]
        return out


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise InvalidArgument(f"{flag} {path}: cannot read it ({exc.strerror})") from None
    if b"-----BEGIN" not in data:
        raise InvalidArgument(f"{flag} {path}: not a PEM file")
    return data


def add_tls_flags(
    p: argparse.ArgumentParser,
    env: EnvLookup,
    *,
    prefix: str = "tls",
    what: str = "gRPC between the services",
    server_name: bool = True,
) -> None:
    """--<prefix>-cert, -key, -ca, -client-auth (and -server-name) with `<PREFIX>_*` env fallbacks,
    for the launcher and the probe (the services declare TlsConfig as a settings group)."""
    env_prefix = prefix.upper().replace("-", "_")
    d = TlsConfig()
    for f in dataclasses.fields(TlsConfig):
        meta = f.metadata.get("qtts.settings")
        if meta is None or (f.name == "server_name" and not server_name):
            continue
        p.add_argument(
            f"--{prefix}-{f.name.replace('_', '-')}",
            default=env(f"{env_prefix}_{f.name.upper()}", getattr(d, f.name)),
            help=meta.help.format(what=what, prefix=prefix),
        )


def tls_from_args(ns: argparse.Namespace, prefix: str = "tls") -> TlsConfig:
    attr = prefix.replace("-", "_")
    return TlsConfig(
        cert=getattr(ns, f"{attr}_cert"),
        key=getattr(ns, f"{attr}_key"),
        ca=getattr(ns, f"{attr}_ca"),
        client_auth=getattr(ns, f"{attr}_client_auth"),
        server_name=getattr(ns, f"{attr}_server_name", ""),
        flag=prefix,
    )


def aio_channel(
    address: str,
    tls: TlsConfig | None,
    *,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
) -> grpc.aio.Channel:
    """A `grpc.aio` channel to `address`: TLS when `tls` is on, else plaintext."""
    credentials = tls.channel_credentials() if tls is not None else None
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
    return grpc.aio.secure_channel(
        address, credentials, options=[*options, *tls.channel_options()], interceptors=interceptors
    )


def sync_channel(address: str, tls: TlsConfig | None) -> grpc.Channel:
    """A blocking channel to `address` (health checks outside an event loop)."""
    credentials = tls.channel_credentials() if tls is not None else None
    if credentials is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, credentials, options=tls.channel_options())
