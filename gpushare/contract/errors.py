"""The contract's errors, and how a message repeats a value it can't trust."""

from __future__ import annotations

from typing import Any

from gpushare.contract import jsondepth


class ContractError(ValueError):
    """A value that violates the contract. The message names the object and field at fault."""


class RequestError(ContractError):
    """A pod's GPU request can't be satisfied as written (e.g. gpu-mem not divisible by gpu-count)."""


class AnnotationError(ContractError):
    """A malformed gpushare annotation."""


#: how many characters of an untrusted string (an annotation value, a container name) a message repeats
QUOTE_LIMIT = 80


def quoted(value: Any, limit: int = QUOTE_LIMIT) -> str:
    """``value`` for a log line, Event or error: as Python's repr, which quotes strings and escapes
    newlines and other unprintable characters (so they can't start a forged log line), and cut to
    ``limit`` characters, so a huge annotation isn't echoed whole."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(value) if isinstance(value, str) else len(text)} characters)"


def json_object(text: str, where: str, expected: str) -> dict[str, Any]:
    """Parse an annotation that must hold a JSON object; errors name the object and annotation. One nested
    too deep is refused before the decoder recurses into it."""
    try:
        raw = jsondepth.loads(text)
    except (TypeError, ValueError) as exc:
        raise AnnotationError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise AnnotationError(f"{where}: expected {expected}")
    return raw


class OverClaimError(AnnotationError):
    """A pod's annotation gives a container more of a card than the container requests; the pod is
    counted at its request there."""

    def __init__(self, pod: str, container: str, card: str, field: str, claimed: int, requested: int) -> None:
        super().__init__(
            f"pod {pod} container {quoted(container)} card {card}: {field} claims {claimed} unit(s), more than "
            f"the {requested} it requests; counted at {requested}"
        )
        self.pod, self.container, self.card, self.field = pod, container, card, field
        self.claimed, self.requested = claimed, requested


class LedgerMismatch(AnnotationError):
    """A pod's annotations name other cards (or amounts) than the extender recorded for it on its node."""

    def __init__(self, pod: str, field: str, claimed: str, recorded: str) -> None:
        super().__init__(
            f"pod {pod}: its annotations claim {claimed}, but the extender recorded {recorded} in node "
            f"annotation {field}; counted as recorded"
        )
        self.pod, self.field, self.claimed, self.recorded = pod, field, claimed, recorded
