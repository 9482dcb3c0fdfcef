"""What a request is made of and how it can end, shared by the gateway and the talker: tasks,
languages and the one request check (vocabulary), the range of every field (request_limits),
sampling overrides and their declared ranges (sampling_overrides; the protobuf converters in
sampling_pb), the tts.v1 enum tables (tts_enums), what each model
variant accepts (model_variants), and the domain errors with their HTTP and gRPC mapping
(errors)."""
