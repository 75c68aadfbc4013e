"""Django's PostgreSQL backend, with a connection check that costs no round trip (base.py)."""
