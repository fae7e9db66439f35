"""``bench throughput``: measured steps/s against v (``run.py``), its plots and markdown
(``report.py``), and how close the ahead schedule's samples are (``ahead_identity.py``).
"""
