"""gpushare's NRI plugin: containerd calls it at CreateContainer (and at a pod sandbox's stop and removal)
over the Node Resource Interface, and its answer adjusts or refuses the container.

- :mod:`~gpushare.nriplugin.session`: one connection to the runtime's NRI socket, and reconnecting;
  the :class:`~gpushare.nriplugin.session.PluginHandler` protocol the decisions are written against.
- :mod:`~gpushare.nriplugin.handler`: those decisions, the CRI shim's (:mod:`gpushare.enforcement`) taken
  on what NRI shows (:mod:`~gpushare.nriplugin.edge`), and the check of the running containers at each
  session's start (:mod:`~gpushare.nriplugin.sync`).
- :mod:`~gpushare.nriplugin.wiring`: the plugin as a component of ``gpushare node --enforcement=nri``.
"""
