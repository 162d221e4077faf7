"""Every per-request generation parameter and its default, written once: `SamplingParams`.

The request parser's `Request` (job/requests.py), the scheduler's `GenRequest`
(scheduler/sequence.py) and the sampler (sampler.py, draw_rows.py, penalties.py,
logprobs.py) all read these fields from this one class: a parsed request *is* its sampling
parameters plus where it came from, a scheduled one is them plus its prompt's tokens.

To add a sampling parameter (three files):
  1. here: the field, its default (the value that changes nothing) and a comment saying what
     it does; `is_neutral` in penalties.py if it reshapes logits;
  2. job/requests.py: its name in `KNOWN_FIELDS` / `_BODY_SAMPLING` and its check in
     `_sampling` (range, type, the error naming the field);
  3. the sampler op that applies it: sampling/penalties.py (a logit reshaping, one op over
     the rows that set it), sampling/draw_rows.py (a truncation of the draw: `DrawParams`) or
     sampling/logprobs.py (what is reported).
Nothing else copies the fields: job/reader.py, the Ray actors and the scheduler pass the
whole object on.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """What a request asks of generation. Frozen; keyword-only (subclasses put their own
    positional fields first). Every default means "off" (or "the job's default")."""

    max_tokens: int | None = None  # tokens to generate; None: the job's default (a GenRequest's is resolved)
    temperature: float = 0.0  # 0.0 means greedy
    top_p: float = 1.0  # nucleus: keep the most likely tokens holding this much probability; 1.0 off
    top_k: int = 0  # keep the k most likely tokens; 0 off
    min_p: float = 0.0  # vLLM's: keep tokens with at least this share of the best one's probability; 0 off
    seed: int | None = None  # the request's random stream (sampling/random.py); None: named by its key
    stop: tuple[str, ...] = ()  # generation stops when the output text contains one of these
    presence_penalty: float = 0.0  # OpenAI: minus this once for each token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this times how often a token was generated
    repetition_penalty: float = 1.0  # vLLM/HF, over prompt + generated tokens; 1.0 means off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), sorted by id
    min_tokens: int = 0  # EOS (and stop strings) held off until this many tokens were generated
    logprobs: int | None = None  # None: not asked; N >= 0: each token's logprob and its N most likely
    prompt_logprobs: int | None = None  # N >= 0: each prompt token's logprob and its N most likely (echo)
    n: int = 1  # completions (choices) of this prompt: they share its KV blocks
    #: structured output: ("json_object", "") or ("json_schema", the schema as compact JSON, key order kept);
    #: None: free text (runtime/structured.py)
    response_format: tuple[str, str] | None = None

    def sampling(self, **changes: Any) -> dict[str, Any]:
        """This object's sampling parameters alone, as keyword arguments (a subclass's own
        fields left out), with `changes` applied: what builds a GenRequest from a Request."""
        return {**{f.name: getattr(self, f.name) for f in fields(SamplingParams)}, **changes}
