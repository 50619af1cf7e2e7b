"""A container being created and what the node decides about it, as plain values that neither the CRI
nor NRI shapes: each transport converts its own message to a :class:`ContainerRequest` and applies a
:class:`Decision`'s :class:`Edits` back to it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpushare.assignment import Claim, Refusal
from gpushare.contract.allocation import CardSlice
from gpushare.placement.demand import ANY_CARD, CardRule


@dataclass(frozen=True, slots=True)
class Target:
    """The pod and container a container being created is for."""

    namespace: str
    pod: str
    uid: str
    container: str

    @property
    def pod_key(self) -> str:
        return f"{self.namespace}/{self.pod}"

    def __str__(self) -> str:
        return f"pod {self.pod_key} container {self.container}"

    def claim(self, slices: tuple[CardSlice, ...], rule: CardRule = ANY_CARD) -> Claim:
        """This container's claim on ``slices`` under the pod's card ``rule``, for
        :func:`gpushare.assignment.check_extender_decision`."""
        return Claim(self.pod_key, self.uid, self.container, slices, rule=rule)


@dataclass(frozen=True, slots=True)
class ContainerRequest:
    """What the node sees of a container being created. ``env`` keeps every entry in order, repeated
    keys included (which one wins is the runtime's business, so a repeat is itself worth correcting)."""

    target: Target
    #: the pod's annotations, as kubelet passes them to the runtime for its sandbox
    sandbox_annotations: Mapping[str, str] = field(default_factory=dict)
    env: tuple[tuple[str, str], ...] = ()
    #: the container's annotations (a device plugin's Allocate answer puts its own here)
    annotations: Mapping[str, str] = field(default_factory=dict)
    #: the paths of the device nodes the container gets (on the host, and in the container where it differs)
    devices: tuple[str, ...] = ()
    #: fully qualified CDI device names, including those of the DRA claims the container uses
    cdi_devices: tuple[str, ...] = ()
    #: the pod's cgroup as kubelet gave it to the sandbox: where its GPU memory limits go
    cgroup_parent: str = ""

    def env_values(self, key: str) -> list[str]:
        """Every value ``key`` has in the env, in order."""
        return [value for name, value in self.env if name == key]


@dataclass(frozen=True, slots=True)
class Edits:
    """Changes to a container being created. Env keys are set exactly once each (duplicates would leave
    the winner up to the runtime); devices and CDI names listed under ``remove_*`` go before those under
    ``add_*`` are added."""

    env: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    remove_devices: tuple[str, ...] = ()
    add_devices: tuple[str, ...] = ()
    remove_cdi: tuple[str, ...] = ()
    add_cdi: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Decision:
    """Forward the container unchanged (``edits`` and ``refusal`` None), with ``edits``, or refuse it.
    ``reason`` labels a correction worth reporting (metric, log, event); a silent hardening leaves it
    empty."""

    edits: Edits | None = None
    refusal: Refusal | None = None
    reason: str = ""
    message: str = ""
