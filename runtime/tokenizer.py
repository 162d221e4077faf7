"""Prompt encoding and output decoding with the checkpoint's own tokenizer files
(transformers' tokenizer loading, local files only; chat templates render in its sandbox)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class Tokenizer:
    def __init__(self, model_dir: Path):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except Exception as e:
            raise RuntimeError(f"{model_dir}: cannot load the tokenizer: {e}") from e
        self._max_token_chars: int | None = None
        self._token_strs: dict[int, str] = {}
        self._anchor: tuple[int, str] | None = None  # (token id, its text): token_str decodes after it

    def encode_prompt(self, prompt: str) -> list[int]:
        # verbose=False: no "longer than the maximum sequence length" warning (the runtime
        # checks lengths against the plan's context itself)
        return list(self.tok(prompt, verbose=False)["input_ids"])

    def encode_messages(self, messages: Any) -> list[int]:
        if not getattr(self.tok, "chat_template", None):
            raise ValueError("the checkpoint's tokenizer has no chat_template; send 'prompt' instead of 'messages'")
        out = self.tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if hasattr(out, "keys") and "input_ids" in out:
            out = out["input_ids"]
        return [int(t) for t in out]

    @property
    def max_token_chars(self) -> int:
        """The most characters of text one token of this vocabulary can stand for."""
        if self._max_token_chars is None:
            self._max_token_chars = max((len(t) for t in self.tok.get_vocab()), default=1) or 1
        return self._max_token_chars

    def min_tokens(self, req: Any) -> int:
        """A lower bound on the tokens of a request's prompt, from its length alone: every token
        covers at most `max_token_chars` characters of normalized text, and normalizing
        (accents stripped, ...) is taken to at most halve the text (a token list counts as
        it is)."""
        if isinstance(req.prompt, tuple):
            return len(req.prompt)
        if req.prompt is not None:
            chars = len(req.prompt)
        else:
            chars = sum(len(m.get("content") or "") if isinstance(m, dict) else 0 for m in req.messages)
        return chars // (2 * self.max_token_chars)

    def encode_request(self, req: Any) -> list[int]:
        """A request's prompt ids: its token list as given, its text encoded, or its messages
        through the chat template."""
        if isinstance(req.prompt, tuple):
            return list(req.prompt)
        if req.prompt is not None:
            return self.encode_prompt(req.prompt)
        return self.encode_messages(req.messages)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_str(self, token_id: int) -> str:
        """One token's text as logprobs report it, its leading space kept (special tokens
        kept: an EOS shows as itself). Decoded after a fixed anchor token, less the anchor's
        text: SentencePiece decoders drop a word-initial token's space when it is decoded
        alone ("▁the" -> "the"), but not after another token ("a the"). Where the anchor's
        text is not a prefix of the pair's, the token decoded alone. Cached per id."""
        text = self._token_strs.get(token_id)
        if text is None:
            text = self._token_strs[token_id] = self._token_text(token_id)
        return text

    def _token_text(self, token_id: int) -> str:
        if self._anchor is None:
            ids = self.tok("a", add_special_tokens=False)["input_ids"]
            self._anchor = (ids[-1], self.tok.decode(ids[-1:])) if ids else (-1, "")
        anchor, prefix = self._anchor
        if anchor >= 0:
            pair = self.tok.decode([anchor, token_id])
            if prefix and pair.startswith(prefix):
                return pair[len(prefix):]
        return self.tok.decode([token_id])

    def stop_check(self, req: Any, generated: list[int]) -> bool:
        """Whether the text of `generated` holds one of the request's stop strings
        (generate's `stop_check`)."""
        text = self.decode(generated)
        return any(s in text for s in req.stop)

    def output_text(self, ids: list[int], stop: tuple[str, ...] = ()) -> str:
        """The text of a finished request, cut before the first stop string it holds."""
        text = self.decode(ids)
        cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
        return text[:cut] if cut >= 0 else text
