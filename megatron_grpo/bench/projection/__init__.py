"""``bench project``: throughput against v and sync time projected from the static plan
(``model.py``, ``moe.py``, the window schedule model), printed by ``table.py``.
"""
