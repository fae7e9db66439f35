"""``bench sync``: one weight sync, the bridge against the baseline and the raw transfer
(``run.py``; a rank's measurements: ``rank.py``; the result: ``summary.py``).
"""
