"""The surface kit: what the surfaces (REST API and tool endpoints, admin, portal) share,
so that no surface imports another: the audited API base view and the one error envelope
(:mod:`~zeromem.kit.api`), the client address (:mod:`~zeromem.kit.http`) and the admin's
tenant scoping (:mod:`~zeromem.kit.admin`). It calls services; services never import it.
"""
