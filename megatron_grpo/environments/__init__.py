"""Environments of multi-turn episodes (``env.*``; docs/environments.md): the contract a
user's class meets (``contract``), the threads that call it under time limits (``runner``),
and the built-in safe calculator (``calculator``)."""
