"""ASGI entry point (uvicorn). An MCP endpoint can be mounted beside Django here later."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "zeromem.settings")
application = get_asgi_application()
