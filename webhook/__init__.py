"""Admission webhook: only gpushare's own service accounts may write gpushare's pod annotations."""
