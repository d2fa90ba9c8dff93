"""Incremental detokenising of a request's generated ids, with stop strings."""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"  # what a decode shows for a partial UTF-8 sequence


class TextStream:
    """The text of a growing list of token ids: every :meth:`push` decodes all ids so far (without special
    tokens) and returns the new suffix, holding back a trailing replacement character and, with ``stop``
    strings, the last ``max(len(stop)) - 1`` characters (they may begin a stop string). Once a stop string
    appears, :attr:`stopped` is set and the text ends before it. ``tokenizer`` None: the text is always empty.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # the text sent so far
        self.stopped = False
        self._full = ""

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, ids: Sequence[int]) -> str:
        """Adds ``ids``; returns the text that is now safe to send."""
        self.ids.extend(int(i) for i in ids)
        if self.tokenizer is None or self.stopped or not ids:
            return ""
        full = self._full = self._decode()
        sent = len(self.text)
        cut = None
        for s in self.stop:
            i = full.find(s, max(0, sent - len(s) + 1))
            if i >= 0 and (cut is None or i < cut):
                cut = i
        if cut is not None:
            self.stopped = True
            new = full[sent:max(cut, sent)]
            self.text += new
            return new
        end = len(full.rstrip(REPLACEMENT)) if full.endswith(REPLACEMENT) else len(full)
        end = max(sent, end - self.hold)
        new = full[sent:end]
        self.text += new
        return new

    def finish(self) -> str:
        """The rest of the text once no more ids come (nothing held back, a stop string already cut)."""
        if self.tokenizer is None or self.stopped:
            return ""
        full = self._decode() if self.ids else ""
        new = full[len(self.text):]
        self.text = full
        return new
