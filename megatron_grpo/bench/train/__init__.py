"""``bench train``: the policy against a plain and a padding-free Hugging Face model
(``run.py``; arguments, batch, sides, measurement, table).
"""
