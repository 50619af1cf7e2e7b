"""The workload the fragmentation-aware policies learn from: the GPU demand shapes of the pods the watch
holds, and their shapes with CPU, memory and card rule."""

from __future__ import annotations

from collections import Counter

from gpushare.extender.asks import PodAsk

from gpushare import placement
from gpushare.contract.errors import ContractError

#: one GPU container as the fragmentation-aware policy learns it: (GPU shape, CPU milli, memory bytes, card rule)
PodShape = tuple[placement.Shape, int, int, placement.CardRule]

NO_GPU = placement.Shape(0, 0)


class ObservedWorkload:
    """Histograms of the pods' shapes, kept per pod key as pods come and go. The cache calls it under its
    lock; it takes none of its own."""

    def __init__(self) -> None:
        self._shapes: Counter[placement.Shape] = Counter()
        self._shapes_of_pod: dict[str, tuple[placement.Shape, ...]] = {}
        #: moves whenever the GPU demand shapes change
        self.version = 0
        self._pod_shapes: Counter[PodShape] = Counter()
        self._pod_shapes_of_pod: dict[str, tuple[PodShape, ...]] = {}

    def observe(self, key: str, ask: PodAsk | None) -> None:
        """The pod ``key`` is now as ``ask`` says (None: gone)."""
        self._observe_shapes(key, ask)
        self._observe_pod_shapes(key, ask)

    def shapes(self) -> list[placement.Shape]:
        return list(self._shapes.elements())

    def pod_shapes(self) -> list[PodShape]:
        """Every pod's (GPU shape, CPU milli, memory bytes, card rule), one entry per GPU container."""
        return list(self._pod_shapes.elements())

    def _observe_pod_shapes(self, key: str, ask: PodAsk | None) -> None:
        """Keep the histogram of pod shapes with their CPU, memory and card rule (``Shape(0, 0)`` for no
        GPU)."""
        self._pod_shapes.subtract(self._pod_shapes_of_pod.pop(key, ()))
        if ask is None:
            return
        try:
            shapes = tuple(d.shape for d in ask.demands) or (NO_GPU,)
            rule = ask.rule.without_topology()
            cpu, memory = ask.host
        except ContractError:
            return
        entries = tuple((shape, cpu, memory, rule) for shape in shapes)
        self._pod_shapes.update(entries)
        self._pod_shapes_of_pod[key] = entries

    def _observe_shapes(self, key: str, ask: PodAsk | None) -> None:
        """Keep the histogram of GPU demand shapes that the fragmentation-aware policy learns from."""
        old = self._shapes_of_pod.pop(key, ())
        try:
            new = tuple(d.shape for d in ask.demands) if ask is not None else ()
        except ContractError:
            new = ()
        if old == new:
            if new:
                self._shapes_of_pod[key] = new
            return
        self._shapes.subtract(old)
        self._shapes.update(new)
        if new:
            self._shapes_of_pod[key] = new
        self.version += 1
