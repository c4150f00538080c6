"""specdec: decoupled speculative decoding over gRPC.

Shared core used by the three services (drafter/, verifier/, gateway/):
wire stubs (`specdec.wire`), sampling and acceptance math (`specdec.acceptance`),
configuration (`specdec.config`), model loading (`specdec.models`) and
telemetry (`specdec.telemetry`).
"""

__version__ = "0.1.0"
