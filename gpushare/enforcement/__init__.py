"""The node's decision about a container being created, whichever way the node hears of it: the CRI
shim (``gpushare.crishim``) between kubelet and the runtime, or the NRI plugin (``gpushare.nriplugin``)
inside containerd. Each transport turns what it sees into a :class:`~gpushare.enforcement.container.ContainerRequest`
at its edge, asks :mod:`~gpushare.enforcement.resolve` and :mod:`~gpushare.enforcement.rewrite` for a
:class:`~gpushare.enforcement.container.Decision`, and applies that to its own message;
:mod:`~gpushare.enforcement.limits` sets the pod's GPU memory limits for both."""
