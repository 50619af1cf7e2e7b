"""GPU memory limits the NVIDIA driver enforces per cgroup (driver 615+, cgroup v2): which cgroup a
container is in (:mod:`~gpushare.memlimits.cgroups`), what its limits are (:mod:`~gpushare.memlimits.policy`)
and setting them (:mod:`~gpushare.memlimits.enforcer`)."""
