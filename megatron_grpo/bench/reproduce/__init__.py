"""``bench reproduce``: the source papers' claims at tiny scale (``run.py``), their runs
(``claims.py``), verdicts (``stats.py``) and report (``report.py``).
"""
