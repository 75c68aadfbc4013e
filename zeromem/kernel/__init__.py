"""The kernel: what both apps (``memories`` and ``audit``) and every surface stand on.

Who acts (:mod:`~zeromem.kernel.actors`), what they may do (:mod:`~zeromem.kernel.scopes`),
how a refused call is said (:mod:`~zeromem.kernel.errors`), what an outcome is
(:mod:`~zeromem.kernel.outcomes`) and the input rules every service applies
(:mod:`~zeromem.kernel.validation`), and the spans of traces (:mod:`~zeromem.kernel.tracing`,
which imports OpenTelemetry only when tracing is on). It imports Django and the standard
library only, never an app: the models, the services and the surfaces import it (the layer contract in
pyproject.toml keeps it so).
"""
