"""The benchmark's prompt sets: JSONL files of chat messages or of prompt token ids.

Each non-blank line is one prompt, either `{"messages": [{"role": ..., "content": ...}, ...]}`
(rendered with the model's chat template, generation prompt appended) or
`{"prompt_token_ids": [int, ...]}` (used as given; for checkpoints without a tokenizer).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any


class PromptFileError(ValueError):
    """A prompt file that cannot be used, with the file (and line) and what is wrong."""


def default_prompts_path() -> Path:
    """The JSONL prompt set shipped with the package."""
    return Path(str(resources.files("fp8_align") / "data" / "prompts.jsonl"))


def read_prompt_records(path: Path) -> list[dict[str, Any]]:
    """Validated JSONL records: each {"messages": [{"role", "content"}, ...]} or {"prompt_token_ids": [int, ...]}.

    Blank lines are skipped. Raises PromptFileError naming the file and line of the first problem.
    """
    if not path.is_file():
        raise PromptFileError(f"prompt file {path} does not exist")
    records = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(record, dict) or len({"messages", "prompt_token_ids"} & record.keys()) != 1:
            raise PromptFileError(f"{where}: expected an object with exactly one of 'messages' or 'prompt_token_ids'")
        if "messages" in record:
            _check_messages(record["messages"], where)
        else:
            _check_token_ids(record["prompt_token_ids"], where)
        records.append(record)
    if not records:
        raise PromptFileError(f"{path} holds no prompts")
    return records


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise PromptFileError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)):
            raise PromptFileError(f"{where}: every message needs string 'role' and 'content', got {message!r}")


def _check_token_ids(token_ids: Any, where: str) -> None:
    if not isinstance(token_ids, list) or not token_ids:
        raise PromptFileError(f"{where}: 'prompt_token_ids' must be a non-empty list of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids):
        raise PromptFileError(f"{where}: 'prompt_token_ids' must hold non-negative integers")


def tokenize_prompts(records: Sequence[dict[str, Any]], model_dir: Path, vocab_size: int) -> list[list[int]]:
    """Prompt token ids: chat messages through the model's chat template, token-id prompts as given.

    Raises PromptFileError when messages need a tokenizer or chat template the model lacks, or a
    token id is outside the vocabulary.
    """
    tokenizer = _chat_tokenizer(model_dir) if any("messages" in r for r in records) else None
    prompts = []
    for index, record in enumerate(records):
        if "messages" in record:
            ids = list(tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True, tokenize=True, return_dict=False))
        else:
            ids = list(record["prompt_token_ids"])
        if max(ids) >= vocab_size:
            raise PromptFileError(f"prompt {index}: token id {max(ids)} is outside the model's vocabulary of {vocab_size}")
        prompts.append(ids)
    return prompts


def _chat_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise PromptFileError(
            f"the prompts hold chat 'messages' but {model_dir} has no tokenizer; "
            'give prompts as {"prompt_token_ids": [...]} lines instead'
        )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.chat_template:
        raise PromptFileError(f"the prompts hold chat 'messages' but the tokenizer in {model_dir} has no chat template")
    return tokenizer
