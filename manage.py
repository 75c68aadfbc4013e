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
            if os.environ.get("DATABASE_URL"):
                # A database of its own is a deployment's, not a bare checkout's: never run
                # it with development's public SECRET_KEY (and audit key derived from it).
                sys.stderr.write(
                    "manage.py: DATABASE_URL is set but SECRET_KEY is not. Set SECRET_KEY (and "
                    "ZEROMEM_AUDIT_KEY) for production, or ZEROMEM_ENV=development for a "
                    "development database.\n"
                )
                sys.exit(2)
            os.environ["ZEROMEM_ENV"] = "development"
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
