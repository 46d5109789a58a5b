"""What composes the services: the `jaxstream` command, the launcher behind `jaxstream up`, the
scheduler core driving an engine in one process (`driver.py`), and `jaxstream bench`.

It sits above every service package and imports them; nothing under `jaxstream/` (the contract,
transport and config that every service imports) may import it back (tests/unit/test_boundaries.py).
"""
