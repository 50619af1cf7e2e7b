"""The kubelet DRA plugin of driver ``gpu.gpushare.io``: prepares ResourceClaims allocated from the
node's cards by writing one CDI spec per claim. The device naming scheme it shares with the node's
ResourceSlice is :mod:`gpushare.contract.dra`."""
