#!/usr/bin/env bash
# Print the interpreter `make install` builds .venv with: Python 3.12 where this machine has
# it (on PATH as python3.12, or one of pyenv's installed 3.12 versions), else python3 with
# one line on stderr saying what to install for the current megatron-core (0.19 needs 3.12).
set -u
is_312() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }
candidates=(python3.12)
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root 2>/dev/null) && candidates+=("$root"/versions/3.12*/bin/python3.12)
fi
for p in "${candidates[@]}"; do
  if is_312 "$p"; then command -v "$p"; exit 0; fi
done
echo "make: Python 3.12 not found, using $(python3 --version 2>&1) (megatron-core 0.16.1); for megatron-core 0.19 install Python 3.12 (e.g. 'pyenv install 3.12') and run 'make clean-venv install'" >&2
echo python3
