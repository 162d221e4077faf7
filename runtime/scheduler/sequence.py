"""Requests as the scheduler sees them: what is asked (`GenRequest`: a prompt's tokens and its
sampling/params.SamplingParams), the state of one in flight (`Sequence`) and what comes back
(`GenResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moecc_runtime.sampling.logprobs import LogprobEntry
from moecc_runtime.sampling.params import SamplingParams


@dataclass(frozen=True, init=False)
class GenRequest(SamplingParams):
    """A request as the scheduler runs it: its key (custom_id), its prompt's token ids and its
    SamplingParams, max_tokens resolved (the tokens it may generate: an int, never None).
    Built as GenRequest(key, prompt_ids, max_tokens, **sampling parameters); frozen."""

    key: str  # custom_id
    prompt_ids: list[int]

    def __init__(self, key: str, prompt_ids: list[int], max_tokens: int, **params: Any) -> None:
        super().__init__(max_tokens=max_tokens, **params)
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "prompt_ids", prompt_ids)


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
