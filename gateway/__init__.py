"""The gateway service: runs each request's draft/verify rounds (see protos/specdec/v1/gateway.proto)."""
