"""Requests as the scheduler sees them: what is asked (`GenRequest`), the state of one in
flight (`Sequence`) and what comes back (`GenResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class GenRequest:
    key: str  # custom_id
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings (checked by generate's stop_check)
    presence_penalty: float = 0.0  # these five: see sampling.adjust_logits
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # no EOS and no stop string before this many generated tokens
    logprobs: int | None = None  # None: not asked; N >= 0: each token's logprob and its N most likely
    n: int = 1  # completions (choices) of this prompt: they share its KV blocks
    #: structured output: ("json_object", "") or ("json_schema", the schema as canonical JSON); None: free text
    response_format: tuple[str, str] | None = None
    prompt_logprobs: int | None = None  # N >= 0: each prompt token's logprob and its N most likely (echo)
    min_p: float = 0.0  # keep tokens with at least this share of the best one's probability (sampling/draw_rows.py)


#: one generated token's logprob entry: (its logprob, [(token id, logprob), ...] the top N, best first)
LogprobEntry = tuple[float, list[tuple[int, float]]]


@dataclass
class GenResult:
    key: str
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) | "length" (max_tokens or context)
    logits: list[torch.Tensor] = field(default_factory=list)  # per step, when recorded
    logprobs: list[LogprobEntry] | None = None  # per generated token, when the request asked
    #: a request with n > 1: every completion, in order (the fields above are the first one's); else empty
    choices: list["GenResult"] = field(default_factory=list)
    #: asked (GenRequest.prompt_logprobs): per prompt token, None for the first (nothing precedes it)
    prompt_logprobs: list[LogprobEntry | None] | None = None

    @property
    def completions(self) -> list["GenResult"]:
        """Each completion of the request, in order (itself alone when n is 1)."""
        return self.choices or [self]


@dataclass(eq=False)
class Sequence:
    """One request in flight: its tokens, how many of them are in the KV cache, and its
    sampling state. `request` is None for a sequence that is only scored (perplexity).
    Compared by identity."""

    sid: int
    tokens: list[int]  # prompt + generated so far
    prompt_len: int
    max_new: int
    cached: int = 0  # positions already in the KV cache
    request: GenRequest | None = None
    generator: torch.Generator | None = None  # its sampler's random state
    logits: list[torch.Tensor] = field(default_factory=list)  # per generated token, when recorded
    logprobs: list[LogprobEntry] = field(default_factory=list)  # per generated token, when its request asked
    choice: int = 0  # which of its request's n completions this is (0: the one that prefills the prompt)
    forked: bool = False  # choice 0 of a request with n > 1: its siblings exist
    constraint: Any = None  # its structured output's grammar matcher (structured.Matcher), when it has one
    prompt_logprobs: list[LogprobEntry | None] = field(default_factory=list)  # per prompt token, when asked

    @property
    def scores_prompt(self) -> bool:
        """Its request asks for its prompt tokens' logprobs and they are not all recorded yet."""
        req = self.request
        return (req is not None and req.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.prompt_len)

    @property
    def slots(self) -> int:
        """Batch slots this sequence stands for: its request's n until its siblings are forked."""
        return self.request.n if self.request is not None and self.choice == 0 and not self.forked else 1

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def pending(self) -> int:
        """Tokens known but not yet run through the model."""
        return len(self.tokens) - self.cached
