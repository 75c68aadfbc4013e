"""``manage.py migrate`` with a ``lock_timeout`` on PostgreSQL (``ZEROMEM_MIGRATION_LOCK_TIMEOUT``
seconds, default 5; 0: no limit): a migration that cannot get its table lock within it fails
with a message saying so, rolled back, instead of queueing every request of the table behind
its waiting ALTER (zeromem/kernel/migrating.py; ``… CONCURRENTLY`` statements still wait).

Django's own command otherwise, options and all (``call_command("migrate")`` — the test
database's creation too — runs this one: an app's command takes the place of Django's)."""

from __future__ import annotations

from django.conf import settings
from django.core.management import CommandError
from django.core.management.commands import migrate
from django.db import OperationalError, connections

from zeromem.kernel.migrating import lock_not_available, migration_lock_timeout


class Command(migrate.Command):
    help = migrate.Command.help + " On PostgreSQL, table locks are asked with ZEROMEM_MIGRATION_LOCK_TIMEOUT."

    _current = None  # (migration, applying?) being run

    def handle(self, *args, **options):
        connection = connections[options["database"]]
        seconds = float(getattr(settings, "ZEROMEM_MIGRATION_LOCK_TIMEOUT", 0) or 0)
        if getattr(settings, "ZEROMEM_PGBOUNCER", False) and options["database"] == "default":
            # A session setting behind PgBouncer (transaction mode) lands on whichever server
            # connection runs the statement, and stays there for other clients: not set.
            self.stderr.write(
                "ZEROMEM_PGBOUNCER is on: migrating without a lock_timeout; "
                "run migrate against PostgreSQL directly to get one (README: Running on PostgreSQL at scale)"
            )
            seconds = 0
        self._current = None
        with migration_lock_timeout(connection, seconds):
            try:
                return super().handle(*args, **options)
            except OperationalError as exc:
                if not lock_not_available(exc) or self._current is None:
                    raise
                raise CommandError(self._lock_message(seconds)) from exc

    def migration_progress_callback(self, action, migration=None, fake=False):
        if action in ("apply_start", "unapply_start"):
            self._current = (migration, action == "apply_start")
        elif action in ("apply_success", "unapply_success"):
            self._current = None
        super().migration_progress_callback(action, migration, fake)

    def _lock_message(self, seconds: float) -> str:
        migration, applying = self._current
        name = f"{migration.app_label}.{migration.name}"
        kept = (
            "it was rolled back: nothing of it is applied"
            if migration.atomic
            else "it is not atomic: the statement that waited changed nothing, steps before it stay, "
            "and it is written to be run again"
        )
        return (
            f"{'applying' if applying else 'unapplying'} migration {name} stopped: a table lock it needs "
            f"was not granted within {seconds:g} s (ZEROMEM_MIGRATION_LOCK_TIMEOUT) — another transaction "
            f"holds a lock on the table (see pg_stat_activity and pg_locks); {kept}. The migrations "
            "before it are applied. Run migrate again once that transaction has ended, or raise "
            "ZEROMEM_MIGRATION_LOCK_TIMEOUT (0: wait as long as it takes, queueing the table's requests "
            "behind the migration)."
        )
