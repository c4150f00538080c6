"""Migration: a generation whose verifier goes away resumes on a serving one.

When the verifier of a running generation goes away (its call ends with a MIGRATE_ON code: it
died, hung past its keepalive or verdict_timeout_s, or is draining), the gateway resumes the
generation on a serving verifier (another replica, or the same one once it serves again) from
the prompt plus the tokens already streamed: the client's stream goes on with no gap and no
duplicate, and the generation's SpecStats goes on counting (`SpecStats.migrated` counts the
move). At most MAX_MIGRATIONS moves per generation; any other verifier error ends the call
with its status code.
"""

from __future__ import annotations

import grpc

from gateway.plan import Plan
from specdec.wire import pb

# The most times one generation moves to another verifier, and the verifier errors that move it:
# UNAVAILABLE (it died, hung past keepalive, or drains) and INTERNAL (its process went away with
# the stream open: RST_STREAM).
MAX_MIGRATIONS = 3
MIGRATE_ON = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)


def migrates(code: grpc.StatusCode, migrations: int) -> bool:
    """A verifier error with `code` moves the generation (after `migrations` moves so far)."""
    return code in MIGRATE_ON and migrations < MAX_MIGRATIONS


def resumed_plan(plan: Plan, streamed: list[int], migration: int) -> Plan:
    """The plan that resumes `plan` after `streamed` tokens reached the client: the prompt and
    those tokens as the new prompt, the budgets (max_tokens, min_tokens) what is left, the
    request id `<id>-m<migration>` (the verifier may still hold the old one)."""
    sampling = pb.SamplingParams()
    sampling.CopyFrom(plan.sampling)
    sampling.max_tokens = plan.sampling.max_tokens - len(streamed)
    sampling.min_tokens = max(0, plan.sampling.min_tokens - len(streamed))
    return Plan(
        f"{plan.request_id}-m{migration}",
        plan.prompt_token_ids + streamed,
        sampling,
        plan.gamma,
        plan.drafter,
        plan.tenant,
    )
