"""The drafter's memory for its sessions' keys/values: a budget, what each session reserves of
it, and the default budget from the memory this process may use.

Every live model session holds the draft model's keys/values of its whole context. Without a
bound a drafter took up to `max_sessions` (256) sessions whatever their prompts, and a queue of
long prompts ran it out of memory: the qwen-coder draft (Qwen2.5-0.5B: 24 layers x keys and
values x 2 KV heads x 64 dims x 4 bytes) holds 24 KiB a token, a 3,000-token prompt 72 MiB (78
as its cache grew, up to half again in spare slots), and 80 such prompts at once had the drafter
killed at the 6 GiB limit of the shipped manifests' pod with 64 prefilled: every request it
drafted for falls back to plain decoding (`python -m benchmarks.drafter_memory`;
docs/performance.md, "The drafter's memory").

Terms:
    token bytes  one token's keys and values in every layer of the draft model, measured on the
                 loaded model at start-up (`token_bytes`: any model, dtype and device)
    reserve      a model session's slots (`reserve_slots`): its prompt, the tokens it may
                 generate up to DECODE_RESERVE (SamplingParams.max_tokens; unset: DECODE_RESERVE),
                 and its window (gamma + lookahead) and one; its cache allocates them at once
                 (drafter.kvcache), and their bytes are reserved of the budget before its
                 prefill starts. A context that grew while it waited for admission (its target
                 decoded meanwhile: a queued prompt, a preempted session) is reserved as a prompt
                 of its length would be (`admitted_slots`)
    held         per admitted session, the larger of its reserve and the bytes its cache holds
                 (a commit that lands while the worker steps the session can add tokens its
                 reserve was not grown for: they are counted until the next step's growth)
    growth       a session whose next step would hold more tokens than its reserve (a generation
                 past its 512 reserved tokens) first grows its reserve by DECODE_RESERVE more slots
                 (`grown_slots`, at most its cap: prompt + max_tokens + window + 1), if they fit
                 beside what the others hold; its cache's next buffer has exactly that many
                 slots. If they do not fit, the newest admitted sessions make room, newest
                 first, until they do (the session itself, if it is the newest), as vLLM's
                 scheduler preempts its newest request. Each is preempted (DraftWorker._preempt)
                 when its caller accepts that (DraftOpen.accepts_preemption) and what it must
                 reserve to come back fits the budget at all: its keys/values go to the prefix
                 cache, its request decodes plainly meanwhile, and it waits for admission again,
                 ahead of the prompts that came after it. Otherwise it is ended: its stream gets
                 RESOURCE_EXHAUSTED naming the setting, and its gateway decodes the rest of that
                 request plainly. Growth comes before a waiting prompt's admission (the worker
                 grows the sessions, in arrival order, before it admits). Before, a session grew
                 past its reserve unbudgeted (half again of its cache each time), and long
                 generations ran a drafter that had admitted a full budget of prompts out of
                 memory
    budget       bytes the admitted sessions may hold (DrafterConfig.kv_cache_mib): the oldest
                 waiting prompt starts its prefill only when held + its reserve fits, and the
                 prompts behind it wait, in arrival order (the order the drafter prefills in);
                 a prompt whose reserve alone is over the budget is refused at `open` with
                 RESOURCE_EXHAUSTED naming the setting, and its gateway decodes it plainly. The
                 sessions that wait hear so about once a second (DraftProgress.waiting_for_memory),
                 so their gateways keep them (up to drafter_prefill_timeout_s after the target's
                 first token) while their requests decode plainly, and they speculate once
                 admitted and prefilled (before, a waiting session sent nothing, and its gateway
                 dropped it at drafter_timeout_s: its request never speculated)
    auto         the default budget (kv_cache_mib 0), `auto_budget`: on CUDA, AUTO_SHARE of the
                 device memory free once the model is loaded; on the CPU, AUTO_SHARE_CGROUP of the
                 memory limit of this process's cgroup (a Kubernetes pod's or a container's
                 memory limit) less what the process holds once loaded; with no limit, a
                 quarter of the host's memory (the drafter shares the host with a verifier).
                 The prefix cache's budget (prefix_cache_mib) comes out of either.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

# Generated tokens a session reserves slots for at most: a request's max_tokens is often the
# context's limit (vLLM's default), and few generations come near it; one that passes its
# reserve grows its cache and is counted at its size.
DECODE_RESERVE = 512
# Share of the memory found free (CUDA) that the budget may take: the rest is the forward's
# activations and the caching allocator's slack.
AUTO_SHARE = 0.85
# Share of a cgroup's memory limit (the CPU) that what the loaded process holds, the budget and
# the prefix cache's budget may take together: the rest is the batched forwards' workspace and
# what glibc's heap keeps of it, which is not the sessions' keys/values. Measured: 36 sessions of
# 3,000 tokens catching up 300-token commits peaked 1.2 GiB over their start with a forward's
# bounds (drafter.batch, drafter.rows), and 0.6-1.1 GiB stayed in the heap (`python -m
# benchmarks.forward_memory`); at 0.85 the drafter was killed in the shipped 6 GiB pod when its
# queued prompts' requests generated (`python -m benchmarks.drafter_memory --generate 1536
# --start-after 420 --prompts 44`).
AUTO_SHARE_CGROUP = 0.6
# Least auto budget: room for a few prompts even where the limit leaves less (its log line says so).
MIN_AUTO_BYTES = 256 << 20
# A cgroup limit at or above this is no limit (cgroup v1 writes 2^63 rounded to pages).
_NO_LIMIT = 1 << 60


def reserve_slots(prompt_len: int, max_tokens: int | None, window: int) -> int:
    """A session's reserve, in tokens (module's terms)."""
    decode = DECODE_RESERVE if max_tokens is None or max_tokens <= 0 else min(max_tokens, DECODE_RESERVE)
    return prompt_len + decode + window + 1


def cap_slots(prompt_len: int, max_tokens: int | None, window: int) -> int:
    """The most slots a session can ever hold: its prompt, every token it may generate and its
    window, and one (0: no cap, max_tokens unset)."""
    return 0 if max_tokens is None or max_tokens <= 0 else prompt_len + max_tokens + window + 1


def grown_slots(reserve: int, wanted: int, cap: int) -> int:
    """A session's reserve grown to hold `wanted` slots (module's terms: DECODE_RESERVE more at
    least, at most `cap`, 0: no cap; never under `wanted`)."""
    grown = max(wanted, reserve + DECODE_RESERVE)
    return max(wanted, min(grown, cap)) if cap > 0 else grown


def admitted_slots(reserve: int, wanted: int, cap: int, most: int = 0) -> int:
    """A session's reserve as it is admitted with `wanted` slots (its context and window): at
    least DECODE_RESERVE + 1 more, as a prompt reserves (module's terms), and never under
    `reserve`; at most `cap` (0: no cap) and `most` (the budget's slots; 0: no budget), never
    under `wanted`. A context that grew while it waited (its target decoded meanwhile: a queued
    prompt, a preempted session coming back) is admitted with room for what it generates next,
    not only for what it holds: admitted without it, it would grow at its next step, and when that
    growth does not fit, the newest admitted session, itself, is preempted again."""
    ahead = wanted + 1 + DECODE_RESERVE
    for bound in (cap, most):
        if bound > 0:
            ahead = min(ahead, bound)
    return max(reserve, wanted, ahead)


def token_bytes(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """One token's keys and values in every layer, bytes, from a cache's per-layer views
    (keys, values: [1, kv heads, n, dim], n > 0)."""
    total = 0
    for keys, values in layers:
        n = keys.shape[-2]
        total += (keys.numel() * keys.element_size() + values.numel() * values.element_size()) // max(1, n)
    return total


def cgroup_limit(root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The memory limit of this process's cgroup, bytes: the least `memory.max` (cgroup v2) or
    `memory.limit_in_bytes` (v1) of its group and the groups above it; None when none is set.
    In a container with its own cgroup namespace (Kubernetes, Docker) the group is the root."""
    groups: list[Path] = []
    try:
        for line in self_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # v2's unified hierarchy
                groups.append(root / path.lstrip("/"))
            elif "memory" in controllers.split(","):
                groups.append(root / "memory" / path.lstrip("/"))
    except (OSError, ValueError):
        pass
    groups += [root, root / "memory"]  # no /proc/self/cgroup: the namespace's root
    limits: list[int] = []
    for group in groups:
        top = root / "memory" if group.is_relative_to(root / "memory") else root
        while True:
            for name in ("memory.max", "memory.limit_in_bytes"):
                try:
                    text = (group / name).read_text().strip()
                except OSError:
                    continue
                if text.isdigit() and int(text) < _NO_LIMIT:
                    limits.append(int(text))
            if group == top or group.parent == group:
                break
            group = group.parent
    return min(limits) if limits else None


def _meminfo_total(meminfo: Path = Path("/proc/meminfo")) -> int:
    """The host's memory, bytes (0 where unknown)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _resident_bytes(statm: Path = Path("/proc/self/statm")) -> int:
    """What this process holds in memory now, bytes (0 where unknown)."""
    try:
        return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def auto_budget(
    device: torch.device,
    other_bytes: int,
    limit: Callable[[], int | None] = cgroup_limit,
    meminfo: Path = Path("/proc/meminfo"),
    statm: Path = Path("/proc/self/statm"),
) -> tuple[int, str]:
    """The auto budget (module's terms), bytes, and how it was found (for the log), with
    `other_bytes` (the prefix cache's budget) taken out; `limit()`: the cgroup's memory limit
    (None: none). Call once the model is loaded."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget, how = int(free * AUTO_SHARE) - other_bytes, f"{AUTO_SHARE:.0%} of the {free >> 20} MiB free on {device}"
    else:
        cap, held = limit(), _resident_bytes(statm)
        if cap is not None:
            budget = int(cap * AUTO_SHARE_CGROUP) - held - other_bytes
            how = f"{AUTO_SHARE_CGROUP:.0%} of the cgroup's {cap >> 20} MiB limit, less {held >> 20} MiB held"
        else:
            total = _meminfo_total(meminfo)
            budget, how = total // 4 - other_bytes, f"a quarter of the host's {total >> 20} MiB (no cgroup limit)"
    if other_bytes:
        how += f", less the prefix cache's {other_bytes >> 20} MiB"
    if budget < MIN_AUTO_BYTES:
        return MIN_AUTO_BYTES, how + f": under {MIN_AUTO_BYTES >> 20} MiB, so {MIN_AUTO_BYTES >> 20} MiB"
    return budget, how


class KVBudget:
    """The budget of the admitted sessions' keys/values (module's terms). `budget_bytes` 0: no
    bound (every session is admitted). `token_bytes`: one token's keys/values."""

    def __init__(self, budget_bytes: int, token_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.token_bytes = token_bytes

    def need(self, slots: int) -> int:
        """Bytes of a reserve of `slots` tokens."""
        return slots * self.token_bytes

    def admits(self, held: int, need: int) -> bool:
        """Whether a session reserving `need` bytes fits beside `held`."""
        return self.budget_bytes <= 0 or held + need <= self.budget_bytes

    def ever_fits(self, need: int) -> bool:
        """Whether a reserve of `need` bytes fits the budget at all (alone)."""
        return self.budget_bytes <= 0 or need <= self.budget_bytes
