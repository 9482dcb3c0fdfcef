"""What every service process runs on: the asyncio gRPC server with health, drain and error
mapping (grpc_server), settings declared once and the fields every service shares (settings,
service_config), TLS and the internal token between the services (tls, internal_auth), request
ids in logs, traces and Prometheus metrics (log_context, tracing, metrics), the exit of a stage
whose device failed (device_failure) and the health-check command of the probes (probe)."""
