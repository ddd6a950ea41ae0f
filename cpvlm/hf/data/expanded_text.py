"""A rendered conversation and its placeholder expansion: offsets across it, and its tokens.

Legend: L tokens of the expanded text, n tokens of one placeholder's replacement.

The chat template writes one placeholder per image or video (``raw``); the processor's
``get_text_with_replacements`` replaces each by its expansion (``text``: hundreds to thousands of
``<|image_pad|>`` and the like) and says where (``expansion``: ``span`` in ``raw``, ``new_span``
in ``text``). Tokenizing ``text`` costs time per token, most of it in the replacements, which
repeat from sample to sample.

``ExpandedTokenizer`` gives the same ids and offsets as the tokenizer on ``text`` while tokenizing
only ``raw`` and each distinct replacement once: a fast tokenizer cuts its input at added tokens
(those it matches on the raw text: not normalized, no strip, not single-word) before anything
else, and tokenizes every piece between them on its own. So where the placeholder is such a token
(and comes out of ``raw``'s tokenization as one token, exactly at its span) and each replacement
begins and ends with such a token, the tokens of ``text`` are those of ``raw`` with each
placeholder's token replaced by the replacement's own tokens, offsets shifted. Where any of this
does not hold, it tokenizes ``text`` itself.
"""

from __future__ import annotations

import bisect
import dataclasses

CACHE = 4096  # distinct replacements kept (one per image size and video length, in practice)


@dataclasses.dataclass(frozen=True)
class Rendering:
    """A conversation rendered by the template (``raw``), expanded (``text``), and where the
    expansion put each placeholder's replacement (``get_text_with_replacements``' offsets)."""

    raw: str
    text: str
    expansion: list[dict]

    def expanded_offset(self, x: int) -> int | None:
        """Where offset ``x`` of ``raw`` lands in ``text`` (None: inside a placeholder)."""
        shift = 0
        for r in self.expansion:
            (a, b), (c, d) = r["span"], r["new_span"]
            if b <= x:
                shift += (d - c) - (b - a)
            elif a < x:
                return None
            else:  # the replacements are in text order
                break
        return x + shift


class ExpandedTokenizer:
    """``tokenize(rendering, add_special_tokens)`` -> ``(ids, offsets)`` of ``rendering.text``,
    as ``tokenizer(text, return_offsets_mapping=True)`` gives them (see the module docstring)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        fast = getattr(tokenizer, "is_fast", False)  # a slow tokenizer has no offsets
        added = (getattr(tokenizer, "added_tokens_decoder", None) or {}) if fast else {}
        clean = [
            t.content
            for t in added.values()
            if not (t.normalized or t.lstrip or t.rstrip or t.single_word) and t.content
        ]
        self.clean = tuple(clean)
        self._pieces: dict[str, tuple[list[int], list[tuple[int, int]]] | None] = {}

    def _piece(self, replacement: str):
        """The replacement's own ids and offsets, or None where it does not begin and end with
        a clean added token."""
        if replacement in self._pieces:
            return self._pieces[replacement]
        if len(self._pieces) >= CACHE:
            self._pieces.clear()
        enc = None
        if replacement.startswith(self.clean) and replacement.endswith(self.clean):
            enc = self.tokenizer(replacement, add_special_tokens=False, return_offsets_mapping=True)
            enc = (list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]])
        self._pieces[replacement] = enc
        return enc

    def _whole(self, text: str, add_special_tokens: bool, offsets: bool):
        enc = self.tokenizer(
            text, add_special_tokens=add_special_tokens, return_offsets_mapping=offsets
        )
        return list(enc["input_ids"]), enc["offset_mapping"] if offsets else None

    def __call__(self, rendering: Rendering, add_special_tokens: bool, offsets: bool = True):
        """``(ids, offsets)``; offsets None unless asked for."""
        exp = rendering.expansion
        if not exp or not self.clean:
            return self._whole(rendering.text, add_special_tokens, offsets)
        pieces = [self._piece(r["replacement"]) for r in exp]
        if any(p is None for p in pieces) or not all(r["text"] in self.clean for r in exp):
            return self._whole(rendering.text, add_special_tokens, offsets)
        enc = self.tokenizer(
            rendering.raw, add_special_tokens=add_special_tokens, return_offsets_mapping=True
        )
        ends, shifts, total = [], [0], 0
        for r in exp:
            (a, b), (c, d) = r["span"], r["new_span"]
            ends.append(b)
            total += (d - c) - (b - a)
            shifts.append(total)
        placeholder = {r["span"]: (r, p) for r, p in zip(exp, pieces, strict=True)}
        ids, spans, found = [], [], 0
        for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
            hit = placeholder.get((a, b))
            if hit is not None and b > a:
                r, (piece_ids, piece_offsets) = hit
                c = r["new_span"][0]
                ids += piece_ids
                spans += [(c + x, c + y) for x, y in piece_offsets]
                found += 1
                continue
            if a < b and any(x < b and a < y for x, y in placeholder):  # cuts into one
                return self._whole(rendering.text, add_special_tokens, offsets)
            shift = shifts[bisect.bisect_right(ends, a)]
            ids.append(t)
            spans.append((a + shift, b + shift))
        if found != len(exp):  # a placeholder did not come out as one token
            return self._whole(rendering.text, add_special_tokens, offsets)
        return ids, spans if offsets else None
