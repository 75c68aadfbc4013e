from django.urls import path

from audit import api

urlpatterns = [
    path("audit-events", api.AuditEventListView.as_view(), name="audit-events-list"),
    path("audit-events/export", api.AuditExportView.as_view(), name="audit-events-export"),
    path("audit-checkpoints", api.AuditCheckpointView.as_view(), name="audit-checkpoints-create"),
]
