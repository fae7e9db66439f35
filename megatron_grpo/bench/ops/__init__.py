"""``bench ops``: the ATen ops and host syncs of one train step and one log-prob pass
(``run.py``), counted by ``count.py``.
"""
