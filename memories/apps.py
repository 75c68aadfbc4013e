from django.apps import AppConfig


class MemoriesConfig(AppConfig):
    name = "memories"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from zeromem.kernel import checks  # noqa: F401  registers the deploy checks
