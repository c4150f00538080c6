"""The drafter service: proposes candidate token blocks over gRPC (see protos/specdec/v1/drafter.proto)."""
