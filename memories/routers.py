"""Wrapped data keys (``DataKey``) live in the key store database when
``ZEROMEM_KEYSTORE_URL`` is set (alias ``keystore``), else in the main one; nothing else
lives in the key store."""

from django.conf import settings


def _is_keystore_model(model) -> bool:
    return model._meta.app_label == "memories" and model._meta.model_name == "datakey"


class KeystoreRouter:
    def db_for_read(self, model, **hints):
        return settings.ZEROMEM_KEYSTORE_DATABASE if _is_keystore_model(model) else None

    db_for_write = db_for_read

    def allow_relation(self, obj1, obj2, **hints):
        return None

    def allow_migrate(self, db, app_label, model_name=None, **hints):
        keystore = settings.ZEROMEM_KEYSTORE_DATABASE
        if keystore == "default":
            return None
        if db == keystore:
            return app_label == "memories" and model_name == "datakey"
        if app_label == "memories" and model_name == "datakey":
            return False
        return None
