"""Incremental detokenising of a request's generated ids, with stop strings."""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"  # what a decode shows for a partial UTF-8 sequence


class TextStream:
    """The text of a growing list of token ids: every :meth:`push` decodes all ids so far (without special
    tokens) and returns the new suffix, holding back a trailing replacement character and, with ``stop``
    strings, the last ``max(len(stop)) - 1`` characters (they may begin a stop string). Once a stop string
    appears, :attr:`stopped` is set, the text ends before it and the ids end at the one that completed it
    (:attr:`kept`: how many of the last push's ids that is). ``tokenizer`` None: the text is always empty.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # the text sent so far
        self.stopped = False
        self.kept = 0  # ids of the last push that count (all of them unless a stop string ended the text)

    def _decode(self, ids: Sequence[int] | None = None) -> str:
        return self.tokenizer.decode(self.ids if ids is None else ids, skip_special_tokens=True)

    def _find_stop(self, text: str, sent: int) -> int | None:
        """Where the first stop string in ``text`` begins (searched from where it could begin, given the ``sent``
        characters), or None."""
        cut = None
        for s in self.stop:
            i = text.find(s, max(0, sent - len(s) + 1))
            if i >= 0 and (cut is None or i < cut):
                cut = i
        return cut

    def push(self, ids: Sequence[int]) -> str:
        """Adds ``ids``; returns the text that is now safe to send."""
        new_ids = [int(i) for i in ids]
        base = len(self.ids)
        self.ids.extend(new_ids)
        self.kept = len(new_ids)
        if self.tokenizer is None or self.stopped or not new_ids:
            return ""
        full = self._decode()
        sent = len(self.text)
        cut = self._find_stop(full, sent) if self.stop else None
        if cut is not None:
            # the id that completed a stop string: the shortest prefix of the new ids whose text holds one (a
            # stop string in the whole text is in the text of every longer prefix, so this ends at the first)
            text = full
            for k in range(1, len(new_ids) + 1):
                text = full if k == len(new_ids) else self._decode(self.ids[: base + k])
                found = self._find_stop(text, sent)
                if found is not None:
                    self.kept, cut = k, found
                    break
            del self.ids[base + self.kept:]
            self.stopped = True
            new = text[sent:max(cut, sent)]
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
