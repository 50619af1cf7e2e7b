"""What a node's cards are and what each pod on it holds: the rules every component reads, one module each.

:mod:`~gpushare.holdings.pod` (what a pod holds by its annotations and the node's ledger),
:mod:`~gpushare.holdings.dra` (what it holds through ResourceClaims, and the env they give a container)
and :mod:`~gpushare.holdings.node` (a node's cards and ledger, and the sum of what its pods hold).
"""
