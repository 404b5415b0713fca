"""Instruction data: JSONL whose records are conversations, `{"messages": [{"role": ..,
"content": ..}, ...]}`, or pairs, `{"prompt": .., "response": ..}`, trained with the loss on the
responses only.

A record is rendered to text with the tokenizer's chat template (a pretrained tokenizer's, from
its tokenizer_config.json; `DEFAULT_TEMPLATE` for the built-in tokenizers), and the characters of
each assistant turn (from its content to the end of its turn in the template) are the loss
spans. The text is then tokenized span by span (`encode`), so every token is wholly inside or
outside a span: prompt, system and user tokens carry no loss as targets, response tokens do, and
the document's EOS does when the conversation ends with a response. The global-token
normalisation of the loss then counts only the tokens that carry it.

Bad input is one error naming the file and line: a line that is not a JSON object, a record with
neither `messages` nor `prompt`/`response`, a message without `role`/`content` strings.
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dstrain.data.readers import not_utf8
from dstrain.errors import UserError

# For tokenizers without a template of their own (the built-in BPE and bytes).
DEFAULT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
_FIX = (
    'each line: {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", '
    '"content": "..."}]} or {"prompt": "...", "response": "..."}'
)


@dataclass(frozen=True)
class Record:
    """One instruction record, with where it came from (for errors)."""

    data: dict[str, Any]
    source: str  # "path:line"


@dataclass(frozen=True)
class Rendered:
    text: str
    spans: tuple[tuple[int, int], ...]  # character ranges that carry loss
    ends_with_response: bool


def is_instruction_file(path: Path) -> bool:
    """A .jsonl file whose first record has `messages` or `prompt`."""
    if path.suffix != ".jsonl":
        return False
    with path.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if line.strip():
                try:
                    first = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(first, dict) and ("messages" in first or "prompt" in first)
    return False


def read_records(files: list[Path]) -> Iterator[Record]:
    for path in files:
        with path.open(encoding="utf-8", errors="strict") as lines:
            try:
                for number, line in enumerate(lines, 1):
                    if line.strip():
                        yield Record(_parse(line, path, number), f"{path}:{number}")
            except UnicodeDecodeError as exc:
                raise not_utf8(path, exc) from None


def _parse(line: str, path: Path, number: int) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{path}:{number}: malformed JSON ({exc.msg} at column {exc.colno})", _FIX, 1
        ) from None
    if not isinstance(value, dict):
        raise UserError(f"{path}:{number}: a JSON {type(value).__name__}, not an object", _FIX, 1)
    return value


def render(record: Record, template: str | None) -> Rendered:
    """The record's text under `template` (Jinja, with `messages`), and its loss spans."""
    messages = _messages(record)
    compiled = _compile(template or DEFAULT_TEMPLATE)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = compiled.render(messages=messages[:i])
        upto = compiled.render(messages=messages[: i + 1])
        start = upto.find(message["content"], len(before))
        spans.append((len(before) if start < 0 else start, len(upto)))
    text = compiled.render(messages=messages)
    return Rendered(text, tuple(spans), messages[-1]["role"] == "assistant")


def as_text(record: Record) -> str:
    """The record as plain text, for training the built-in BPE on instruction data."""
    return render(record, None).text


def _messages(record: Record) -> list[dict[str, str]]:
    data = record.data
    if "messages" in data:
        messages = data["messages"]
        if not isinstance(messages, list) or not messages:
            raise UserError(f"{record.source}: `messages` is not a non-empty list", _FIX, 1)
        for message in messages:
            ok = isinstance(message, dict) and all(
                isinstance(message.get(k), str) for k in ("role", "content")
            )
            if not ok:
                raise UserError(
                    f"{record.source}: a message without `role` and `content` strings: "
                    f"{str(message)[:80]}",
                    _FIX,
                    1,
                )
        return messages
    if isinstance(data.get("prompt"), str) and isinstance(data.get("response"), str):
        return [
            {"role": "user", "content": data["prompt"]},
            {"role": "assistant", "content": data["response"]},
        ]
    keys = ", ".join(sorted(data)) or "(none)"
    raise UserError(
        f"{record.source}: neither `messages` nor `prompt`/`response` (keys: {keys})", _FIX, 1
    )


_COMPILED: dict[str, Any] = {}


def _compile(template: str) -> Any:
    if template not in _COMPILED:
        import jinja2

        env = jinja2.Environment(keep_trailing_newline=True)
        env.globals["raise_exception"] = _raise
        _COMPILED[template] = env.from_string(template)
    return _COMPILED[template]


def _raise(message: str) -> None:
    raise UserError(f"the chat template refused a record: {message}", _FIX, 1)


def pieces(rendered: Rendered) -> Iterator[tuple[str, bool]]:
    """The text cut at the span edges: (piece, carries loss), in order."""
    position = 0
    for start, stop in rendered.spans:
        if start > position:
            yield rendered.text[position:start], False
        yield rendered.text[start:stop], True
        position = stop
    if position < len(rendered.text):
        yield rendered.text[position:], False
