"""What every service process runs on: the asyncio gRPC server with health and drain (grpc_server),
its error-mapping interceptor (error_mapping) and the process set-up around it (process), settings
declared once and the fields every service shares (settings, service_config), TLS and the internal
token between the services (tls, internal_auth), request ids in logs, traces and Prometheus metrics
(log_context, tracing, metrics), the exit of a stage whose device failed (device_failure) and the
health-check command of the probes (probe)."""
