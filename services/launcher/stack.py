"""`start_stack`: every service started and SERVING, or none left running; `Stack`: the running
services, in start order."""

from __future__ import annotations

import threading

from qtts.tiny_model import ensure_tiny_snapshot
from services.launcher.config import StackConfig
from services.launcher.ports import ports_in_use
from services.launcher.processes import (
    ServiceProcess,
    StartupError,
    start_service,
    stop_services,
    wait_serving,
)
from services.launcher.specs import stack_specs


class Stack:
    """The running services, in start order."""

    def __init__(self, config: StackConfig, model: str, processes: list[ServiceProcess]):
        self.config = config
        self.model = model
        self.processes = processes

    def __getitem__(self, name: str) -> ServiceProcess:
        for proc in self.processes:
            if proc.name == name:
                return proc
        raise KeyError(name)

    @property
    def http_url(self) -> str:
        return f"http://{self.config.host}:{self.config.http_port}"

    @property
    def http_urls(self) -> list[str]:
        """Every gateway's HTTP base URL, the first one first."""
        return [
            f"http://{self.config.host}:{self.config.gateway_ports(i)[0]}"
            for i in range(self.config.gateway_replicas)
        ]

    @property
    def grpc_address(self) -> str:
        return self.config.address(self.config.grpc_port)

    def restart(self, name: str, grace: float = 10.0) -> ServiceProcess:
        """Stop one service and start it again with the same flags; waits until SERVING."""
        old = self[name]
        old.stop(grace)
        new = start_service(old.spec, self.config.log_dir, orphan_grace_s=self.config.drain_seconds + 5.0)
        self.processes[self.processes.index(old)] = new
        wait_serving(new, self.config.startup_timeout_s)
        return new

    def stop(self, grace: float = 10.0) -> dict[str, int]:
        """SIGTERM to every service (front first, so streams drain downstream), SIGKILL after grace."""
        return stop_services(self.processes, grace)


def start_stack(
    config: StackConfig, env: dict[str, str] | None = None, stop: threading.Event | None = None
) -> Stack:
    """Start every service and wait until all are SERVING; on failure stop them and raise StartupError
    (StartupInterrupted once `stop` is set: services still loading exit at once on SIGTERM)."""
    config.validate()
    taken = ports_in_use(config.host, config.ports())
    if taken:
        raise StartupError(
            "ports already in use on "
            + config.host
            + ": "
            + ", ".join(f"{port} ({name})" for name, port in taken.items())
            + "; is an earlier stack still running? Stop it, or start this one on other ports"
        )
    model = config.model or str(ensure_tiny_snapshot())
    specs = stack_specs(config, model)
    processes: list[ServiceProcess] = []
    grace = config.drain_seconds + 5.0
    try:
        for spec in specs:
            processes.append(start_service(spec, config.log_dir, env, orphan_grace_s=grace))
        for proc in processes:
            wait_serving(proc, config.startup_timeout_s, stop)
    except BaseException:
        stop_services(processes, grace=5.0)
        raise
    return Stack(config, model, processes)
