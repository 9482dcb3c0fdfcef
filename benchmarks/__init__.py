"""Load generator and metrics for the streaming TTS gateway (HTTP and gRPC).

`python -m benchmarks.client --help` (or the `tts-bench` console script) runs a benchmark
(its flags and their validation in `client_config`, the recorded conditions in `client_conditions`);
`metrics` holds the pure calculations (underrun, percentiles, aggregates), `loadgen` the closed- and
open-loop drivers, `transport` the HTTP/gRPC request recorders and `report` the JSON/Markdown/PNG
writers.
"""
