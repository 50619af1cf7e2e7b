"""Every wire name gpushare shares with Kubernetes, kubelet, the CRI runtime and the original gpushare:
resource names, annotation keys, labels, env var names and device paths. No other module spells one.

The original Alibaba keys (``ALIYUN_COM_GPU_MEM_*``) are kept verbatim so that pods, device plugins and
extenders of the original project interoperate with ours. On top of them we add a per-container
allocation annotation, which is what makes multi-container and multi-card pods work.
"""

from __future__ import annotations

# --- resources ------------------------------------------------------------------------------------

RESOURCE_MEM = "aliyun.com/gpu-mem"
RESOURCE_COUNT = "aliyun.com/gpu-count"
RESOURCES = (RESOURCE_MEM, RESOURCE_COUNT)
#: Kubernetes' own resources, read for the host-aware placement policy
RESOURCE_CPU = "cpu"
RESOURCE_MEMORY = "memory"
#: how many pods a node takes (kubelet's --max-pods, 110 by default)
RESOURCE_PODS = "pods"

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
#: the node where the extender holds cards for this gang member; written (and removed) when the gang's
#: plan changes, because an update to a Pending pod is what makes kube-scheduler retry it at once
ANN_GANG_HOLD = "gpushare.io/gang-hold"
#: when the extender last saw room free up while this member's gang could not all be placed; changing it
#: makes kube-scheduler retry the member, which it would otherwise do only on its next periodic flush
ANN_GANG_RETRY = "gpushare.io/gang-retry"
#: when the extender last saw room free up on a node where it had refused this pod for want of room;
#: changing it makes kube-scheduler retry the pod (see extender/roomwaiters.py)
ANN_RETRY = "gpushare.io/retry"
#: per-pod placement policy override
ANN_POLICY = "gpushare.io/policy"
#: card models the pod accepts, ``|``-separated patterns (see :func:`gpushare.placement.model_matches`)
ANN_GPU_MODEL = "gpushare.io/gpu-model"
#: card models the pod must not get, the same way
ANN_GPU_MODEL_AVOID = "gpushare.io/gpu-model-avoid"
#: "true": every two distinct cards of the pod must be NVLink peers
ANN_REQUIRE_NVLINK = "gpushare.io/require-nvlink"
#: "true": all the pod's cards must sit on one NUMA node
ANN_REQUIRE_SAME_NUMA = "gpushare.io/require-same-numa"
#: "true": every card of the pod must have the NVIDIA driver enforce its GPU memory share
ANN_REQUIRE_MEMORY_LIMIT = "gpushare.io/require-memory-limit"
#: what a pod asks of its cards, in the order messages name them
CARD_RULE_ANNOTATIONS = (
    ANN_GPU_MODEL,
    ANN_GPU_MODEL_AVOID,
    ANN_REQUIRE_NVLINK,
    ANN_REQUIRE_SAME_NUMA,
    ANN_REQUIRE_MEMORY_LIMIT,
)
#: pod annotations only gpushare's extender and node agent may write (admission webhook and policy)
PROTECTED_ANNOTATION_PREFIXES = ("gpushare.io/", "ALIYUN_COM_GPU_MEM_")
#: protected by prefix, but the pod's owner chooses them
TENANT_ANNOTATIONS = frozenset({ANN_POLICY, *CARD_RULE_ANNOTATIONS})
#: protected without a prefix: the newer original extender's allocation
PROTECTED_ANNOTATIONS = frozenset({ANN_FRAMEWORK_ALLOCATION})
#: the pod annotations gpushare's extender and node agent write (the original gpushare's included)
GPUSHARE_ANNOTATIONS = frozenset(
    {
        ANN_ALLOCATION,
        ANN_ASSIGNED_CONTAINERS,
        ANN_GANG_HOLD,
        ANN_GANG_RETRY,
        ANN_RETRY,
        ANN_MEM_IDX,
        ANN_MEM_POD,
        ANN_MEM_DEV,
        ANN_MEM_ASSIGNED,
        ANN_MEM_ASSUME_TIME,
        ANN_FRAMEWORK_ALLOCATION,
    }
)
#: every pod annotation key gpushare reads or writes; any other under its prefixes is a mistake
KNOWN_POD_ANNOTATIONS = TENANT_ANNOTATIONS | GPUSHARE_ANNOTATIONS


def protected_annotation(key: str) -> bool:
    return key in PROTECTED_ANNOTATIONS or (
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


# --- container annotations, from the device plugin to the CRI shim --------------------------------

CTR_ANN_POD_UID = "gpushare.io/pod-uid"
CTR_ANN_POD = "gpushare.io/pod"
CTR_ANN_CONTAINER = "gpushare.io/container"
CTR_ANN_CARDS = "gpushare.io/cards"

# --- node annotation and label (advertiser) -------------------------------------------------------

NODE_ANN_INVENTORY = "gpushare.io/inventory"
#: bumped by every extender bind: the compare-and-swap on the node that orders binds across replicas
NODE_ANN_BIND_SEQUENCE = "gpushare.io/bind-sequence"
#: the extender's ledger, written by its bind with the compare-and-swap on the node: every pod it bound
#: there (from before its binding until the pod is gone or finished) with what it holds per card. Tenants
#: can't write nodes, so every component counts a pod's cards from here over its own annotations.
NODE_ANN_PENDING_BINDS = "gpushare.io/pending-binds"
#: set by the node agent: "true" while kubelet watches its device plugin, "false" from the moment kubelet
#: goes (its ListAndWatch streams end) until a kubelet is watching again; absent reads as "true"
NODE_ANN_KUBELET_WATCHING = "gpushare.io/kubelet-watching"
#: the label (key, value) of the node agent DaemonSet's pods, in the namespace gpushare is installed in
NODE_AGENT_LABEL = ("app.kubernetes.io/name", "gpushare-node-agent")
NODE_LABEL_MODEL = "gpushare.io/gpu-model"
#: the taint kube-scheduler reads into a cordoned node (``spec.unschedulable``)
TAINT_UNSCHEDULABLE = "node.kubernetes.io/unschedulable"
#: the one field a node affinity's ``matchFields`` may name
FIELD_NODE_NAME = "metadata.name"

# --- pod labels (the pod's owner sets them) -------------------------------------------------------

#: the gang a pod belongs to (within its namespace): its members are bound all together or not at all
LABEL_GANG = "gpushare.io/gang"
#: how many of the gang's members must be placeable at the same time before any is bound
LABEL_GANG_MIN = "gpushare.io/gang-min"
#: every pod label key gpushare reads
KNOWN_POD_LABELS = frozenset({LABEL_GANG, LABEL_GANG_MIN})

# --- the chart's own kube-scheduler ---------------------------------------------------------------

#: the profile (``spec.schedulerName``) of the kube-scheduler the chart runs with the extender wired in;
#: also its leader-election lease's name
SCHEDULER_NAME = "gpushare-scheduler"
#: the scheduler a pod gets when it names none
DEFAULT_SCHEDULER_NAME = "default-scheduler"
#: namespace label: with the value NAMESPACE_SCHEDULER_OPT_OUT, the chart's MutatingAdmissionPolicy leaves
#: the namespace's GPU pods with the scheduler they name (the default one, unless they say otherwise)
NAMESPACE_LABEL_SCHEDULER = "gpushare.io/scheduler"
NAMESPACE_SCHEDULER_OPT_OUT = "default"
#: the Service kube-scheduler reaches the extender at, and the variables kubelet gives every pod created
#: after it in its namespace (``<NAME>_SERVICE_HOST`` and ``_PORT``, the name upper-cased, - as _)
EXTENDER_SERVICE = "gpushare-extender"


def service_env_prefix(service: str) -> str:
    """The prefix of the variables kubelet sets for ``service`` (its pkg/kubelet/envvars: upper case, - as _)."""
    return service.upper().replace("-", "_")


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
#: what NVIDIA's container toolkit hook ``nvidia-cdi-hook apply-cuda-memory-limits`` reads (MiB; the plural
#: first) and sets as the soft and hard limit of the container's cgroup, where it is installed
ENV_TOOLKIT_MEMORY_REQUEST = ("NVIDIA_GPU_MEMORY_REQUESTS", "NVIDIA_GPU_MEMORY_REQUEST")
ENV_TOOLKIT_MEMORY_LIMIT = ("NVIDIA_GPU_MEMORY_LIMITS", "NVIDIA_GPU_MEMORY_LIMIT")

# --- process env ----------------------------------------------------------------------------------

ENV_NODE_NAME = "NODE_NAME"
#: the node agent pod's UID (downward API): a detached CRI shim is adopted only by its own pod's agent
ENV_POD_UID = "POD_UID"

# --- device files ---------------------------------------------------------------------------------

DEV_CONTROL_FILES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
CDI_KIND = "nvidia.com/gpu"


def device_file(minor: int) -> str:
    return f"/dev/nvidia{minor}"


def cdi_device_name(uuid: str) -> str:
    return f"{CDI_KIND}={uuid}"


#: container annotations whose values name CDI devices (fully qualified, comma-separated): how kubelets
#: before 1.31 passed DRA devices, and containerd still applies them beside the CRI field CDI_devices
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"

# --- the Node Resource Interface (containerd's NRI) -----------------------------------------------

#: where containerd (and CRI-O) listen for external NRI plugins unless configured otherwise
#: (github.com/containerd/nri pkg/api/plugin.go, DefaultSocketPath)
NRI_SOCKET = "/var/run/nri/nri.sock"
#: the name gpushare's NRI plugin registers with, and its index: plugins are called in ascending index
#: order (two digits), so a later plugin sees the env and devices gpushare set
NRI_PLUGIN_NAME = "gpushare"
NRI_PLUGIN_INDEX = "10"


# --- dynamic resource allocation (resource.k8s.io/v1) ---------------------------------------------

#: the DRA driver: ResourceSlices' ``spec.driver``, allocation results' ``driver``, the kubelet plugin's
#: name, the DeviceClass's name and the attributes' domain (see gpushare/contract/dra.py)
DRA_DRIVER = "gpu.gpushare.io"
DRA_API_VERSION = "resource.k8s.io/v1"
#: the CDI kind of the specs the kubelet plugin writes, one spec per prepared claim
DRA_CDI_KIND = "gpu.gpushare.io/claim"
#: the consumable capacity of each card, in bytes (``device.capacity["gpu.gpushare.io"].memory``)
DRA_CAPACITY_MEMORY = "memory"
#: device attributes (``device.attributes["gpu.gpushare.io"].<name>``)
DRA_ATTR_UUID = "uuid"
DRA_ATTR_INDEX = "index"
DRA_ATTR_MINOR = "minor"
DRA_ATTR_MODEL = "model"
DRA_ATTR_NUMA = "numa"
#: the lowest NVML index of the NVLink clique the card belongs to; only on cards in a clique
DRA_ATTR_NVLINK_CLIQUE = "nvlinkClique"
#: device names in the node's ResourceSlice are ``card-<NVML index>`` (see :mod:`gpushare.contract.dra`)
DRA_DEVICE_PREFIX = "card-"
#: the one env variable a claim's CDI device sets (``GPUSHARE_CLAIM_<UID>_<REQUEST>``: the request's card
#: UUIDs); the GPU env a container sees is set by the CRI shim over all its claims (gpushare/holdings/dra.py)
DRA_CDI_ENV_PREFIX = "GPUSHARE_CLAIM_"
#: annotations of a prepared claim's CDI spec: the claim (``<namespace>/<name>``) and the memory it holds
#: on each card (``<card UUID>=<bytes>,...``), which the kubelet plugin sums before preparing another claim
DRA_SPEC_ANN_CLAIM = "gpu.gpushare.io/claim"
DRA_SPEC_ANN_MEMORY = "gpu.gpushare.io/memory"


def dra_slice_name(node: str) -> str:
    """The one ResourceSlice this driver publishes for ``node``."""
    return f"{node}-{DRA_DRIVER}"
