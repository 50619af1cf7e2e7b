"""What a failed API call raises. Only the standard library here: the CLI catches these at start-up
cost nil, while the kubernetes client takes a third of a second to import."""

from __future__ import annotations


class KubeError(Exception):
    """An API call failed; the message names the object."""


class KubeConfigError(KubeError):
    """No usable kubeconfig or in-cluster configuration."""


class KubeUnavailable(KubeError):
    """The API server can't be reached or answers 5xx."""


class KubeConflict(KubeError):
    """409: a precondition failed or the object changed underneath us."""


class KubeNotFound(KubeError):
    """404."""


class KubeCacheBehind(KubeUnavailable):
    """504 ResourceVersionTooLarge: the API server's watch cache didn't reach the asked resourceVersion
    in time (it moves only on events of that resource, so a list at another resource's version can wait
    for nothing)."""
