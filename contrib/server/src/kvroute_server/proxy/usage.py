"""Reading a backend's token usage out of the answer's bytes as they pass, without parsing the JSON."""

from __future__ import annotations

import re

import attrs

__all__ = ["UsageSniffer"]

#: A count of more than 18 digits is no token count (and ``int`` refuses numbers over 4,300 digits):
#: such a value is not matched, so a hostile backend cannot make the sniffer raise.
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d{1,18})(?!\d)')
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d{1,18})(?!\d)')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,18})(?!\d)')


@attrs.define
class UsageSniffer:
    """Finds ``usage.prompt_tokens``, ``prompt_tokens_details.cached_tokens`` and ``usage.completion_tokens`` in
    passing bytes.

    Bytes are scanned only when a chunk mentions ``usage``; a short tail of the previous
    chunk is kept so that a number split across two chunks is still found. The last
    values seen win (streams carry usage once, at the end).
    """

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    _tail: bytes = b""

    def feed(self, chunk: bytes) -> None:
        data = self._tail + chunk if self._tail else chunk
        self._tail = data[-256:]
        # rfind, not ``in``: bytes' ``in`` first tries its operand as an int (a caught
        # TypeError each time); and usage comes at the end of the bytes that carry it.
        if data.rfind(b"prompt_tokens") < 0:
            return
        prompt = _last_number(_PROMPT, b'"prompt_tokens"', data)
        if prompt is not None:
            self.prompt_tokens = prompt
        cached = _last_number(_CACHED, b'"cached_tokens"', data)
        if cached is not None:
            self.cached_tokens = cached
        completion = _last_number(_COMPLETION, b'"completion_tokens"', data)
        if completion is not None:
            self.completion_tokens = completion


def _last_number(pattern: re.Pattern[bytes], key: bytes, data: bytes) -> int | None:
    """The number in ``pattern``'s last match in ``data``, None without a match (``pattern`` starts with ``key``).

    Looked for at the key's last mention, not by scanning all of ``data`` with the pattern;
    only when that mention is not followed by a number are all matches looked at.
    """
    at = data.rfind(key)
    if at < 0:
        return None
    match = pattern.match(data, at)
    if match is not None:
        return int(match.group(1))
    numbers = pattern.findall(data)
    return int(numbers[-1]) if numbers else None
