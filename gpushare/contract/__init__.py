"""The gpushare contract: what other components, Kubernetes and the original gpushare read and write.

:mod:`~gpushare.contract.names` holds every resource name, annotation key, label and env var name; the
other modules parse and format one thing each: :mod:`~gpushare.contract.request` (a pod's GPU request),
:mod:`~gpushare.contract.allocation` (our allocation annotations), :mod:`~gpushare.contract.aliyun`
(the original gpushare's formats), :mod:`~gpushare.contract.pending` (the extender's ledger and gang holds),
:mod:`~gpushare.contract.gang` (a pod's gang labels),
:mod:`~gpushare.contract.inventory` (the node's inventory annotation),
:mod:`~gpushare.contract.cardrule` (what a pod asks of its cards: model, NVLink, NUMA), :mod:`~gpushare.contract.env`
(a GPU container's env), :mod:`~gpushare.contract.units` (the memory unit) and
:mod:`~gpushare.contract.errors` (the errors, and quoting untrusted values in them).
"""
