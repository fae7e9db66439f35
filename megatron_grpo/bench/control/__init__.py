"""``bench control``: a command's round trip over the disaggregated placement's control
channel between two processes (``run.py``), beside the store-polling channel it replaced
(``store_channel.py``).
"""
