from django.apps import AppConfig
from django.db.models.signals import post_delete, post_save


class MemoriesConfig(AppConfig):
    name = "memories"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        # A key or tenant changed by a model save (the admin, a shell) leaves this process's
        # API key cache at once; the services call key_cache.forget themselves for their
        # QuerySet.update()s, which send no signal.
        from memories.models import ApiKey, Tenant
        from memories.services import key_cache

        for signal, name in ((post_save, "save"), (post_delete, "delete")):
            signal.connect(key_cache.forget_key, sender=ApiKey, dispatch_uid=f"key_cache.key.{name}")
            signal.connect(key_cache.forget_all, sender=Tenant, dispatch_uid=f"key_cache.tenant.{name}")

        # A long answer (an export stream) stops at its next part once its key is withdrawn.
        from memories.services.api_keys import key_withdrawn
        from memories.services.memberships import staff_withdrawn
        from zeromem.kernel.actors import register_withdrawn_check
        from zeromem.kernel.outcomes import ActorKind

        register_withdrawn_check(ActorKind.API_KEY, key_withdrawn)
        register_withdrawn_check(ActorKind.STAFF, staff_withdrawn)

        from django.core.checks import Tags, register

        from zeromem.kernel import checks  # noqa: F401  registers the deploy checks

        register(_master_keys_open_data_keys, Tags.database)

        # The connection pool's check without a round trip for a connection just used, when
        # asked for (DB_POOL_CHECK_FRESH_SECONDS): otherwise no receiver runs at each checkout.
        from django.conf import settings

        if settings.ZEROMEM_DB_POOL_CHECK_FRESH_SECONDS > 0:
            from django.db.backends.signals import connection_created

            from zeromem.dbpool import fresh_check_installed

            connection_created.connect(fresh_check_installed, dispatch_uid="zeromem.dbpool")

        # Traces (ZEROMEM_TRACING): django-q2 workers set up tracing when they start and run
        # each task in a span. Off: nothing is connected.
        from zeromem.kernel import tracing

        tracing.connect_tasks()


def _master_keys_open_data_keys(app_configs, databases=None, **kwargs):
    """``manage.py check --database default`` (and ``python -m zeromem.serving check``, run by
    ``serve`` and ``up``): ZEROMEM_MASTER_KEYS must hold every master key that wraps a stored
    data key, or ZeroMem refuses to start (README "Encryption at rest")."""
    from django.core.checks import Error
    from django.db import DatabaseError

    from memories.keyring import master_keys_problem

    if not databases:
        return []
    try:
        problem = master_keys_problem()
    except DatabaseError:  # not migrated yet (``migrate`` checks first): no data key stored
        return []
    return [Error(problem, id="zeromem.E012")] if problem else []
