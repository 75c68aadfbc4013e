import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "zeromem.settings")
# Traces (ZEROMEM_TRACING): this process's own tracer provider, before Django builds its
# middleware chain (the request span is a middleware) and opens a connection. Off: nothing.
from zeromem.kernel import tracing  # noqa: E402

tracing.setup()
application = get_wsgi_application()

# Tool calls that need nothing of Django's request handling skip it (memories/api/lane.py).
from memories.api.lane import ToolLane  # noqa: E402

application = ToolLane(application)

# The server's access log writes a portal link's path without its token.
from zeromem.kit.logs import install_on_access_logs  # noqa: E402

install_on_access_logs()

# Each server process starts loading the embedding model now, in a background thread
# (about 3 s): searches meanwhile run on words alone instead of waiting for it.
from memories.search.embeddings import warm_up  # noqa: E402

warm_up()

# Imports done: what they left lives as long as the process (zeromem/kernel/heap.py).
from zeromem.kernel.heap import freeze_long_lived  # noqa: E402

freeze_long_lived()
