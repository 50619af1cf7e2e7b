"""The gpushare contract: every resource name, annotation key, label and env var name, parsed and
formatted in exactly one place.

The original Alibaba keys (``ALIYUN_COM_GPU_MEM_*``) are kept verbatim so that pods, device plugins and
extenders of the original project interoperate with ours. On top of them we add a per-container
allocation annotation, which is what makes multi-container and multi-card pods work.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpushare.cards import Card

# --- resources ------------------------------------------------------------------------------------

RESOURCE_MEM = "aliyun.com/gpu-mem"
RESOURCE_COUNT = "aliyun.com/gpu-count"
RESOURCES = (RESOURCE_MEM, RESOURCE_COUNT)
#: Kubernetes' own resources, read for the host-aware placement policy
RESOURCE_CPU = "cpu"
RESOURCE_MEMORY = "memory"

# --- pod annotations (original gpushare keys) -----------------------------------------------------

ANN_MEM_IDX = "ALIYUN_COM_GPU_MEM_IDX"
ANN_MEM_POD = "ALIYUN_COM_GPU_MEM_POD"
ANN_MEM_DEV = "ALIYUN_COM_GPU_MEM_DEV"
ANN_MEM_ASSIGNED = "ALIYUN_COM_GPU_MEM_ASSIGNED"
ANN_MEM_ASSUME_TIME = "ALIYUN_COM_GPU_MEM_ASSUME_TIME"
#: written by the newer variant of the original extender: {"<containerIndex>": {"<gpuIndex>": <gpuMem>}}
ANN_FRAMEWORK_ALLOCATION = "scheduler.framework.gpushare.allocation"

# --- pod annotations (ours) -----------------------------------------------------------------------

#: JSON: container name -> [{"index": i, "uuid": "GPU-...", "units": n}, ...]
ANN_ALLOCATION = "gpushare.io/allocation"
#: annotations whose presence shows that a scheduler (ours or the original) chose the pod's cards
PLACEMENT_ANNOTATIONS = (ANN_ALLOCATION, ANN_FRAMEWORK_ALLOCATION, ANN_MEM_IDX)
#: JSON: container name -> [gpushare resources the device plugin has already served to it]
ANN_ASSIGNED_CONTAINERS = "gpushare.io/assigned-containers"
#: per-pod placement policy override
ANN_POLICY = "gpushare.io/policy"
#: pod annotations only gpushare's extender and node agent may write (admission webhook and policy)
PROTECTED_ANNOTATION_PREFIXES = ("gpushare.io/", "ALIYUN_COM_GPU_MEM_")
#: protected by prefix, but the pod's owner chooses it
TENANT_ANNOTATIONS = frozenset({ANN_POLICY})


def protected_annotation(key: str) -> bool:
    return key == ANN_FRAMEWORK_ALLOCATION or (
        key.startswith(PROTECTED_ANNOTATION_PREFIXES) and key not in TENANT_ANNOTATIONS
    )


# --- the original extender's fenced cards, and the original plugin's isolation switch --------------

#: ConfigMap in kube-system named ``unhealthy-gpu-<node>``; its key ``gpus`` lists fenced card numbers
FENCE_CONFIGMAP_NAMESPACE = "kube-system"
FENCE_CONFIGMAP_PREFIX = "unhealthy-gpu-"
FENCE_CONFIGMAP_KEY = "gpus"
#: node label; "true" makes the device plugin add ENV_CGPU_DISABLE to every GPU container
NODE_LABEL_CGPU_DISABLE = "cgpu.disable.isolation"
ENV_CGPU_DISABLE = "CGPU_DISABLE"


def fence_configmap_name(node: str) -> str:
    return f"{FENCE_CONFIGMAP_PREFIX}{node}"


def parse_fenced_cards(text: str | None) -> frozenset[int]:
    """The card numbers in a fence ConfigMap's ``gpus`` value (``"0,2"``). Entries that aren't numbers
    are skipped, as the original extender skips them."""
    fenced = set()
    for part in (text or "").split(","):
        part = part.strip()
        if part.isdigit():
            fenced.add(int(part))
    return frozenset(fenced)


# --- container annotations, from the device plugin to the CRI shim --------------------------------

CTR_ANN_POD_UID = "gpushare.io/pod-uid"
CTR_ANN_POD = "gpushare.io/pod"
CTR_ANN_CONTAINER = "gpushare.io/container"
CTR_ANN_CARDS = "gpushare.io/cards"

# --- node annotation and label (advertiser) -------------------------------------------------------

NODE_ANN_INVENTORY = "gpushare.io/inventory"
#: bumped by every extender bind: the compare-and-swap on the node that orders binds across replicas
NODE_ANN_BIND_SEQUENCE = "gpushare.io/bind-sequence"
#: written by the extender's bind with its compare-and-swap on the node: binds whose binding may not
#: have been created yet, each with what it holds per card, so another replica counts them meanwhile
NODE_ANN_PENDING_BINDS = "gpushare.io/pending-binds"
NODE_LABEL_MODEL = "gpushare.io/gpu-model"
INVENTORY_VERSION = 1

# --- labels kubelet puts on CRI sandboxes and containers ------------------------------------------

CRI_LABEL_POD_NAME = "io.kubernetes.pod.name"
CRI_LABEL_POD_NAMESPACE = "io.kubernetes.pod.namespace"
CRI_LABEL_POD_UID = "io.kubernetes.pod.uid"
CRI_LABEL_CONTAINER_NAME = "io.kubernetes.container.name"

# --- container env --------------------------------------------------------------------------------

ENV_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
ENV_MEM_IDX = "ALIYUN_COM_GPU_MEM_IDX"
ENV_MEM_POD = "ALIYUN_COM_GPU_MEM_POD"
ENV_MEM_CONTAINER = "ALIYUN_COM_GPU_MEM_CONTAINER"
ENV_MEM_DEV = "ALIYUN_COM_GPU_MEM_DEV"
ENV_MEM_PREFIX = "ALIYUN_COM_GPU_MEM_"
#: what a container that must not see any GPU gets in NVIDIA_VISIBLE_DEVICES
VISIBLE_DEVICES_VOID = "void"

# --- process env ----------------------------------------------------------------------------------

ENV_NODE_NAME = "NODE_NAME"

# --- device files ---------------------------------------------------------------------------------

DEV_CONTROL_FILES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
CDI_KIND = "nvidia.com/gpu"


def device_file(minor: int) -> str:
    return f"/dev/nvidia{minor}"


def cdi_device_name(uuid: str) -> str:
    return f"{CDI_KIND}={uuid}"


# --- errors ---------------------------------------------------------------------------------------


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


# --- units ----------------------------------------------------------------------------------------

_UNIT_RE = re.compile(r"^(?:(GiB)|(MiB)|([1-9][0-9]*)MiB)$")


@dataclass(frozen=True, slots=True)
class MemoryUnit:
    """The size of one ``aliyun.com/gpu-mem`` unit."""

    mib: int

    @property
    def name(self) -> str:
        return format_unit(self)

    def units_of(self, memory_mib: int) -> int:
        """Whole units in ``memory_mib`` (rounded down: a partial unit can't be handed out)."""
        return memory_mib // self.mib

    def describe(self, units: int) -> str:
        """Human wording such as ``12 GiB`` or ``3 x 512MiB``."""
        if self.mib == 1024:
            return f"{units} GiB"
        if self.mib == 1:
            return f"{units} MiB"
        return f"{units} x {self.mib}MiB"


GIB = MemoryUnit(1024)


def parse_unit(text: str) -> MemoryUnit:
    m = _UNIT_RE.match(text.strip())
    if not m:
        raise ContractError(f"memory unit {quoted(text)} is not one of GiB, MiB or <N>MiB")
    if m.group(1):
        return GIB
    if m.group(2):
        return MemoryUnit(1)
    return MemoryUnit(int(m.group(3)))


def format_unit(unit: MemoryUnit) -> str:
    if unit.mib == 1024:
        return "GiB"
    if unit.mib == 1:
        return "MiB"
    return f"{unit.mib}MiB"


# --- requests -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ContainerRequest:
    """One container's GPU request, in the plugin's units.

    ``mem`` alone: ``mem`` units on one card. ``count`` alone: ``count`` whole cards, exclusively.
    Both: ``count`` distinct cards with ``mem // count`` units each.
    """

    name: str
    init: bool
    mem: int = 0
    count: int = 0

    @property
    def wants_gpu(self) -> bool:
        return self.mem > 0 or self.count > 0

    @property
    def exclusive(self) -> bool:
        return self.count > 0 and self.mem == 0

    @property
    def cards(self) -> int:
        return self.count if self.count else 1

    @property
    def units_per_card(self) -> int:
        """Units taken on each card; 0 for exclusive requests (the whole card)."""
        return self.mem // self.cards


@dataclass(frozen=True, slots=True)
class PodRequest:
    namespace: str
    name: str
    uid: str
    containers: tuple[ContainerRequest, ...]

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def gpu_containers(self) -> tuple[ContainerRequest, ...]:
        return tuple(c for c in self.containers if c.wants_gpu)

    @property
    def app_mem(self) -> int:
        """gpu-mem over the app containers; what the original components count for a pod."""
        return sum(c.mem for c in self.containers if not c.init)

    @property
    def effective_mem(self) -> int:
        """The pod's gpu-mem request by Kubernetes' rule (:func:`effective_request`)."""
        return effective_request(
            (c.mem for c in self.containers if not c.init), (c.mem for c in self.containers if c.init)
        )

    def container(self, name: str) -> ContainerRequest | None:
        return next((c for c in self.containers if c.name == name), None)


def effective_request(apps: Iterable[int], inits: Iterable[int]) -> int:
    """Kubernetes' rule for how much of one resource a pod needs: init containers run one at a time
    before the app containers, so the larger of the app containers' sum and its largest init container."""
    return max(sum(apps), max(inits, default=0))


def pod_key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', 'default')}/{meta.get('name', '?')}"


def _parse_quantity(value: Any, where: str) -> int:
    """Extended resources are whole numbers; accept ints and integral strings only."""
    if isinstance(value, bool):
        raise RequestError(f"{where}: {quoted(value)} is not a whole number")
    if isinstance(value, int):
        number = value
    else:
        text = str(value).strip()
        if not re.fullmatch(r"[0-9]+", text):
            raise RequestError(f"{where}: {quoted(value)} is not a whole number")
        number = int(text)
    if number < 0:
        raise RequestError(f"{where}: {number} is negative")
    return number


def _container_request(pod: str, spec: Mapping[str, Any], init: bool) -> ContainerRequest:
    name = spec.get("name") or "?"
    resources = spec.get("resources") or {}
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    # Kubernetes defaults requests to limits for extended resources and forbids them differing.
    values = {r: limits.get(r, requests.get(r)) for r in RESOURCES}
    mem = (
        _parse_quantity(values[RESOURCE_MEM], f"pod {pod} container {name} {RESOURCE_MEM}")
        if values[RESOURCE_MEM] is not None
        else 0
    )
    count = (
        _parse_quantity(values[RESOURCE_COUNT], f"pod {pod} container {name} {RESOURCE_COUNT}")
        if values[RESOURCE_COUNT] is not None
        else 0
    )
    if mem and count and mem % count:
        raise RequestError(
            f"pod {pod} container {name}: {RESOURCE_MEM}={mem} is not divisible by {RESOURCE_COUNT}={count}"
        )
    return ContainerRequest(name=name, init=init, mem=mem, count=count)


#: (uid, resourceVersion) -> (the fields the request was parsed from, the request)
_REQUEST_MEMO: dict[tuple[str, str], tuple[tuple[Any, ...], PodRequest]] = {}
_REQUEST_MEMO_SIZE = 16384


def _request_source(pod: Mapping[str, Any]) -> tuple[Any, ...]:
    """Every field a :class:`PodRequest` is built from, as they are in ``pod``."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    return (
        meta.get("namespace"),
        meta.get("name"),
        [(c.get("name"), c.get("resources")) for c in spec.get("initContainers") or []],
        [(c.get("name"), c.get("resources")) for c in spec.get("containers") or []],
    )


def parse_pod_request(pod: Mapping[str, Any]) -> PodRequest:
    """The GPU request of every container (init containers first, in spec order).

    Results are memoised by (uid, resourceVersion), since Allocate re-reads every pod on the node on
    each call; a hit is only used when the fields it was parsed from are equal to this pod's, because
    anyone can send the extender a pod body with a real pod's uid and version but other limits.
    """
    meta = pod.get("metadata") or {}
    memo_key = (meta.get("uid") or "", meta.get("resourceVersion") or "")
    source = _request_source(pod)
    if all(memo_key) and (hit := _REQUEST_MEMO.get(memo_key)) is not None and hit[0] == source:
        return hit[1]
    spec = pod.get("spec") or {}
    key = pod_key(pod)
    containers = tuple(_container_request(key, c, True) for c in spec.get("initContainers") or []) + tuple(
        _container_request(key, c, False) for c in spec.get("containers") or []
    )
    request = PodRequest(
        namespace=meta.get("namespace", "default"),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        containers=containers,
    )
    if all(memo_key):
        if len(_REQUEST_MEMO) >= _REQUEST_MEMO_SIZE:
            _REQUEST_MEMO.clear()
        _REQUEST_MEMO[memo_key] = (source, request)
    return request


def requests_gpu(pod: Mapping[str, Any]) -> bool:
    """True when any container names a gpushare resource (even with a malformed value)."""
    spec = pod.get("spec") or {}
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        res = c.get("resources") or {}
        if any(r in (res.get("limits") or {}) or r in (res.get("requests") or {}) for r in RESOURCES):
            return True
    return False


# --- allocation annotation ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, order=True)
class CardSlice:
    """``units`` of one card given to one container."""

    index: int
    uuid: str
    units: int


Allocation = dict[str, tuple[CardSlice, ...]]


def _parse_slice(pod: str, container: str, raw: Any) -> CardSlice:
    where = f"pod {pod} annotation {ANN_ALLOCATION} container {quoted(container)}"
    if not isinstance(raw, dict):
        raise AnnotationError(f"{where}: entry {quoted(raw)} is not an object")
    index, uuid, units = raw.get("index"), raw.get("uuid"), raw.get("units")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise AnnotationError(f"{where}: card index {quoted(index)} is not a non-negative integer")
    if not isinstance(uuid, str) or not uuid.startswith("GPU-"):
        raise AnnotationError(f"{where}: card uuid {quoted(uuid)} is not a GPU UUID")
    if not isinstance(units, int) or isinstance(units, bool) or units <= 0:
        raise AnnotationError(f"{where}: units {quoted(units)} on card {index} is not a positive integer")
    return CardSlice(index=index, uuid=uuid, units=units)


def json_object(text: str, where: str, expected: str) -> dict[str, Any]:
    """Parse an annotation that must hold a JSON object; errors name the object and annotation."""
    try:
        raw = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise AnnotationError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise AnnotationError(f"{where}: expected {expected}")
    return raw


def parse_allocation(text: str, pod: str = "?") -> Allocation:
    where = f"pod {pod} annotation {ANN_ALLOCATION}"
    raw = json_object(text, where, "an object of container name -> cards")
    result: Allocation = {}
    for container, slices in raw.items():
        if not isinstance(slices, list) or not slices:
            raise AnnotationError(f"{where}: container {quoted(container)} has no card list")
        parsed = tuple(_parse_slice(pod, container, s) for s in slices)
        if len({s.uuid for s in parsed}) != len(parsed):
            raise AnnotationError(f"{where}: container {quoted(container)} lists the same card twice")
        result[container] = parsed
    return result


def format_allocation(allocation: Mapping[str, tuple[CardSlice, ...]]) -> str:
    return json.dumps(
        {
            name: [{"index": s.index, "uuid": s.uuid, "units": s.units} for s in slices]
            for name, slices in sorted(allocation.items())
        },
        separators=(",", ":"),
    )


def parse_card_index(text: str, pod: str = "?") -> int:
    try:
        index = int(str(text).strip())
    except ValueError:
        raise AnnotationError(f"pod {pod} annotation {ANN_MEM_IDX}: {quoted(text)} is not an integer") from None
    if index < 0:
        raise AnnotationError(f"pod {pod} annotation {ANN_MEM_IDX}: {index} is negative")
    return index


def parse_assume_time(text: str, pod: str = "?") -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise AnnotationError(
            f"pod {pod} annotation {ANN_MEM_ASSUME_TIME}: {quoted(text)} is not integer nanoseconds"
        ) from None
    if value < 0:
        raise AnnotationError(f"pod {pod} annotation {ANN_MEM_ASSUME_TIME}: {value} is negative")
    return value


def format_assume_time(ns: int) -> str:
    return str(int(ns))


def parse_bool(text: str | None) -> bool:
    return str(text).strip().lower() == "true"


def format_bool(value: bool) -> str:
    return "true" if value else "false"


def parse_assigned_containers(text: str | None, pod: str = "?") -> dict[str, frozenset[str]]:
    """Which resources the device plugin has served to each container (JSON name -> [resource])."""
    if not text:
        return {}
    where = f"pod {pod} annotation {ANN_ASSIGNED_CONTAINERS}"
    try:
        raw = json.loads(text)
    except ValueError:
        raise AnnotationError(f"{where}: not valid JSON") from None
    if not isinstance(raw, dict) or not all(
        isinstance(v, list) and all(r in RESOURCES for r in v) for v in raw.values()
    ):
        raise AnnotationError(f"{where}: expected an object of container name -> list of gpushare resources")
    return {name: frozenset(served) for name, served in raw.items()}


def format_assigned_containers(served: Mapping[str, frozenset[str]]) -> str:
    return json.dumps({name: sorted(res) for name, res in sorted(served.items())}, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class PendingBind:
    """A bind recorded on its node before its binding: the pod, its units per card UUID, and when
    (seconds since the epoch)."""

    pod: str
    held: Mapping[str, int]
    at: float


def parse_pending_binds(text: str | None, node: str = "?") -> dict[str, PendingBind]:
    """The node's pending binds by pod UID (JSON uid -> {pod, held: {card uuid: units}, at})."""
    if not text:
        return {}
    where = f"node {node} annotation {NODE_ANN_PENDING_BINDS}"
    try:
        raw = json.loads(text)
        return {
            uid: PendingBind(str(e["pod"]), {str(k): int(v) for k, v in e["held"].items()}, float(e["at"]))
            for uid, e in raw.items()
        }
    except (ValueError, TypeError, KeyError, AttributeError):
        raise AnnotationError(f"{where}: expected an object of pod uid -> {{pod, held, at}}") from None


def format_pending_binds(pending: Mapping[str, PendingBind]) -> str:
    return json.dumps(
        {
            uid: {"pod": p.pod, "held": dict(sorted(p.held.items())), "at": round(p.at, 3)}
            for uid, p in sorted(pending.items())
        },
        separators=(",", ":"),
    )


def annotations_of(pod: Mapping[str, Any]) -> Mapping[str, str]:
    return (pod.get("metadata") or {}).get("annotations") or {}


def validate_allocation(request: PodRequest, allocation: Allocation) -> None:
    """Check that an allocation is shaped like the request it claims to serve."""
    for c in request.gpu_containers:
        slices = allocation.get(c.name)
        where = f"pod {request.key} container {c.name}"
        if not slices:
            raise AnnotationError(f"{where}: requests a GPU but {ANN_ALLOCATION} assigns it no card")
        if len(slices) != c.cards:
            raise AnnotationError(f"{where}: requests {c.cards} card(s) but is assigned {len(slices)}")
        if not c.exclusive and any(s.units != c.units_per_card for s in slices):
            raise AnnotationError(
                f"{where}: requests {c.units_per_card} unit(s) per card but is assigned {[s.units for s in slices]}"
            )


def assigned_env(slices: tuple[CardSlice, ...], pod_mem: int, card_units: Mapping[str, int]) -> dict[str, str]:
    """The env a container receives for its cards (original gpushare variables included)."""
    return {
        ENV_VISIBLE_DEVICES: ",".join(s.uuid for s in slices),
        ENV_MEM_IDX: ",".join(str(s.index) for s in slices),
        ENV_MEM_POD: str(pod_mem),
        ENV_MEM_CONTAINER: str(sum(s.units for s in slices)),
        ENV_MEM_DEV: str(card_units.get(slices[0].uuid, 0)),
    }


# --- node inventory annotation --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeInventory:
    unit: MemoryUnit
    cards: tuple[Card, ...]
    #: set when the cards were inferred from the node's status (no inventory annotation): how
    inferred: str | None = None

    def units_of(self, card: Card) -> int:
        return self.unit.units_of(card.memory_mib)


def format_inventory(cards: Iterable[Card], unit: MemoryUnit) -> str:
    return json.dumps(
        {
            "version": INVENTORY_VERSION,
            "unit": format_unit(unit),
            "unitMiB": unit.mib,
            "cards": [
                {
                    "index": c.index,
                    "uuid": c.uuid,
                    "model": c.model,
                    "memoryMiB": c.memory_mib,
                    "units": unit.units_of(c.memory_mib),
                    "minor": c.minor,
                    "numa": c.numa_node,
                    "nvlinkPeers": list(c.nvlink_peers),
                    "healthy": c.healthy,
                }
                for c in sorted(cards, key=lambda c: c.index)
            ],
        },
        separators=(",", ":"),
    )


def _inventory_card(node: str, raw: Any) -> Card:
    where = f"node {node} annotation {NODE_ANN_INVENTORY}"
    if not isinstance(raw, dict):
        raise AnnotationError(f"{where}: card entry {quoted(raw)} is not an object")
    try:
        card = Card(
            index=int(raw["index"]),
            uuid=str(raw["uuid"]),
            model=str(raw.get("model", "")),
            memory_mib=int(raw["memoryMiB"]),
            minor=int(raw["minor"]),
            numa_node=None if raw.get("numa") is None else int(raw["numa"]),
            nvlink_peers=tuple(str(p) for p in raw.get("nvlinkPeers") or ()),
            healthy=bool(raw.get("healthy", True)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise AnnotationError(f"{where}: card entry {quoted(raw)} is missing or has a bad field ({exc})") from None
    if not card.uuid.startswith("GPU-") or card.index < 0 or card.memory_mib <= 0:
        raise AnnotationError(f"{where}: card entry {quoted(raw)} has an invalid uuid, index or memory")
    return card


def parse_inventory(text: str, node: str = "?") -> NodeInventory:
    where = f"node {node} annotation {NODE_ANN_INVENTORY}"
    raw = json_object(text, where, f"an object with version {INVENTORY_VERSION}")
    if raw.get("version") != INVENTORY_VERSION:
        raise AnnotationError(f"{where}: expected an object with version {INVENTORY_VERSION}")
    try:
        unit = parse_unit(str(raw.get("unit", "")))
    except ContractError as exc:
        raise AnnotationError(f"{where}: {exc}") from None
    cards = tuple(_inventory_card(node, c) for c in raw.get("cards") or [])
    if len({c.uuid for c in cards}) != len(cards) or len({c.index for c in cards}) != len(cards):
        raise AnnotationError(f"{where}: the same card index or uuid appears twice")
    return NodeInventory(unit=unit, cards=tuple(sorted(cards, key=lambda c: c.index)))


def format_model_label(cards: Iterable[Card]) -> str:
    """Label value naming the node's card model(s): sanitised to the label charset, joined by '_'."""
    models = sorted({re.sub(r"[^A-Za-z0-9._-]", "-", c.model).strip("-._") or "unknown" for c in cards})
    return "_".join(models)[:63].strip("-._")


# --- framework allocation annotation (newer variant of the original extender) ----------------------


def format_framework_allocation(amounts: Mapping[str, Mapping[int, int]], request: PodRequest) -> str:
    """``{"<app container position>": {"<card number>": units}}`` from container name -> card number ->
    units. The original components count containers in ``spec.containers`` only, so init containers
    can't be named, and number cards by their /dev/nvidia minor."""
    positions = {c.name: i for i, c in enumerate(c for c in request.containers if not c.init)}
    if unknown := sorted(set(amounts) - set(positions)):
        raise AnnotationError(
            f"pod {request.key}: {ANN_FRAMEWORK_ALLOCATION} can't name init or unknown containers {quoted(unknown)}"
        )
    return json.dumps(
        {
            str(positions[name]): {str(number): units for number, units in sorted(cards.items())}
            for name, cards in sorted(amounts.items(), key=lambda item: positions[item[0]])
        },
        separators=(",", ":"),
    )
