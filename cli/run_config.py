"""How ``elastic run``'s options become the launch: the table from each option to its
``LaunchConfig`` fields (``OPTIONS``), the options that decide together (the rendezvous,
the entrypoint), the ones rejected, and ``build_config``, which makes the launch, its
entrypoint and the backend's factory before anything starts.

May import the CLI's ``entrypoint`` and ``options``; outside the CLI, ``core.launch``,
``core.rendezvous`` (the registry, the fingerprint rules) and ``core.workers`` (NUMA).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import click
from elastic.cli.entrypoint import check_script, entrypoint_for, fingerprint_for
from elastic.cli.options import (
    bad,
    parse_endpoint,
    parse_local_ranks_filter,
    parse_nnodes,
    parse_nproc_per_node,
    parse_rdzv_conf,
    parse_signals,
    parse_std,
)
from elastic.core.launch.config import LaunchConfig, SettingError
from elastic.core.rendezvous.fingerprint import parse_allowed
from elastic.core.workers import numa

if TYPE_CHECKING:
    from elastic.core.rendezvous.registry import HandlerFactory

log = logging.getLogger("elastic")

OMP_WARNING = (
    "\n*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, "
    "to avoid your system being overloaded, please further tune the variable for optimal "
    "performance in your application as needed. \n"
    "*****************************************"
)


def option_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def split_filters(value: str) -> tuple[str, ...]:
    return tuple(f for f in value.split(",") if f)


def shutdown_timeout(value: float | None) -> float:
    """torch's default: ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` or 30 seconds."""
    return float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")) if value is None else value


class To(NamedTuple):
    """Where an option's value goes: these ``LaunchConfig`` fields, as ``parse`` makes it
    (None: as click gives it; a parser for several fields returns one value for each)."""

    fields: tuple[str, ...]
    parse: Callable[[Any], Any] | None = None


def to(*fields: str, parse: Callable[[Any], Any] | None = None) -> To:
    return To(fields, parse)


# The options that map one to one onto the launch, by click's dest. Those whose values
# decide together are resolved below: the rendezvous (RENDEZVOUS_OPTIONS), the entrypoint
# and its fingerprint (ENTRYPOINT_OPTIONS), and the two torchrun options we reject.
OPTIONS: dict[str, To] = {
    "nnodes": to("min_nodes", "max_nodes", parse=parse_nnodes),
    "nproc_per_node": to("nproc_per_node", parse=parse_nproc_per_node),
    "rdzv_id": to("run_id"),
    "role": to("role"),
    "max_restarts": to("max_restarts"),
    "monitor_interval": to("monitor_interval"),
    "start_method": to("start_method"),
    "log_dir": to("log_dir"),
    "redirects": to("redirects", parse=lambda value: parse_std(value, "--redirects")),
    "tee": to("tee", parse=lambda value: parse_std(value, "--tee")),
    "local_ranks_filter": to("local_ranks_filter", parse=parse_local_ranks_filter),
    "local_addr": to("local_addr"),
    "signals_to_handle": to("signals_to_handle", parse=parse_signals),
    "shutdown_timeout": to("shutdown_timeout", parse=shutdown_timeout),
    "virtual_local_rank": to("virtual_local_rank"),
    "duplicate_stdout_filters": to("duplicate_stdout_filters", parse=split_filters),
    "duplicate_stderr_filters": to("duplicate_stderr_filters", parse=split_filters),
    "stall_timeout": to("stall_timeout"),
    "health_port": to("health_port"),
    "preemption_signal": to("preemption_signal"),
    "preemption_grace": to("preemption_grace"),
    "quiet": to("quiet"),
    "event_log_handler": to("event_log_handler"),
    "numa_binding": to("numa_binding"),
    "warm_restarts": to("warm_restarts"),
}
RENDEZVOUS_OPTIONS = (
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_conf",
    "standalone",
    "master_addr",
    "master_port",
    "node_rank",
)
ENTRYPOINT_OPTIONS = ("module", "no_python", "run_path", "training_script", "training_script_args")
REJECTED_OPTIONS = ("logs_specs", "log_line_prefix_template")
COMMAND_OPTIONS = ("dry_run", "print_completion")  # about the command itself, not the launch


def mapped_fields(opts: dict[str, Any]) -> dict[str, Any]:
    """The ``OPTIONS`` part of the launch, each value parsed under its option's name."""
    values: dict[str, Any] = {}
    for dest, target in OPTIONS.items():
        value = opts[dest]
        if target.parse is not None:
            try:
                value = target.parse(value)
            except click.BadParameter as exc:
                raise bad(option_name(dest), exc.message) from None
        values.update(
            zip(target.fields, value if len(target.fields) > 1 else (value,), strict=True)
        )
    return values


def option_for(field: str) -> str:
    """The option that sets a ``LaunchConfig`` field, to name it in an error."""
    dest = next((d for d, target in OPTIONS.items() if field in target.fields), field)
    return option_name(dest)


def resolve_rendezvous(opts: dict[str, Any], max_nodes: int) -> dict[str, Any]:
    """The rendezvous fields as torchrun would pick them: standalone, the backend and
    endpoint, its settings, the fingerprint fields it may ignore and the node rank."""
    try:
        conf = parse_rdzv_conf(opts["rdzv_conf"])
    except click.BadParameter as exc:
        raise bad("--rdzv-conf", exc.message) from None
    try:
        allow_mismatch = parse_allowed(conf.pop("allow_mismatch", None))
    except ValueError as exc:
        raise bad("--rdzv-conf", str(exc)) from None
    backend, endpoint, standalone = opts["rdzv_backend"], opts["rdzv_endpoint"], False
    if opts["standalone"]:
        if max_nodes != 1:
            raise bad("--standalone", f"runs one node, but --nnodes={opts['nnodes']}")
        standalone = True
    elif backend == "static":
        if not endpoint and opts["master_port"] is None and max_nodes == 1:
            # torchrun switches a lone node with nothing configured to a local rendezvous.
            standalone = True
        elif not endpoint:
            port = 29500 if opts["master_port"] is None else opts["master_port"]
            endpoint = f"{opts['master_addr']}:{port}"
    if endpoint and not standalone:  # a standalone launch has none (LaunchConfig)
        try:  # several, comma-separated: etcd's members, c10d's candidate store hosts
            for one in endpoint.split(","):
                parse_endpoint(one.strip(), None)
        except click.BadParameter as exc:
            raise bad("--rdzv-endpoint", exc.message) from None
    static_rank = backend == "static" and not standalone  # the rank static needs
    return {
        "standalone": standalone,
        "rdzv_backend": backend,
        "rdzv_endpoint": endpoint,
        "rdzv_configs": conf,
        "allow_mismatch": allow_mismatch,
        "node_rank": opts["node_rank"] if static_rank or opts["node_rank"] else None,
    }


def check_rejected(opts: dict[str, Any]) -> None:
    if opts["logs_specs"] not in (None, "", "default"):
        raise bad("--logs-specs", f"{opts['logs_specs']!r}: only the default log layout exists")
    if opts["log_line_prefix_template"]:
        raise bad("--log-line-prefix-template", "a template for worker lines is not provided")


def check_numa_binding(mode: str | None, nproc: int) -> None:
    """Compute the binding now, so what this node lacks for it is one line before any
    worker starts (the agent binds each worker as it starts it)."""
    if mode:
        try:
            numa.plan(mode, nproc)
        except numa.NumaBindingError as exc:
            raise bad("--numa-binding", f"{mode}: {exc}") from None


def build_config(
    opts: dict[str, Any], plugin_options: dict[str, Any] | None = None
) -> tuple[LaunchConfig, Any, tuple[str, ...], HandlerFactory | None]:
    """The launch, its entrypoint and arguments, and the backend's factory (resolved once
    here, so a bad name fails before anything starts, and reused by the launcher)."""
    fields = mapped_fields(opts)
    fields.update(resolve_rendezvous(opts, fields["max_nodes"]))
    check_script(opts)
    entrypoint, args = entrypoint_for(opts)
    check_rejected(opts)
    check_numa_binding(fields["numa_binding"], fields["nproc_per_node"])
    if not fields["standalone"]:  # one node: nobody to compare it with
        nproc, restarts = fields["nproc_per_node"], fields["max_restarts"]
        fields["fingerprint"] = fingerprint_for(opts, nproc, restarts)
    omp = "OMP_NUM_THREADS" not in os.environ and fields["nproc_per_node"] > 1
    fields["extra_env"] = {"OMP_NUM_THREADS": "1"} if omp else {}
    try:
        config = LaunchConfig(**fields, plugin_options=dict(plugin_options or {}))
    except SettingError as exc:
        raise bad(option_for(exc.field), exc.reason) from None
    if config.preemption_signal not in config.signals_to_handle:
        # the notice must reach the agent, not kill it
        config.signals_to_handle = (*config.signals_to_handle, config.preemption_signal)
    factory = None
    if not config.standalone:
        from elastic.core.rendezvous.registry import BackendNotFoundError, get_backend_factory

        try:
            factory = get_backend_factory(config.rdzv_backend)
        except BackendNotFoundError as exc:
            raise bad("--rdzv-backend", str(exc)) from None
    if omp:
        log.warning(OMP_WARNING)
    return config, entrypoint, args, factory
