#!/usr/bin/env python
import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "zeromem.settings")
    # A bare checkout (no .env, no SECRET_KEY) is a developer's: manage.py works there in
    # development mode. Anything with a SECRET_KEY keeps the secure default (production);
    # the ASGI/WSGI entry points never fall back.
    if "ZEROMEM_ENV" not in os.environ and "SECRET_KEY" not in os.environ:
        from pathlib import Path

        if not (Path(__file__).resolve().parent / ".env").exists():
            os.environ["ZEROMEM_ENV"] = "development"
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
