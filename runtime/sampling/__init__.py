"""Sampling: every request's parameters in one class (params.py); a step's next tokens, all rows
at once (sampler.py), drawn with temperature, top-k, top-p and min-p (draw_rows.py) after each
request's penalties and biases (penalties.py), from each request's own random stream
(random.py); the logprobs of the rows that asked, read back with the tokens (logprobs.py)."""

from moecc_runtime.sampling.draw_rows import DrawParams, draw
from moecc_runtime.sampling.logprobs import LogprobEntry, prompt_logprobs, read_back, step_logprobs
from moecc_runtime.sampling.params import SamplingParams
from moecc_runtime.sampling.penalties import adjust_logits, adjust_rows, is_neutral
from moecc_runtime.sampling.random import completion_seed, request_generator, uniforms
from moecc_runtime.sampling.sampler import NOT_FINITE, Masks, SamplingError, choose, next_token, sample

__all__ = ["NOT_FINITE", "DrawParams", "LogprobEntry", "Masks", "SamplingError", "SamplingParams", "adjust_logits",
           "adjust_rows", "choose", "completion_seed", "draw", "is_neutral", "next_token", "prompt_logprobs",
           "read_back", "request_generator", "sample", "step_logprobs", "uniforms"]
