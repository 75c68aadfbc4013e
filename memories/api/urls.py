from django.urls import path

from memories.api import langgraph, views

# Keys never contain "/" (see memories/validation.py), so <str:key> takes the whole key.
urlpatterns = [
    path("tools", views.ToolListView.as_view(), name="tools-list"),
    path("tools/call", views.ToolCallView.as_view(), name="tools-call"),
    path("tools/batch", views.ToolBatchView.as_view(), name="tools-batch"),
    path("memories", views.MemoryListView.as_view(), name="memories-list"),
    path("memories/<str:key>", views.MemoryDetailView.as_view(), name="memories-detail"),
    path("memories/<str:key>/history", views.MemoryHistoryView.as_view(), name="memories-history"),
    path("summaries", views.SummaryStartView.as_view(), name="summaries-create"),
    # Jobs and forget requests by their uid; any other segment (an old numeric id) is 404.
    path("jobs/<str:job_id>", views.JobDetailView.as_view(), name="jobs-detail"),
    path("forget-requests", views.ForgetRequestListView.as_view(), name="forget-requests-list"),
    path("forget-requests/<str:request_id>", views.ForgetRequestDetailView.as_view(), name="forget-requests-detail"),
    path("langgraph/store/items", langgraph.StoreItemsView.as_view(), name="langgraph-store-items"),
    path("langgraph/store/items/search", langgraph.StoreSearchView.as_view(), name="langgraph-store-search"),
    path("langgraph/store/namespaces", langgraph.StoreNamespacesView.as_view(), name="langgraph-store-namespaces"),
    path("anthropic/memory", views.AnthropicMemoryView.as_view(), name="anthropic-memory"),
    path("subjects/<str:subject>/portal-link", views.PortalLinkCreateView.as_view(), name="subjects-portal-link"),
]
