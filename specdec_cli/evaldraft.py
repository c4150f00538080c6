"""`specdec eval-draft`: how well a draft model captures the target's (greedy) distribution.

Draft selection asks for a lightweight model whose guesses the target accepts often and
which is cheap to run. This module measures both, offline, with transformers, and turns
them into predicted speedups (theory: Leviathan et al. 2023, Chen et al. 2023).

Terms:
    continuation   the target's greedy output of up to N tokens after a prompt (stops at EOS)
    match[j]       True when the draft's argmax at continuation position j, teacher-forced on
                   prompt + continuation[:j], equals continuation[j]. Along the target's own
                   greedy output this gives exactly the accept/reject decisions of real greedy
                   rounds: a draft token at offset k > 0 is conditioned on the earlier drafts of
                   its round, which equal the target's tokens whenever they were accepted.
    alpha          mean of match over all continuation positions (per-token greedy agreement)
    round          one target step: the draft proposes gamma tokens from position i; accepted =
                   leading matches among positions i .. i+gamma-1 (at most gamma); the target
                   adds its own token (correction or bonus), so the round advances accepted + 1.
                   Only complete rounds (i + gamma <= continuation length) are counted.
    tokens/step    mean over rounds of accepted + 1 (the measured mean accepted length)
    E              (1 - alpha^(gamma+1)) / (1 - alpha): tokens/step predicted from alpha
                   when acceptances are independent with probability alpha
    acceptance by offset
                   at gamma_max, P(offset k accepted | offsets < k accepted), k = 0 .. gamma_max-1
    rank[j]        the rank of continuation[j] among the draft's tokens there (0: its argmax, a
                   match). At a mismatch (a rejection in a greedy round) the target's token is
                   the correction, and rank <= k means a pre-drafted branch on the draft's k
                   likeliest alternatives (the drafter's branch_alts) bets on it
    branch coverage
                   at mismatches, P(rank <= k) for k = 1, 2, 3: the most a branch hit rate can
                   reach with k alternatives per position
    decode step    one forward of one token with a KV cache (median over a few steps, after a
                   warm-up); c = draft decode step / target decode step
    verify cost v  target forward of gamma+1 tokens with a KV cache / target decode step
    co-located     speedup E / (gamma * c + 1): draft and target share the hardware
    overlapped     speedup E / v: drafting runs on other hardware, hidden behind verification
Both speedups are reported with the measured tokens/step and with the formula E.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdec.acceptance import expected_tokens
from specdec.errors import UserError
from specdec.models import PAIRS

DEFAULT_TARGET = PAIRS["qwen-coder"].target
DEFAULT_DRAFT = PAIRS["qwen-coder"].draft
DEFAULT_GAMMAS = (1, 2, 4, 8)
DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_TIMING_STEPS = 10


class EvalDraftError(UserError, ValueError):
    """A bad input: reported to the user as one line, without a traceback."""


class VocabMismatch(EvalDraftError):
    """The draft's tokenizer vocabulary differs from the target's: token ids mean different things."""


@dataclass
class Prompt:
    """One prompt of a prompt set: a name for reports and the text the target continues."""

    id: str
    prompt: str


@dataclass
class PromptResult:
    """One prompt: its sizes and the draft's agreement along the target's continuation."""

    id: str
    prompt_tokens: int
    continuation_tokens: int
    alpha: float
    matches: list[bool] = field(repr=False)
    ranks: list[int] = field(default_factory=list, repr=False)  # rank[j] (see the module's terms)


@dataclass
class Costs:
    """Step timings in milliseconds (medians) and the ratios derived from them."""

    context_tokens: int
    target_decode_ms: float
    draft_decode_ms: float
    c: float
    # gamma -> target forward of gamma+1 tokens, in ms and relative to target_decode_ms
    verify_ms: dict[int, float]
    verify_over_decode: dict[int, float]


@dataclass
class GammaResult:
    """Measured and predicted acceptance and speedup at one gamma."""

    gamma: int
    rounds: int
    mean_accepted: float
    tokens_per_step: float
    expected_tokens: float
    verify_over_decode: float
    speedup_colocated_measured: float
    speedup_colocated_formula: float
    speedup_overlapped_measured: float
    speedup_overlapped_formula: float


@dataclass
class Report:
    target: str
    draft: str
    max_new_tokens: int
    gammas: list[int]
    prompts: int
    positions: int
    alpha: float
    acceptance_gamma: int
    acceptance_by_offset: list[float | None]
    costs: Costs
    branch_coverage: list[float | None]  # [k-1]: P(rank <= k | mismatch), k = 1, 2, 3
    per_gamma: list[GammaResult]
    per_prompt: list[PromptResult]
    seconds: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        """Every number, JSON-ready (per-prompt match lists left out)."""
        d = asdict(self)
        for p in d["per_prompt"]:
            del p["matches"], p["ranks"]
        return d


# ---------------------------------------------------------------- prompts and models


def load_prompts(path: Path | None = None, limit: int | None = None) -> list[Prompt]:
    """Prompts from a JSONL file of {"id": ..., "prompt": ...}; default: the built-in code set."""
    if path is None:
        text = (importlib.resources.files("specdec") / "prompts" / "code_prompts.jsonl").read_text()
    else:
        text = Path(path).read_text()
    prompts: list[Prompt] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            prompts.append(Prompt(id=str(obj.get("id", n)), prompt=str(obj["prompt"])))
        except (ValueError, KeyError, AttributeError) as err:
            where = f"{path or 'built-in prompts'}:{n}"
            raise EvalDraftError(f'{where}: expected a JSON object with a "prompt" ({err!r})') from err
    if not prompts:
        raise EvalDraftError(f"{path}: no prompts")
    return prompts[:limit] if limit else prompts


def check_same_vocab(target_vocab: dict[str, int], draft_vocab: dict[str, int]) -> None:
    """Raise VocabMismatch unless both tokenizers map the same strings to the same ids."""
    if target_vocab == draft_vocab:
        return
    differ = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda kv: kv[1])[:5]
    raise VocabMismatch(
        f"the draft's vocabulary ({len(draft_vocab)} tokens) differs from the target's "
        f"({len(target_vocab)} tokens); speculative decoding needs one tokenizer. "
        f"First differing (token, id) pairs: {differ}"
    )


def load_model(ref: str, quantize: str = "none", draft_vocab: Path | None = None) -> tuple[Any, Any]:
    """(model in eval mode, float32, and its tokenizer) for a model reference; `draft_vocab`: a
    draft vocabulary file its output layer is cut to (as the drafter's --draft-vocab)."""
    from transformers import AutoTokenizer

    from specdec.models import compat, load_causal_lm, resolve
    from specdec.models.vocab import read

    cut = read(draft_vocab, ref, compat.from_folder(resolve(ref), ref).vocab_size) if draft_vocab else None
    return load_causal_lm(ref, "float32", quantize, draft_vocab=cut), AutoTokenizer.from_pretrained(resolve(ref))


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """Token ids that end a continuation: the tokenizer's EOS and the generation config's."""
    ids = {tokenizer.eos_token_id}
    gen = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen if isinstance(gen, list) else [gen])
    return {i for i in ids if i is not None}


# ---------------------------------------------------------------- agreement


def greedy_continuation(model: Any, prompt_ids: list[int], max_new_tokens: int, stop: set[int]) -> list[int]:
    """The model's argmax continuation with a KV cache (no repetition penalty or other processors)."""
    import torch

    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
        tokens: list[int] = []
        while True:
            tokens.append(int(out.logits[0, -1].argmax()))
            if len(tokens) >= max_new_tokens or tokens[-1] in stop:
                return tokens
            out = model(input_ids=torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)


def draft_matches(draft: Any, prompt_ids: list[int], continuation: list[int]) -> list[bool]:
    """match[j] for every continuation position, from ONE teacher-forced forward of the draft."""
    return [r == 0 for r in draft_ranks(draft, prompt_ids, continuation)]


def draft_ranks(draft: Any, prompt_ids: list[int], continuation: list[int]) -> list[int]:
    """rank[j] for every continuation position (see the module's terms), from ONE teacher-forced
    forward of the draft."""
    import torch

    ids = torch.tensor([prompt_ids + continuation[:-1]])
    # logits at position t predict token t+1: the last len(continuation) rows predict the continuation
    with torch.inference_mode():
        logits = draft(input_ids=ids).logits[0, len(prompt_ids) - 1 :]  # [len(continuation), vocab]
        chosen = logits.gather(1, torch.tensor(continuation)[:, None])  # [len(continuation), 1]
        ranks: list[int] = (logits > chosen).sum(-1).tolist()  # tokens the draft ranks above the target's
        return ranks


def branch_coverage(ranks: Sequence[int], k_max: int = 3) -> list[float | None]:
    """[k-1]: at mismatches, the share whose target token is within the draft's k likeliest
    alternatives (rank <= k), k = 1 .. k_max (None: no mismatch)."""
    missed = [r for r in ranks if r > 0]
    return [sum(r <= k for r in missed) / len(missed) if missed else None for k in range(1, k_max + 1)]


def simulate_rounds(matches: Sequence[bool], gamma: int) -> list[int]:
    """Accepted draft tokens of each complete greedy round along one continuation (see module doc)."""
    accepted: list[int] = []
    i = 0
    while i + gamma <= len(matches):
        a = 0
        while a < gamma and matches[i + a]:
            a += 1
        accepted.append(a)
        i += a + 1
    return accepted


def acceptance_by_offset(accepted: Sequence[int], gamma: int) -> list[float | None]:
    """P(offset k accepted | offsets < k accepted) for k < gamma; None where no round reached k."""
    rates: list[float | None] = []
    for k in range(gamma):
        reached = sum(1 for a in accepted if a >= k)
        rates.append(sum(1 for a in accepted if a > k) / reached if reached else None)
    return rates


# ---------------------------------------------------------------- cost


def time_forward(model: Any, context_ids: list[int], k: int, steps: int) -> float:
    """Median ms of one forward of k new tokens on a KV cache of context_ids (after one warm-up)."""
    import torch

    new = torch.tensor([context_ids[-k:]])  # token values do not matter for timing
    times = []
    with torch.inference_mode():
        cache = model(input_ids=torch.tensor([context_ids]), use_cache=True).past_key_values
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            model(input_ids=new, past_key_values=cache, use_cache=True)
            times.append((time.perf_counter() - t0) * 1e3)
            cache.crop(-k)  # back to the context
    return statistics.median(times[1:])


def measure_costs(target: Any, draft: Any, context_ids: list[int], gammas: Sequence[int], steps: int) -> Costs:
    """Decode-step cost of both models and the target's verify cost for each gamma, on one context."""
    target_ms = time_forward(target, context_ids, 1, steps)
    draft_ms = time_forward(draft, context_ids, 1, steps)
    verify_ms = {g: time_forward(target, context_ids, g + 1, steps) for g in gammas}
    return Costs(
        context_tokens=len(context_ids),
        target_decode_ms=target_ms,
        draft_decode_ms=draft_ms,
        c=draft_ms / target_ms,
        verify_ms=verify_ms,
        verify_over_decode={g: ms / target_ms for g, ms in verify_ms.items()},
    )


# ---------------------------------------------------------------- the evaluation


def gamma_result(gamma: int, accepted: Sequence[int], alpha: float, costs: Costs) -> GammaResult:
    """Measured tokens/step, E from alpha, and both speedup bounds with each."""
    mean_accepted = statistics.fmean(accepted) if accepted else 0.0
    tokens = mean_accepted + 1.0
    e = expected_tokens(alpha, gamma)
    colocated = gamma * costs.c + 1.0
    v = costs.verify_over_decode[gamma]
    return GammaResult(
        gamma=gamma,
        rounds=len(accepted),
        mean_accepted=mean_accepted,
        tokens_per_step=tokens,
        expected_tokens=e,
        verify_over_decode=v,
        speedup_colocated_measured=tokens / colocated,
        speedup_colocated_formula=e / colocated,
        speedup_overlapped_measured=tokens / v,
        speedup_overlapped_formula=e / v,
    )


def evaluate(
    target_ref: str,
    draft_ref: str,
    prompts: Sequence[Prompt],
    gammas: Sequence[int] = DEFAULT_GAMMAS,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    timing_steps: int = DEFAULT_TIMING_STEPS,
    progress: bool = True,
    quantize: str = "none",
    draft_vocab: Path | None = None,
) -> Report:
    """Load both models, measure agreement over the prompts and step costs, predict speedups
    (`quantize`, `draft_vocab`: the draft's, as load_model's)."""
    from tqdm import tqdm

    if not prompts:
        raise EvalDraftError("no prompts")
    if max_new_tokens < 1:
        raise EvalDraftError("max_new_tokens must be at least 1")
    gammas = sorted(set(gammas))
    t0 = time.perf_counter()
    target, tokenizer = load_model(target_ref)
    draft, draft_tokenizer = load_model(draft_ref, quantize, draft_vocab)
    check_same_vocab(tokenizer.get_vocab(), draft_tokenizer.get_vocab())
    stop = eos_ids(target, tokenizer)
    t1 = time.perf_counter()

    results: list[PromptResult] = []
    contexts: list[list[int]] = []
    for p in tqdm(prompts, desc="prompts", unit="prompt", file=sys.stderr, disable=not progress):
        prompt_ids = list(tokenizer.encode(p.prompt))
        continuation = greedy_continuation(target, prompt_ids, max_new_tokens, stop)
        ranks = draft_ranks(draft, prompt_ids, continuation)
        matches = [r == 0 for r in ranks]
        results.append(
            PromptResult(p.id, len(prompt_ids), len(continuation), statistics.fmean(matches), matches, ranks)
        )
        contexts.append(prompt_ids + continuation)
    t2 = time.perf_counter()

    costs = measure_costs(target, draft, contexts[0], gammas, timing_steps)
    t3 = time.perf_counter()

    positions = sum(r.continuation_tokens for r in results)
    alpha = sum(sum(r.matches) for r in results) / positions
    accepted = {g: [a for r in results for a in simulate_rounds(r.matches, g)] for g in gammas}
    return Report(
        target=target_ref,
        draft=draft_ref,
        max_new_tokens=max_new_tokens,
        gammas=list(gammas),
        prompts=len(results),
        positions=positions,
        alpha=alpha,
        acceptance_gamma=gammas[-1],
        acceptance_by_offset=acceptance_by_offset(accepted[gammas[-1]], gammas[-1]),
        costs=costs,
        branch_coverage=branch_coverage([x for r in results for x in r.ranks]),
        per_gamma=[gamma_result(g, accepted[g], alpha, costs) for g in gammas],
        per_prompt=results,
        seconds={"load": t1 - t0, "agreement": t2 - t1, "timing": t3 - t2, "total": t3 - t0},
    )


# ---------------------------------------------------------------- output and command line


def format_table(r: Report) -> str:
    """The report as plain text: agreement, costs, and one row per gamma."""
    c = r.costs
    offsets = "  ".join(f"k={k}: {'-' if x is None else f'{x:.3f}'}" for k, x in enumerate(r.acceptance_by_offset))
    lines = [
        f"draft {r.draft}  vs  target {r.target}",
        f"prompts {r.prompts}, continuation positions {r.positions} (max {r.max_new_tokens} per prompt)",
        f"alpha (per-token greedy agreement): {r.alpha:.3f}",
        f"acceptance by offset at gamma {r.acceptance_gamma}: {offsets}",
        "branch coverage (at a mismatch, the target's token is within the draft's k likeliest alternatives): "
        + "  ".join(f"k={k}: {'-' if x is None else f'{x:.2f}'}" for k, x in enumerate(r.branch_coverage, 1)),
        f"decode step: target {c.target_decode_ms:.1f} ms, draft {c.draft_decode_ms:.1f} ms, "
        f"c = {c.c:.3f}  (context {c.context_tokens} tokens)",
        "",
        "                tokens/target step      verify    co-located speedup   overlapped speedup",
        "gamma  rounds   measured  E(alpha)     v         measured  E(alpha)   measured  E(alpha)",
    ]
    for g in r.per_gamma:
        lines.append(
            f"{g.gamma:>5}  {g.rounds:>6}   {g.tokens_per_step:>8.3f}  {g.expected_tokens:>8.3f}"
            f"     {g.verify_over_decode:>5.2f}"
            f"     {g.speedup_colocated_measured:>8.3f}  {g.speedup_colocated_formula:>8.3f}"
            f"   {g.speedup_overlapped_measured:>8.3f}  {g.speedup_overlapped_formula:>8.3f}"
        )
    lines += [
        "",
        "v = target forward of gamma+1 tokens / target decode step; co-located = T / (gamma c + 1); "
        "overlapped = T / v (T: tokens per target step)",
        f"time: load {r.seconds['load']:.1f} s, agreement {r.seconds['agreement']:.1f} s, "
        f"timing {r.seconds['timing']:.1f} s",
    ]
    return "\n".join(lines)


def _gammas(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("gammas: comma-separated integers >= 1, e.g. 1,2,4,8")
    return values


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register `eval-draft` on the `specdec` subcommands."""
    p = sub.add_parser("eval-draft", help="measure a draft's agreement with the target and predict speedups")
    p.add_argument("--target", default=DEFAULT_TARGET, help="target model: registry name or folder")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model: registry name or folder")
    p.add_argument("--prompts", type=Path, help='JSONL file of {"id", "prompt"} (default: built-in code prompts)')
    p.add_argument("--gammas", type=_gammas, default=list(DEFAULT_GAMMAS), help="comma-separated (default 1,2,4,8)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="target continuation length")
    p.add_argument("--limit", type=int, help="use only the first K prompts")
    p.add_argument("--timing-steps", type=int, default=DEFAULT_TIMING_STEPS, help="timed steps per cost (median)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument(
        "--quantize", choices=["none", "int8"], default="none", help="the draft's quantisation (as the drafter's)"
    )
    p.add_argument(
        "--draft-vocab", type=Path, metavar="FILE", help="cut the draft's output layer to this draft vocabulary"
    )
    p.add_argument("--json", metavar="PATH", help="write every number as JSON to PATH ('-': stdout)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run the evaluation; print the table (to stderr when the JSON goes to stdout)."""
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    # a bad input (EvalDraftError, a model not found) is a UserError: `specdec` prints it as one line
    report = evaluate(
        args.target,
        args.draft,
        load_prompts(args.prompts, args.limit),
        args.gammas,
        args.max_new_tokens,
        args.timing_steps,
        quantize=args.quantize,
        draft_vocab=args.draft_vocab,
    )
    print(format_table(report), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        text = json.dumps(report.to_dict(), indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0
