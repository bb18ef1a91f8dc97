"""Hand-built fakes and inputs shared by several test modules (importable as ``support.*``
because pyproject.toml puts ``tests/`` on pytest's ``pythonpath``). Test modules import from here,
never from each other."""
