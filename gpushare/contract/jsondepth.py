"""How deep a JSON document may nest, told before a decoder recurses into it: request bodies
(:func:`gpushare.tlshttp.parse_json`) and the JSON annotations (:func:`gpushare.contract.errors.json_object`)
both come from peers and tenants, and ``json.loads`` raises ``RecursionError`` a few thousand levels down."""

from __future__ import annotations

import json
from typing import Any

#: how deep arrays and objects in JSON from a peer may nest: the AdmissionReviews and kube-scheduler's
#: ExtenderArgs nest a pod's fields about a dozen deep, gpushare's annotations three
MAX_JSON_DEPTH = 64

_JSON_STRUCTURE = b'[]{}"'
_NOT_JSON_STRUCTURE = bytes(b for b in range(256) if b not in _JSON_STRUCTURE)
_SQUARE = bytes.maketrans(b"{}", b"[]")


def nests_deeper(body: bytes, limit: int) -> bool:
    """Whether the JSON in ``body`` nests arrays and objects more than ``limit`` deep, told without
    recursion and by bytes operations that run in C, so a body of the largest size allowed costs about as
    much as decoding it (a few tens of ms; up to about 0.7 s for one packed with structure 64 deep, which
    takes ``json.loads`` longer). Brackets inside strings don't count. For a body that isn't JSON the
    answer may be either; the decoder refuses it anyway."""
    # escapes pair a backslash with the character after it, left to right; strings then run from a
    # quote to the next (two quotes in a row leave no bracket out, whichever strings they end and begin)
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in body else body
    text = unescaped.translate(_SQUARE, _NOT_JSON_STRUCTURE).replace(b'""', b"")
    brackets = b"".join(text.split(b'"')[::2]) if b'"' in text else text
    # each round removes the innermost pairs, so a balanced body is empty after as many rounds as it nests
    rounds = 0
    while brackets and rounds <= limit:
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):
            break
        brackets, rounds = shorter, rounds + 1
    # left over: closers that close nothing, then openers never closed, which nest on top of those rounds
    return rounds + len(brackets.lstrip(b"]")) > limit


class TooDeep(ValueError):
    """JSON nested past the limit; a ValueError, as the decoder's own refusals are."""


def loads(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` for JSON from peers and tenants: TooDeep where it nests more than ``max_depth``
    deep, before the decoder recurses into it; the decoder's own ValueError where it isn't JSON."""
    data = text.encode(errors="surrogatepass") if isinstance(text, str) else text
    if nests_deeper(data, max_depth):
        raise TooDeep(f"nests more than {max_depth} arrays and objects deep")
    return json.loads(text)
