"""A pretrained tokenizer: a `tokenizer.json` file, or a Hugging Face tokenizer folder
(`tokenizer.json` with `tokenizer_config.json` and, maybe, `special_tokens_map.json`), loaded
with the `tokenizers` library; no `transformers` needed.

From the folder come the special tokens (BOS, EOS, padding) and the chat template (which renders
instruction data, `data/instructions.py`). Documents get BOS first when the tokenizer config says
`add_bos_token` (DeepSeek's and Llama's do), and EOS after, as the shard writer does for every
tokenizer. A vocabulary larger than the model's embedding is an error with the fix.
"""

import hashlib
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from dstrain.data.tokenizer import BPETokenizer
from dstrain.errors import UserError

TOKENIZER_FILE = "tokenizer.json"
# The end-of-document tokens of common tokenizers, tried when the config names none.
EOS_GUESSES = ("<｜end▁of▁sentence｜>", "<|endoftext|>", "</s>", "<|eos|>", "<|end_of_text|>")


class PretrainedTokenizer(BPETokenizer):
    """A `tokenizers` tokenizer with its own special tokens and chat template."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        name: str,
        *,
        eos_id: int,
        bos_id: int | None,
        chat_template: str | None,
    ) -> None:
        super().__init__(tokenizer, name, eos_id)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id
        self.chat_template = chat_template
        # The shards depend on the template and BOS too (instruction data, document starts).
        extra = f"{self.fingerprint}/{bos_id}/{chat_template}".encode()
        self.fingerprint = hashlib.sha256(extra).hexdigest()


def load_pretrained(path: Path, model_vocab: int) -> PretrainedTokenizer:
    """`path`: a tokenizer.json, or a folder holding one (and its configs)."""
    folder = path if path.is_dir() else path.parent
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise UserError(
            f"data.tokenizer: {file} not found",
            "point data.tokenizer at a tokenizer.json, a Hugging Face tokenizer folder, or use "
            "`bpe` / `bytes`",
            exit_code=1,
        )
    try:
        tokenizer = HFTokenizer.from_file(str(file))
    except Exception as exc:  # the Rust parser's error, whatever its type
        raise UserError(
            f"data.tokenizer: {file} is not a tokenizers JSON file ({exc})",
            "give a tokenizer.json written by `tokenizers` or `transformers` (fast tokenizers)",
            exit_code=1,
        ) from None
    config = _config(folder)
    eos_id = _special(tokenizer, config, "eos_token", EOS_GUESSES, file)
    bos_id = None
    if config.get("add_bos_token"):
        bos_id = _special(tokenizer, config, "bos_token", (), file)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > model_vocab:
        raise UserError(
            f"data.tokenizer: {file} has {vocab} ids, more than the model's vocab_size="
            f"{model_vocab} (its embedding)",
            f"--set model.vocab_size={vocab} (or more; a checkpoint's config.json fixes it)",
            exit_code=1,
        )
    name = f"hf-{folder.name}-{vocab}"
    return PretrainedTokenizer(
        tokenizer, name, eos_id=eos_id, bos_id=bos_id, chat_template=config.get("chat_template")
    )


def _config(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json, with special_tokens_map.json's entries where it lacks them."""
    merged: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        file = folder / name
        if not file.exists():
            continue
        try:
            merged.update(json.loads(file.read_text(encoding="utf-8")))
        except (ValueError, UnicodeDecodeError) as exc:
            raise UserError(
                f"data.tokenizer: {file} is not valid JSON ({exc})", "fix the file", 1
            ) from None
    return merged


def _special(
    tokenizer: HFTokenizer,
    config: dict[str, Any],
    key: str,
    guesses: tuple[str, ...],
    file: Path,
) -> int:
    value = config.get(key)
    token = value.get("content") if isinstance(value, dict) else value
    candidates = [token] if token else list(guesses)
    for candidate in candidates:
        if candidate and (token_id := tokenizer.token_to_id(candidate)) is not None:
            return token_id
    raise UserError(
        f"data.tokenizer: {file} has no {key.replace('_', ' ')} "
        + (f"`{token}` in its vocabulary" if token else "the config names"),
        f'name it in tokenizer_config.json (`"{key}": "..."`), as Hugging Face folders do',
        exit_code=1,
    )
