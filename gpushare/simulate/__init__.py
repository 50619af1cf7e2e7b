"""What-if placement: replay a cluster's GPU pods (in the openb trace format) under placement policies.

``trace`` reads the CSVs, ``replay`` runs one arrival order through one policy, ``baselines`` holds the
reference policies of the FGD paper (``product`` the extender's own), ``runs`` runs a policy's replay and
returns its numbers, ``report`` writes them, ``cmd`` is ``gpushare simulate``.
"""
