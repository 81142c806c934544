"""Tokenizers the engine uses: a HF tokenizer (chat template from the tokenizer) or a byte
tokenizer for tiny test stacks."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Optional


class Tokenizer:
    vocab_size: int
    eos_ids: set[int]

    def encode_chat(self, prompt: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def token_text(self, token: int) -> str:
        return self.decode([token])


class ByteTokenizer(Tokenizer):
    """0 pad, 1 bos, 2 eos, 3 + b for byte b: vocab 259."""
    vocab_size = 259

    def __init__(self) -> None:
        self.eos_ids = {2}

    def encode_chat(self, prompt: str) -> list[int]:
        return [1] + [3 + b for b in f"User: {prompt}\nAssistant:".encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    def __init__(self, tok, eos_ids: Optional[list[int]] = None) -> None:
        self.tok = tok
        self.vocab_size = len(tok)
        ids = set(eos_ids or [])
        if tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
        self.eos_ids = ids
        self.token_text = lru_cache(maxsize=65536)(self._token_text)  # type: ignore[method-assign]

    @classmethod
    def from_folder(cls, folder: str | Path, eos_ids: Optional[list[int]] = None) -> "HFTokenizer":
        from transformers import AutoTokenizer
        return cls(AutoTokenizer.from_pretrained(str(folder)), eos_ids)

    def encode_chat(self, prompt: str) -> list[int]:
        if getattr(self.tok, "chat_template", None):
            text = self.tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                add_generation_prompt=True)
            return list(self.tok.encode(text, add_special_tokens=False))
        return list(self.tok.encode(prompt))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def _token_text(self, token: int) -> str:
        return self.tok.decode([token], skip_special_tokens=False)
