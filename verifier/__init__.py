"""The verifier service: vLLM holding the target model (see protos/specdec/v1/verifier.proto)."""
