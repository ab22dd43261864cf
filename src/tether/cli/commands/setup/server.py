"""`tether server`: the agent server, started from its options and config file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tether.cli.commands.setup.settings import DbOpt, _first_admin_hint, _settings
from tether.cli.common import console, fail, server_app


def _set_options(pairs: list[str]) -> dict[str, str]:
    """`--set KEY=VALUE` options as settings (validated with the rest by `ServerSettings`)."""
    values: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            fail(f"--set {pair!r}: write it KEY=VALUE, e.g. --set idle_timeout=5")
        values[key.strip()] = value.strip()
    return values


def _config_data(config: Path | None) -> tuple[Path, dict[str, object]]:
    """The config file (`config`, else the default one) and its top-level mapping; {} when there is none."""
    from tether.agent.llm.settings import default_config_path

    file = config.expanduser() if config is not None else default_config_path()
    if not file.is_file():
        return file, {}
    import yaml

    from tether import yaml12

    try:
        data = yaml12.safe_load(file.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        fail(f"cannot read config file {file}: {exc.strerror or exc}")
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        fail(f"config file {file} is not valid YAML: {yaml12.where_and_why(exc)}")
    return file, data if isinstance(data, dict) else {}


def _config_webhooks(config: Path | None) -> list[dict[str, object]]:
    """The `webhooks:` list of the config file (`config`, else the default one when it exists); [] without."""
    file, data = _config_data(config)
    hooks = data.get("webhooks")
    if hooks is None:
        return []
    if not isinstance(hooks, list) or not all(isinstance(h, dict) for h in hooks):
        fail(f"config file {file}: webhooks: must be a list of entries with url, secret, format, events")
    return hooks


def _config_oidc(config: Path | None) -> object:
    """The `oidc:` section of the config file (one issuer or a list; docs/oidc.md); None without."""
    file, data = _config_data(config)
    issuers = data.get("oidc")
    if issuers is not None and not (isinstance(issuers, dict) or (
            isinstance(issuers, list) and all(isinstance(i, dict) for i in issuers))):
        fail(f"config file {file}: oidc: must be an issuer (issuer, grants, ...) or a list of them (docs/oidc.md)")
    return issuers or None


@server_app.callback(invoke_without_command=True)
def server(ctx: typer.Context, config: Annotated[Path | None, typer.Option(
               "--config", "-c", metavar="FILE", help="the config file whose llm: section plans tasks "
                                                       "(default $TETHER_CONFIG or ~/.config/tether/config.yaml)")
           ] = None,
           host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
           port: Annotated[int, typer.Option(help="port")] = 8765, db: DbOpt = None,
           tls_cert: Annotated[Path | None, typer.Option(
               "--tls-cert", help="PEM certificate (chain): serve HTTPS and wss")] = None,
           tls_key: Annotated[Path | None, typer.Option("--tls-key", help="PEM private key of --tls-cert")] = None,
           heartbeat_interval: Annotated[float | None, typer.Option(help="seconds")] = None,
           heartbeat_timeout: Annotated[float | None, typer.Option(help="seconds")] = None,
           grace_period: Annotated[float | None, typer.Option(help="seconds a dropped device's batches wait")] = None,
           allow_insecure: Annotated[bool, typer.Option(help="allow plain HTTP off loopback")] = False,
           allowed_host: Annotated[list[str] | None, typer.Option(
               "--allowed-host", help="a host name clients may use (Host and Origin headers) besides localhost, "
                                      "127.0.0.1, [::1] and the bind address; '*.example.com' for subdomains "
                                      "(repeat)")] = None,
           max_body_bytes: Annotated[int | None, typer.Option(
               help="largest request body accepted with a valid API token (default 4 MiB)")] = None,
           max_response_bytes: Annotated[int | None, typer.Option(
               help="largest REST answer with a batch's results (default 32 MiB); past it the largest results "
                    "become too-large failures")] = None,
           pairing: Annotated[bool, typer.Option(
               "--pairing/--no-pairing", help="let devices without a token ask to pair (an admin approves each)")
           ] = True,
           four_eyes: Annotated[bool, typer.Option(
               "--four-eyes", help="approvals need a second person: the token that asked for an action may not "
                                   "approve it (docs/security/approvals.md)")] = False,
           cluster: Annotated[str | None, typer.Option(
               "--cluster", metavar="REDIS_URL", envvar="TETHER_CLUSTER",
               help="run as one node of a cluster on this Redis (redis://HOST:PORT/DB), sharing --db (a "
                    "postgresql:// URL) with the other nodes; see docs/scaling.md")] = None,
           node_id: Annotated[str | None, typer.Option(
               "--node-id", metavar="NAME", help="this node's name in the cluster (default: host name and a "
                                                 "digest of the state directory and database)")] = None,
           allowed_origin: Annotated[list[str] | None, typer.Option(
               "--allowed-origin", metavar="URL", help="a browser origin (scheme://host[:port]) allowed to call "
                                                       "the server besides its own (repeat)")] = None,
           setting: Annotated[list[str] | None, typer.Option(
               "--set", metavar="KEY=VALUE", help="any other server setting, e.g. idle_timeout=5, "
                                                  "max_sockets_per_address=5000 (repeat; docs/security/edge.md)")
           ] = None,
           log_level: Annotated[str, typer.Option(metavar="debug|info|warning|error",
                                                  help="server log detail")] = "info") -> None:
    """Start the agent server (AIP WebSocket endpoint /aip and the REST API under /api/v1)."""
    if ctx.invoked_subcommand:
        return
    from functools import partial

    from tether.agent.llm.settings import resolve_llm_settings
    from tether.agent.server_app import create_agent_app
    from tether.server.main import PortInUse, UnsafeBinding, claim_state, run_server
    from tether.server.store import check_state_dir

    if log_level not in ("debug", "info", "warning", "error"):  # before the state is claimed (tether device's words)
        fail(f"--log-level must be debug, info, warning or error, not {log_level!r}")
    if bool(tls_cert) != bool(tls_key):
        fail("--tls-cert and --tls-key go together")
    named: dict[str, object] = dict(
        host=host, port=port, db_path=db, tls_cert=str(tls_cert) if tls_cert else None,
        tls_key=str(tls_key) if tls_key else None, heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout, grace_period=grace_period, allowed_hosts=allowed_host or None,
        max_body_bytes=max_body_bytes, max_response_bytes=max_response_bytes, pairing=pairing, cluster_url=cluster,
        node_id=node_id, allowed_origins=allowed_origin or None, four_eyes=four_eyes or None)
    for key, value in _set_options(setting or []).items():
        if named.get(key) is not None:
            fail(f"--set {key}: give it with its own option (tether server --help)")
        named[key] = value
    named["webhooks"] = _config_webhooks(config) or None  # the config file's webhooks: (docs/approvals.md)
    named["oidc"] = _config_oidc(config)  # the config file's OpenID Connect issuers (docs/oidc.md)
    settings = _settings(**named)
    if settings.cluster_url:
        try:
            import redis  # noqa: F401 - only to say clearly that it is missing
        except ImportError:
            fail("--cluster needs the redis package: pip install 'tether[cluster]'")
    try:  # one server per state: its lease, then its port, before anything is read or written
        claim = claim_state(settings)  # another server holds it: StateBusy, one line (tether.cli.main), exit 2
    except PortInUse as exc:
        fail(str(exc))
    check_state_dir(settings.db_target)  # a full or read-only state directory: one line (tether.cli.main), exit 2
    _first_admin_hint(settings.db_target, db)
    if tls_cert:
        _print_cert_fingerprint(tls_cert)
    try:
        llm = resolve_llm_settings(config)
    except ValueError as exc:
        fail(str(exc))
    console(err=True).print(f"planning with {llm.model} at {llm.base_url}" if llm else
                            "no LLM configured (TETHER_LLM_BASE_URL, TETHER_LLM_MODEL or the config file's llm: "
                            "section): tasks need a plan", markup=False)
    try:
        run_server(settings, allow_insecure=allow_insecure, log_level=log_level,
                   app_factory=partial(create_agent_app, llm_settings=llm), claim=claim)
    except UnsafeBinding as exc:
        fail(str(exc))


def _print_cert_fingerprint(cert: Path) -> None:
    """The certificate's SHA-256, for devices that pin it (--tls-fingerprint) or trust it on first use."""
    import ssl

    from tether.device.link.trust.tls_pin import cert_fingerprint

    try:
        der = ssl.PEM_cert_to_DER_cert(cert.read_text(encoding="ascii"))
    except (OSError, ValueError) as exc:
        fail(f"cannot read the TLS certificate {cert}: {exc}")
    console(err=True).print(f"TLS certificate SHA-256 fingerprint: {cert_fingerprint(der)}", soft_wrap=True)
