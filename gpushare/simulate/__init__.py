"""What-if placement: replay a cluster's GPU pods (in the openb trace format) under placement policies.

``trace`` reads the CSVs, ``replay`` runs one arrival order through one policy, ``baselines`` holds the
reference policies of the FGD paper, ``report`` writes the results, ``cmd`` is ``gpushare simulate``.
"""
